"""``evaluate_head``: an EAGLE-3 head judged on record sets as greedy chain decoding would
accept its drafts (``specdec eval-draft``).

Per set (a ``specdec data-gen regenerate`` directory), the target runs over the records
(``TargetForward``) and the head unrolls its TTT steps on them (``ttt_forward``, the
trainer's own objective, with the reference TTT attention), micro-batch by micro-batch as
the trainer packs them. Figures:

- ``acc_i`` and ``simulated_tau``: the trainer's (``ttt.py``), summed over the set;
- ``chains``: for each chain length K, the steps and accepted tokens the engine would
  count generating the records' answers (``chain_replay.py``), pooled over the set as
  ``specdec bench`` pools requests: τ = 1 + accepted / steps;
- ``coverage``: the fraction of answer tokens the draft vocabulary holds;
- ``greedy_agreement``: the fraction of answer tokens that are the target's argmax after
  the tokens before them, as the replay assumes (1.0 for greedy answers of this target,
  up to ties in the argmax).

``by_source`` judges each set's records grouped by their prompt's source (the ``source``
that ``data-gen prompts`` records and regenerate keeps): one row ``<set>/<source>`` per
source, after the set's own row, which pools them. Each answer is judged once either way.

The replay's figures equal the engine's on the tokens the target emitted greedily, when
the answers' ``max_tokens`` is known (the regenerate manifest records it) and no record was
clipped to fit ``max_tokens`` or the head's positions (a clipped answer replays as if
max_tokens had cut it there; they are counted as ``clipped``). regenerate stores each
answer's text re-tokenized, which differs from the emitted tokens where the target emitted
a non-canonical tokenization (2 of 16 humaneval answers of 128 tokens for SmolLM2):
``greedy_agreement`` below 1 shows it. One bound: past an answer's end-of-turn
token the engine still counts accepted drafts, and the replay sees the target's
continuation there only as far as the record holds it (``chain_replay.checkable``), so it
may count fewer. ``simulated_tau`` is not a replay: it averages the leading run over every
answer position whose next token the head can emit, as if each were a chain's root.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from specdec.data_gen.target import DTYPES
from specdec.spec.metrics import SpecStats
from specdec.train.chain_replay import (
    answer_spans,
    chain_leading,
    checkable,
    greedy_agreement,
    replay_answers,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from specdec.data_gen.dump_plan import TokenRecord
    from specdec.data_gen.target import TargetForward
    from specdec.models.eagle3_head import Eagle3Head
    from specdec.train.ttt import PackedBatch


@dataclass(frozen=True)
class EvalConfig:
    """What to judge and how. ``records``: (set name, records directory) pairs; ``head``
    None: the head shipped for ``model``; ``chains`` empty: 1..``steps``; ``max_tokens``:
    tokens per packed micro-batch (longer records are clipped); ``answer_max_tokens``: the
    max_tokens the answers were generated with (None: each set's regenerate manifest's);
    ``per_answer``: also keep each answer's replayed steps and accepted tokens;
    ``by_source``: also report each set per prompt source (module docstring)."""

    records: tuple[tuple[str, str], ...]
    head: str | None = None
    model: str = "smollm2-135m-instruct"
    steps: int = 7
    chains: tuple[int, ...] = ()
    device: str = "cpu"
    dtype: str = "float32"
    max_tokens: int = 4096
    answer_max_tokens: int | None = None
    per_answer: bool = False
    by_source: bool = False

    def __post_init__(self) -> None:
        if not self.records:
            raise ValueError("no record sets: pass --records NAME=DIR (repeatable)")
        names = [name for name, _ in self.records]
        if len(set(names)) != len(names):
            raise ValueError(f"record set names repeat: {names}; name them with NAME=DIR")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        bad = [k for k in self.chains if not 1 <= k <= self.steps]
        if bad:
            raise ValueError(
                f"chain lengths {bad} are outside 1..{self.steps}: the replay reads at most "
                f"steps={self.steps} drafts per chain; raise --steps or drop them"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 2")
        if self.answer_max_tokens is not None and self.answer_max_tokens < 1:
            raise ValueError(f"answer_max_tokens={self.answer_max_tokens} must be >= 1")

    @property
    def chain_lengths(self) -> tuple[int, ...]:
        """The chain lengths K to replay: ``chains``, or 1..steps when none are named."""
        return self.chains or tuple(range(1, self.steps + 1))


@dataclass
class SetFigures:
    """One record set's sums (figures derive from them; ``to_dict`` reports both)."""

    name: str
    path: str
    answer_max_tokens: int | None  # None: unknown, the replay cuts no answer
    temperature: float | None  # the regenerate manifest's, if recorded
    clip_tokens: int  # longer sequences are cut to this many tokens
    sequences: int = 0
    clipped: int = 0  # sequences cut to clip_tokens
    answers: int = 0
    answer_tokens: int = 0  # loss-masked tokens
    kept_answer_tokens: int = 0  # of those, in the draft vocabulary
    greedy_tokens: int = 0  # replayed answer tokens after each answer's first
    greedy_agree: int = 0  # of those, the target's argmax after the tokens before them
    step_correct: list[int] = field(default_factory=list)  # [steps]
    step_valid: list[int] = field(default_factory=list)  # [steps]
    leading: int = 0  # sum of leading runs over step-0-valid positions
    valid0: int = 0
    chains: dict[int, SpecStats] = field(default_factory=dict)
    # K -> [[steps, accepted] per answer, in record order (a set pooled from its sources:
    # source by source)]; empty unless asked
    per_answer: dict[int, list[list[int]]] = field(default_factory=dict)

    @classmethod
    def pooled(cls, name: str, parts: list[SetFigures]) -> SetFigures:
        """One set's figures summed from its parts' (the same set's records, split)."""
        first = parts[0]
        out = cls(name, first.path, first.answer_max_tokens, first.temperature,
                  first.clip_tokens, step_correct=[0] * len(first.step_correct),
                  step_valid=[0] * len(first.step_valid),
                  chains={k: SpecStats() for k in first.chains},
                  per_answer={k: [] for k in first.per_answer})  # fmt: skip
        counts = ("sequences", "clipped", "answers", "answer_tokens", "kept_answer_tokens",
                  "greedy_tokens", "greedy_agree", "leading", "valid0")  # fmt: skip
        for part in parts:
            for key in counts:
                setattr(out, key, getattr(out, key) + getattr(part, key))
            for i, (c, v) in enumerate(zip(part.step_correct, part.step_valid, strict=True)):
                out.step_correct[i] += c
                out.step_valid[i] += v
            for k, stats in part.chains.items():
                out.chains[k].merge(stats)
            for k, rows in part.per_answer.items():
                out.per_answer[k] += rows
        return out

    @property
    def acc(self) -> list[float]:
        pairs = zip(self.step_correct, self.step_valid, strict=True)
        return [c / v if v else float("nan") for c, v in pairs]

    @property
    def simulated_tau(self) -> float:
        return 1.0 + self.leading / self.valid0 if self.valid0 else 1.0

    @property
    def coverage(self) -> float:
        return self.kept_answer_tokens / self.answer_tokens if self.answer_tokens else 0.0

    @property
    def greedy_agreement(self) -> float:
        return self.greedy_agree / self.greedy_tokens if self.greedy_tokens else 1.0

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("chains", "per_answer")}
        out.update(
            acc=self.acc,
            simulated_tau=self.simulated_tau,
            coverage=self.coverage,
            greedy_agreement=self.greedy_agreement,
            chains={
                str(k): {"tau": s.tau, **asdict(s), "acceptance_rates": s.acceptance_rates}
                for k, s in self.chains.items()
            },
        )
        if self.per_answer:
            out["per_answer"] = {str(k): v for k, v in self.per_answer.items()}
        return out


def evaluate_head(config: EvalConfig, progress: bool = True) -> list[SetFigures]:
    """Judge ``config.head`` on every record set (module docstring), in order."""
    judge = HeadJudge.load(config)
    out: list[SetFigures] = []
    for (name, root), (manifest, records) in zip(config.records, judge.sets, strict=True):
        if not config.by_source:
            batches = judge.forward_batches(name, records, progress)
            out.append(judge.judge(name, root, manifest, batches))
            continue
        parts = []
        for source, group in by_source(records).items():
            label = f"{name}/{source or NO_SOURCE}"
            batches = judge.forward_batches(label, group, progress)
            parts.append(judge.judge(label, root, manifest, batches))
        out += [SetFigures.pooled(name, parts), *parts]
    return out


NO_SOURCE = "-"  # the row name of records whose prompt recorded no source


def by_source(records: list[TokenRecord]) -> dict[str, list[TokenRecord]]:
    """The records grouped by prompt source, sources sorted, record order kept in each."""
    groups: dict[str, list[TokenRecord]] = {}
    for r in records:
        groups.setdefault(r.source, []).append(r)
    return dict(sorted(groups.items()))


@dataclass
class HeadJudge:
    """The loaded models, settings and record sets every set is judged with. The target's
    forward (``forward_batches``) and the head's judgement (``judge``) are separate steps, so
    a caller may keep a set's forwarded batches and judge several heads' lm_heads on them;
    ``evaluate_head`` streams them."""

    config: EvalConfig
    head: Eagle3Head  # with a TTT attention backend, embedding bound
    forward: TargetForward
    lm_head: torch.Tensor  # [vocab, hidden]: the target's
    label_weight: torch.Tensor  # [draft_vocab, hidden]: its kept-id rows
    t2d: np.ndarray  # [vocab] bool: the head's kept ids
    max_seq_len: int  # records are clipped to this many tokens
    sets: list[tuple[dict[str, Any], list[TokenRecord]]]  # per config.records: manifest, records

    @classmethod
    def load(cls, config: EvalConfig) -> HeadJudge:
        from specdec.data_gen.target import TargetForward
        from specdec.models import load_config, resolve_model
        from specdec.models.eagle3_formats import load_eagle3, read_eagle3_config
        from specdec.train.model import TargetIO, attention_backend, draft_rows

        device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto"
            else config.device
        )  # fmt: skip
        dtype = DTYPES[config.dtype]
        # Every input is checked before the models load (seconds), so a typo fails at once.
        head_dir = resolve_head(config.head, config.model)
        resolved = resolve_model(config.model)
        target_config = load_config(resolved)
        head_config = read_eagle3_config(head_dir, target_config)
        check_head_target(head_config.target_name, config.model, resolved.name, head_dir)
        sets = [_read_set(name, root, target_config.vocab_size) for name, root in config.records]
        target = TargetIO.load(config.model).to(device, dtype)
        head = load_eagle3(head_dir, target_config=target.config, dtype=dtype, device=device,
                           attention=attention_backend("reference", device))  # fmt: skip
        head.bind_embedding(lambda ids: torch.nn.functional.embedding(ids, target.embed))
        head.eval()
        # Positions past the head's RoPE table would be clamped (ttt.unroll): clip there.
        max_seq_len = min(config.max_tokens, head.rotary.num_positions)
        forward = TargetForward(config.model, device=device, dtype=dtype,
                                aux_layer_ids=head.config.aux_layer_ids,
                                max_seq_len=max_seq_len)  # fmt: skip
        return cls(config, head, forward, target.lm_head, draft_rows(head, target.lm_head),
                   head.t2d.cpu().numpy(), max_seq_len, sets)  # fmt: skip

    def forward_batches(
        self, name: str, records: list[TokenRecord], progress: bool = True
    ) -> Iterator[tuple[PackedBatch, np.ndarray]]:
        """The records packed as the trainer packs them (in record order), each micro-batch
        with the target's states filled in, and which of its records were clipped."""
        from specdec.train.data import assemble, clip, pack

        config = self.config
        lengths = [len(r.input_ids) for r in records]
        refs = pack([(0, lengths)], config.max_tokens, self.max_seq_len)  # in record order
        for ref in tqdm(refs, desc=f"eval-draft {name}", unit="batch", disable=not progress):
            recs = [records[i] for _, i in ref.items]
            sizes = [clip(len(r.input_ids), config.max_tokens, self.max_seq_len) for r in recs]
            batch = assemble([(r.input_ids[:n], r.loss_mask[:n], None, None)
                              for r, n in zip(recs, sizes, strict=True)])  # fmt: skip
            clipped = np.array([len(r.input_ids) > n for r, n in zip(recs, sizes, strict=True)])
            with torch.inference_mode():
                batch.target_hidden, batch.aux_hidden = self.forward(
                    batch.input_ids.numpy(), np.array(sizes)
                )
            yield batch, clipped

    def judge(self, name: str, root: str, manifest: dict[str, Any],
              batches: Iterable[tuple[PackedBatch, np.ndarray]]) -> SetFigures:  # fmt: skip
        """One set's figures from its forwarded micro-batches (``forward_batches``)."""
        from specdec.train.ttt import ttt_forward

        config = self.config
        limit = config.answer_max_tokens
        if limit is None and manifest.get("stage") == "regenerate":
            limit = manifest.get("max_tokens")
        chains = config.chain_lengths
        figures = SetFigures(
            name, str(root), limit, manifest.get("temperature"), self.max_seq_len,
            step_correct=[0] * config.steps, step_valid=[0] * config.steps,
            chains={k: SpecStats() for k in chains},
            per_answer={k: [] for k in chains} if config.per_answer else {},
        )  # fmt: skip
        for batch, clipped in batches:
            with torch.inference_mode():
                out = ttt_forward(self.head, batch.to(self.lm_head.device), self.lm_head,
                                  steps=config.steps, label_weight=self.label_weight,
                                  trace=True)  # fmt: skip
            _add_batch(figures, batch, out, clipped, limit, self.t2d)
            figures.sequences += len(clipped)
        return figures


def _add_batch(figures: SetFigures, batch, out, clipped: np.ndarray, limit: int | None,
               t2d: np.ndarray) -> None:  # fmt: skip
    """Sum one micro-batch's trainer figures and replayed chains into ``figures``."""
    ids = batch.input_ids.numpy()  # [n]
    mask = batch.loss_mask.numpy()  # [n]
    cu = batch.cu_seqlens.numpy()  # [num_seqs + 1]
    top = out.trace.target_top.cpu().numpy()  # [n]
    pairs = zip(out.step_correct.tolist(), out.step_valid.tolist(), strict=True)
    for i, (correct, valid) in enumerate(pairs):
        figures.step_correct[i] += correct
        figures.step_valid[i] += valid
    figures.leading += int(out.leading_correct[out.valid0].sum())
    figures.valid0 += int(out.valid0.sum())
    figures.clipped += int(clipped.sum())
    spans = answer_spans(mask, cu, limit, clipped)
    figures.answers += len(spans)
    figures.answer_tokens += int(mask.sum())
    figures.kept_answer_tokens += int(t2d[ids[mask]].sum())
    agree, compared = greedy_agreement(ids, top, spans)
    figures.greedy_agree += agree
    figures.greedy_tokens += compared
    leading = chain_leading(out.trace.hits.cpu().numpy(), checkable(ids, mask, top, cu))
    for k, pooled in figures.chains.items():
        answers = replay_answers(leading, spans, k)
        for stats in answers:
            pooled.merge(stats)
        if k in figures.per_answer:
            figures.per_answer[k] += [[s.steps, s.accepted_tokens] for s in answers]


def _read_set(name: str, root: str, vocab_size: int) -> tuple[dict[str, Any], list[TokenRecord]]:
    """A set's manifest and token records; every record must fit the target's vocabulary."""
    from specdec.data_gen.dump import load_records
    from specdec.data_gen.records import SkipCounts
    from specdec.data_gen.shards import load_manifest

    if not Path(root).is_dir():
        raise FileNotFoundError(
            f"--records {name}={root}: no such directory; pass the output directory of "
            "`specdec data-gen regenerate`"
        )
    manifest = load_manifest(root)
    skipped = SkipCounts()
    # Every length passes here: over-long records are clipped when packed, not dropped.
    records = load_records(str(root), vocab_size, sys.maxsize, skipped)
    bad = skipped.counts.get("bad_token_ids", 0)
    if bad:
        raise ValueError(
            f"--records {name}={root}: {bad} records hold token ids outside the target's "
            f"vocabulary of {vocab_size:,}; they were tokenized for another model (the "
            f"manifest names {manifest.get('target')!r}): pass that one as --model"
        )
    if not records:
        raise ValueError(f"--records {name}={root} holds no usable records ({skipped.as_dict()})")
    return manifest, records


def resolve_head(head: str | None, model: str) -> Path:
    """The head directory: ``head``, else the one shipped for ``model``."""
    from specdec.models.packaged_heads import packaged_head

    if head is None:
        shipped = packaged_head(model)
        if shipped is None:
            raise ValueError(f"--model {model!r} ships no head; pass --head DIR")
        return shipped
    path = Path(head)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--head {head}: no config.json there; pass an EAGLE-3 head directory (e.g. "
            "<train-draft output_dir>/head)"
        )
    return path


def check_head_target(target_name: str, model: str, resolved_name: str, head_dir: Path) -> None:
    """A head that names its target must name ``model`` (as given, or its resolved alias or
    directory name): a head is judged against the target it drafts for."""
    if not target_name:
        return
    names = {model, resolved_name}
    if target_name not in names and Path(target_name).name not in names:
        raise ValueError(
            f"head {head_dir} drafts for {target_name!r}, not --model {model!r}; pass "
            f"--model {target_name}"
        )


def format_report(figures: list[SetFigures], config: EvalConfig, head_dir: Path | str) -> str:
    """The figures as two short tables (trainer figures; replayed chain τ) and the notes
    that qualify them."""
    width = max(4, *(len(f.name) for f in figures))
    accs = "".join(f"  acc_{i}" for i in range(config.steps))
    lines = [
        f"head {head_dir} on {config.model} ({config.device}, {config.dtype}, "
        f"{config.steps} TTT steps)",
        f"{'set':<{width}}  seqs  answer tok  coverage  greedy  sim τ{accs}",
    ]
    for f in figures:
        row = "".join(f"  {a:5.3f}" for a in f.acc)
        lines.append(
            f"{f.name:<{width}}  {f.sequences:>4}  {f.answer_tokens:>10,}  {f.coverage:>8.3f}  "
            f"{f.greedy_agreement:>6.3f}  {f.simulated_tau:>5.2f}{row}"
        )
    lines.append("chain τ by replay (1 + accepted / steps, pooled over each set's answers)")
    lines.append(f"{'set':<{width}}" + "".join(f"  {f'K={k}':>5}" for k in config.chain_lengths))
    for f in figures:
        lines.append(
            f"{f.name:<{width}}"
            + "".join(f"  {f.chains[k].tau:5.2f}" for k in config.chain_lengths)
        )
    return "\n".join([*lines, *(note for f in figures for note in _notes(f))])


def _notes(f: SetFigures) -> list[str]:
    notes = []
    if f.answer_max_tokens is None:
        notes.append(
            f"note: {f.name}: the answers' max_tokens is unknown (no regenerate manifest "
            "records it): answers replay to their end-of-turn token; pass --answer-max-tokens"
        )
    if f.temperature:
        notes.append(
            f"note: {f.name}: answers sampled at temperature {f.temperature}; the replay "
            "assumes greedy answers, so its τ is an estimate"
        )
    if f.clipped:
        notes.append(
            f"note: {f.name}: {f.clipped} records clipped to {f.clip_tokens:,} tokens "
            "(--max-tokens, the head's positions); an answer cut there replays as if "
            "max_tokens had ended it"
        )
    if not f.temperature and f.greedy_agreement < 1.0:
        notes.append(
            f"note: {f.name}: {f.greedy_tokens - f.greedy_agree} of {f.greedy_tokens:,} answer "
            "tokens are not the target's argmax after the tokens before them: regenerate "
            "re-tokenizes the answer text, which splits a non-canonical tokenization the "
            "target emitted differently (and a cut answer then looks one token shorter); "
            "other causes are another target's answers or argmax ties at this dtype. The "
            "replay is exact on the target's own greedy tokens only"
        )
    return notes
