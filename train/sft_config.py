"""``SFTConfig``: the run config of ``specdec train-sft`` (configs/train/*_sft.yaml), with
the same strict YAML loading and ``section.key=value`` overrides as ``TrainConfig``. The
``optim`` and ``run`` sections are train-draft's."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.train.config import (
    OptimSection,
    RunSection,
    SectionedConfig,
    _at_least,
    _choice,
    _require,
)


@dataclass
class SFTModelSection:
    base: str = "smollm2-135m-instruct"  # alias, HF dir, .gguf or hub name: the model tuned
    attention: str = "auto"  # auto | sdpa | varlen (train/packed_attention.py)

    def __post_init__(self) -> None:
        _choice("model", "attention", self.attention, ("auto", "sdpa", "varlen"))


@dataclass
class SFTDataSection:
    train: str = ""  # chat records (JSONL): reasoning traces or any data_gen records
    eval: str = ""  # held-out records for the eval loss ("" : none)
    eval_records: int = 512  # N records of ``eval``, evenly spaced over the file
    max_tokens: int = 16384  # tokens per micro-batch (whole sequences packed)
    max_seq_len: int = 2048  # longer sequences are cut
    seed: int = 0  # record shuffling per epoch

    def __post_init__(self) -> None:
        _require(
            bool(self.train),
            "data.train is empty: set the training records (JSONL), "
            "e.g. from `specdec data-gen reasoning-traces`",
        )
        _at_least("data", self, 2, "max_tokens", "max_seq_len")
        _at_least("data", self, 0, "eval_records")


def _every_projection() -> tuple[str, ...]:
    from specdec.models.lora import PROJECTIONS  # torch: only when a config is built

    return tuple(PROJECTIONS)


@dataclass
class LoraSection:
    """LoRA instead of a full fine-tune (``rank`` > 0): the base frozen, low-rank updates
    of the ``targets`` projections trained, and the export a PEFT adapter directory of a
    few MB (``specdec.models.lora``) that names ``model.base``."""

    rank: int = 0  # 0: full fine-tune
    alpha: float = 32.0  # updates scale by alpha / rank
    targets: tuple[str, ...] = field(default_factory=_every_projection)
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _at_least("lora", self, 0, "rank")
        if self.rank:
            self.spec()  # validates targets and dropout, naming the bad value

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def spec(self):
        from specdec.models.lora import LoraSpec

        try:
            return LoraSpec(self.rank, self.alpha, tuple(self.targets), self.dropout)
        except ValueError as e:
            raise ValueError(f"lora: {e}") from None


@dataclass
class ExportSection:
    dtype: str = "bfloat16"  # weights of the exported model
    shard_mb: float = 16.0  # largest safetensors file; bigger tensors are split by rows
    name: str = "model"  # the model directory under run.output_dir

    def __post_init__(self) -> None:
        _choice("export", "dtype", self.dtype, ("bfloat16", "float16", "float32"))
        _require(self.shard_mb > 0, f"export.shard_mb={self.shard_mb} must be > 0")
        _require(
            bool(self.name) and "/" not in self.name,
            f"export.name={self.name!r} must be a plain directory name",
        )


@dataclass
class SFTConfig(SectionedConfig):
    model: SFTModelSection = field(default_factory=SFTModelSection)
    data: SFTDataSection = field(default_factory=SFTDataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    run: RunSection = field(default_factory=RunSection)
    lora: LoraSection = field(default_factory=LoraSection)
    export: ExportSection = field(default_factory=ExportSection)
