"""``TrainConfig``: one YAML file per run (configs/train/), sections mapping one to one
onto the dataclasses below; ``section.key=value`` overrides on the command line. Unknown
sections or keys are errors that list the known ones."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

import yaml

from specdec.models.head_variants import HEAD_VARIANTS
from specdec.train.draft_loss import DRAFT_LOSSES

# The drafters train-draft trains (``trainer.DRAFTERS`` builds each): EAGLE-3 heads (the
# ``ttt`` section) and DFlash-style block drafters (the ``block`` section).
DRAFTER_NAMES = ("eagle3", "block")

if TYPE_CHECKING:
    from typing_extensions import Self


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _choice(section: str, key: str, value: str, options: tuple[str, ...]) -> None:
    _require(value in options, f"{section}.{key}={value!r}; choose one of {' | '.join(options)}")


def _at_least(section: str, obj: object, minimum: float, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        _require(value >= minimum, f"{section}.{key}={value} must be >= {minimum}")


@dataclass
class ModelSection:
    target: str = "smollm2-135m-instruct"  # alias, HF dir, .gguf or hub name
    drafter: str = "eagle3"  # eagle3 (an EAGLE-3 head, TTT) | block (a block drafter)
    vocab: str | None = None  # data_gen's vocab.safetensors (d2t/t2d) or its directory;
    # None: vocab.safetensors next to data.path or in it
    draft_vocab_size: int | None = None  # checked against the vocab file when both are set
    # None: the dump's (offline), else a block init_head's, else EAGLE-3's default (online)
    aux_layer_ids: list[int] | None = None
    # Start from this head directory (an EAGLE-3 head, or a block drafter for drafter=block)
    # instead of a fresh one, with a fresh optimizer; it keeps its own draft vocabulary
    # unless `vocab` is set too (then rows move by token). A checkpoint in run.output_dir
    # still wins (run.resume).
    init_head: str | None = None
    # The head's MLP width. None: init_head's, else the target's. Wider than init_head's:
    # the trained head is widened exactly (new units start silent: train/model.widen_mlp).
    intermediate_size: int | None = None
    # The head's decoder layers. None: init_head's, else 1 (EAGLE-3's; 2 for a block
    # drafter). More than init_head's:
    # the trained head is deepened exactly (new layers start silent: train/model.deepen).
    # vLLM serves deeper heads; SGLang and EAGLE load one layer only.
    num_layers: int | None = None
    # The head's variant (specdec.models.head_variants): eagle3, or eagle3.1
    # (a norm on each fused aux state, post-norm states fed back). None: init_head's, else
    # eagle3. An EAGLE-3 init_head continues as EAGLE-3.1 with fresh norms (weight 1).
    variant: str | None = None

    def __post_init__(self) -> None:
        _require(self.intermediate_size is None or self.intermediate_size >= 1,
                 f"model.intermediate_size={self.intermediate_size} must be >= 1")  # fmt: skip
        _require(self.num_layers is None or self.num_layers >= 1,
                 f"model.num_layers={self.num_layers} must be >= 1")  # fmt: skip
        if self.variant is not None:
            _choice("model", "variant", self.variant, tuple(HEAD_VARIANTS))
        _choice("model", "drafter", self.drafter, DRAFTER_NAMES)
        _require(self.drafter != "block" or self.variant is None,
                 f"model.variant={self.variant!r} is an EAGLE-3 setting; a block drafter "
                 "(model.drafter=block) has no variants: drop it")  # fmt: skip


@dataclass
class DataSection:
    mode: str = "offline"  # offline: data_gen dump shards; online: the target runs in the loop
    # dump directory (offline), or one or more regenerate directories (online), e.g.
    # data.path=[data/smollm2/regen,data/smollm2/documents-regen]: their records train as one
    path: str | tuple[str, ...] = ""
    max_tokens: int = 4096  # tokens per micro-batch (whole sequences packed)
    max_seq_len: int = 2048  # longer sequences are cut (and counted)
    eval_shards: int = 1  # offline: the manifest's last N shards form the held-out split
    eval_records: int = 16  # online: N records spread evenly over the data, held out
    seed: int = 0  # shuffling of shards and of sequences within a shard

    def __post_init__(self) -> None:
        _choice("data", "mode", self.mode, ("offline", "online"))
        _require(bool(self.path) and all(self.paths), "data.path is empty: set the dump "
                 "(offline) or regenerate (online) directory")  # fmt: skip
        _require(self.mode == "online" or len(self.paths) == 1,
                 f"data.path={list(self.paths)}: offline training reads one dump directory; "
                 "pass one, or train online from regenerate directories")  # fmt: skip
        _at_least("data", self, 2, "max_tokens", "max_seq_len")
        _at_least("data", self, 0, "eval_shards", "eval_records")

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,) if isinstance(self.path, str) else self.path


@dataclass
class TTTSection:
    steps: int = 7  # unrolled draft steps
    decay: float = 0.8  # step i's loss weight is decay**i
    attention: str = "auto"  # auto (flex on CUDA, else reference) | flex | reference
    # Share of each label on the target's argmax (train/ttt.py): 0 = EAGLE-3's soft labels,
    # 1 = hard labels, the event greedy verification accepts.
    argmax_weight: float = 0.0
    # The per-position draft loss (train/draft_loss.py): ce (EAGLE-3's soft cross-entropy),
    # lk_alpha (-log of the acceptance rate) or lk_hybrid (KL blended into 1 - acceptance
    # as the draft gets close, weight exp(-lk_eta * acceptance)).
    loss: str = "ce"
    lk_eta: float = 3.0

    def __post_init__(self) -> None:
        _at_least("ttt", self, 1, "steps")
        _choice("ttt", "loss", self.loss, tuple(DRAFT_LOSSES))
        _require(self.lk_eta >= 0, f"ttt.lk_eta={self.lk_eta} must be >= 0")
        _require(0 < self.decay <= 1, f"ttt.decay={self.decay} must be in (0, 1]")
        _require(0 <= self.argmax_weight <= 1,
                 f"ttt.argmax_weight={self.argmax_weight} must be in [0, 1] (0: the target's "
                 "distribution, 1: its argmax)")  # fmt: skip
        _choice("ttt", "attention", self.attention, ("auto", "flex", "reference"))


@dataclass
class BlockSection:
    """The block drafter (``model.drafter=block``; specdec/models/block_drafter.py,
    train/block_loss.py)."""

    # The anchor + B-1 drafted slots (vLLM: num_speculative_tokens + 1). None: model.init_head's,
    # else 16.
    block_size: int | None = None
    # Anchors per micro-batch, drawn among the eligible positions of all its sequences.
    # None: ceil(data.max_tokens / block_size), about one block token per context token.
    anchors: int | None = None
    gamma: float | None = None  # slot k's weight exp(-(k-1)/gamma); None: 7 (B=16), 4 (B=8)
    # The masked slots' input token. None: model.init_head's, else the tokenizer's first of
    # <|MASK|>, <empty_output> (block_drafter.MASK_TOKEN_CANDIDATES): a reserved token chat
    # never emits.
    mask_token_id: int | None = None
    # Draft over the target's whole vocabulary with its frozen lm_head (DFlash's own
    # setup) instead of the pruned draft vocabulary (model.vocab) with a trained lm_head.
    target_lm_head: bool = False
    loss: str = "ce"  # ce | lk_alpha | lk_hybrid (train/draft_loss.py), per slot
    lk_eta: float = 3.0
    # Share of each slot's label on the target's argmax: 1 = the greedy token (DFlash's
    # hard labels), 0 = the target's distribution over the draft vocabulary.
    argmax_weight: float = 1.0
    attention: str = "auto"  # auto (flex on CUDA, else reference) | flex | reference

    def __post_init__(self) -> None:
        _require(self.block_size is None or self.block_size >= 2,
                 f"block.block_size={self.block_size} must be >= 2")  # fmt: skip
        _require(self.anchors is None or self.anchors >= 1,
                 f"block.anchors={self.anchors} must be >= 1")  # fmt: skip
        _require(self.gamma is None or self.gamma > 0, f"block.gamma={self.gamma} must be > 0")
        _require(self.mask_token_id is None or self.mask_token_id >= 0,
                 f"block.mask_token_id={self.mask_token_id} must be a token id (>= 0)")  # fmt: skip
        _choice("block", "loss", self.loss, tuple(DRAFT_LOSSES))
        _require(self.lk_eta >= 0, f"block.lk_eta={self.lk_eta} must be >= 0")
        _require(0 <= self.argmax_weight <= 1,
                 f"block.argmax_weight={self.argmax_weight} must be in [0, 1]")  # fmt: skip
        _choice("block", "attention", self.attention, ("auto", "flex", "reference"))


@dataclass
class SpecExitSection:
    """SpecExit channels on the head (docs/spec_exit.md); ``signals`` empty: off. Labels
    come from each sequence's think span (``think_start``/``think_end``: text resolved
    with the target's tokenizer, any number of tokens, or a list of token ids) and, for
    confidence, the records' ``spec_exit_confidence`` (``data-gen exit-labels``; a dump
    carries them as a per-token tensor)."""

    signals: tuple[str, ...] = ()  # any of confidence, progress, remaining
    think_start: str | tuple[int, ...] = "<think>"
    think_end: str | tuple[int, ...] = "</think>"
    confidence_weight: float = 1.0
    progress_weight: float = 1.0
    remaining_weight: float = 1.0
    remaining_loss: str = "huber"  # huber | mse, on log1p(tokens)
    # Which probe's label a token between probes takes (spec_exit_labels.CONFIDENCE_HOLDS):
    # next_probe (that of the boundary closing its step, what serving decides on) or
    # previous_probe (that of the boundary opening it; its exits come one step late,
    # spec_exit_labels' docstring).
    confidence_hold: str = "next_probe"
    # Train only the channels, on top of a trained head (model.init_head), frozen.
    freeze_draft: bool = False

    def __post_init__(self) -> None:
        from specdec.models.exit_signals import canonical_signals
        from specdec.train.spec_exit_labels import CONFIDENCE_HOLDS

        try:
            self.signals = canonical_signals(self.signals)
        except ValueError as err:
            raise ValueError(f"spec_exit.signals: {err}") from None
        _at_least("spec_exit", self, 0, "confidence_weight", "progress_weight",
                  "remaining_weight")  # fmt: skip
        _choice("spec_exit", "remaining_loss", self.remaining_loss, ("huber", "mse"))
        _choice("spec_exit", "confidence_hold", self.confidence_hold,
                tuple(CONFIDENCE_HOLDS))  # fmt: skip
        _require(not self.freeze_draft or bool(self.signals),
                 "spec_exit.freeze_draft=true trains only the exit channels; set "
                 "spec_exit.signals too")  # fmt: skip

    @property
    def weights(self) -> dict[str, float]:
        return {s: getattr(self, f"{s}_weight") for s in self.signals}


@dataclass
class OptimSection:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    grad_accum: int = 1  # micro-batches per optimizer step (per process)
    warmup_steps: int = 100
    max_steps: int = 10_000  # optimizer steps; the data repeats as needed
    min_lr_ratio: float = 0.0  # the cosine ends at lr * min_lr_ratio

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        _at_least("optim", self, 1, "grad_accum", "max_steps")
        _at_least("optim", self, 0, "warmup_steps", "grad_clip", "weight_decay", "min_lr_ratio")


@dataclass
class RunSection:
    output_dir: str = "runs/eagle3"
    seed: int = 0
    mixed_precision: str = "auto"  # auto (bf16 on GPU, no on CPU) | no | bf16 | fp16
    save_every: int = 1000  # optimizer steps between checkpoints
    keep_last: int = 3
    eval_every: int = 500
    log_every: int = 10
    wandb: str = "offline"  # offline | online | disabled (used only when wandb is installed)
    wandb_project: str = "specdec"
    resume: bool = True  # continue from the newest checkpoint in output_dir if any
    # Wall-clock budget from the command's start (set-up, compilation and evaluations
    # included): at the first optimizer step past it the run evaluates, saves a checkpoint
    # and its result (head or model), then returns (rerun to continue); leave a margin for
    # that. For machines held for a fixed time and job time limits; the lr schedule still
    # spans max_steps.
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise ValueError(
                f"run.time_limit_s={self.time_limit_s} must be > 0 (or null for no limit)"
            )
        _choice("run", "mixed_precision", self.mixed_precision, ("auto", "no", "bf16", "fp16"))
        _choice("run", "wandb", self.wandb, ("offline", "online", "disabled"))
        _at_least("run", self, 1, "save_every", "keep_last", "eval_every", "log_every")


class SectionedConfig:
    """A run config made of section dataclasses (``TrainConfig``, the SFT recipe's
    ``SFTConfig``): strict YAML loading, overrides and ``to_dict`` for every subclass."""

    # ---- loading ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """Nested dict (a YAML file) -> config; unknown sections or keys raise."""
        sections = {f.name: f for f in fields(cls)}
        unknown = set(data) - set(sections)
        if unknown:
            raise ValueError(
                f"unknown config sections {sorted(unknown)}; known: {sorted(sections)}"
            )
        built = {}
        for name in sections:
            section_cls = get_type_hints(cls)[name]
            values = data.get(name) or {}
            if not isinstance(values, dict):
                raise ValueError(f"config section {name!r} must be a mapping, got {values!r}")
            known = {sf.name for sf in fields(section_cls)}
            bad = set(values) - known
            if bad:
                raise ValueError(f"unknown keys {sorted(f'{name}.{k}' for k in bad)}; "
                                 f"known in {name!r}: {sorted(known)}")  # fmt: skip
            built[name] = section_cls(**_coerce(name, section_cls, values))
        return cls(**built)

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] = ()) -> Self:
        """The YAML file (or the defaults) with ``section.key=value`` overrides applied;
        values parse as YAML (``optim.lr=3e-4``, ``model.aux_layer_ids=[2,15,27]``)."""
        data: dict[str, Any] = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text())
            if loaded is not None and not isinstance(loaded, dict):
                raise ValueError(f"{path}: a train config is a mapping of sections")
            data = loaded or {}
        for item in overrides:
            key, sep, raw = item.partition("=")
            parts = key.split(".")
            if not sep or len(parts) != 2 or not all(parts):
                raise ValueError(f"override {item!r} must look like section.key=value")
            data.setdefault(parts[0], {})
            if not isinstance(data[parts[0]], dict):
                raise ValueError(f"override {item!r}: section {parts[0]!r} is not a mapping")
            data[parts[0]][parts[1]] = yaml.safe_load(raw)
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainConfig(SectionedConfig):
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    ttt: TTTSection = field(default_factory=TTTSection)
    optim: OptimSection = field(default_factory=OptimSection)
    run: RunSection = field(default_factory=RunSection)
    spec_exit: SpecExitSection = field(default_factory=SpecExitSection)
    block: BlockSection = field(default_factory=BlockSection)

    def __post_init__(self) -> None:
        _require(self.model.drafter != "block" or not self.spec_exit.signals,
                 "spec_exit.signals trains SpecExit channels on an EAGLE-3 head; a block "
                 "drafter (model.drafter=block) has none: drop them")  # fmt: skip


def _coerce(section: str, section_cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """YAML values -> the field types: lists become tuples where a tuple is wanted, and
    numbers PyYAML leaves as strings (``3e-4``) become floats; anything else that does not
    fit raises, naming the key."""
    hints = get_type_hints(section_cls)
    out = dict(values)
    for key, value in values.items():
        hint = str(hints[key])
        if isinstance(value, list) and "tuple" in hint:
            out[key] = tuple(value)
        elif hint in ("float", "<class 'float'>") and isinstance(value, (int, str)):
            try:
                out[key] = float(value)
            except ValueError:
                raise ValueError(f"{section}.{key}={value!r} is not a number") from None
        elif hint in ("int", "<class 'int'>") and not isinstance(value, int):
            raise ValueError(f"{section}.{key}={value!r} must be an integer")
        elif hint in ("bool", "<class 'bool'>") and not isinstance(value, bool):
            raise ValueError(f"{section}.{key}={value!r} must be true or false")
    return out
