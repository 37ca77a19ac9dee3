"""The EAGLE-3 draft head: Llama decoder layers over fused target hidden states.

A draft step takes a token and a hidden state and predicts the next token in a reduced
draft vocabulary. The first step's hidden state is ``fuse(aux)``: the target's residual
stream entering three of its layers (low, mid, high; ``aux_layer_ids``, vLLM's convention)
concatenated and projected by ``fc`` (3H -> H). Later steps consume the previous step's
*pre-norm* output instead. The first layer's (``midlayer``) attention reads
``cat(input_layernorm(embed(tok)), hidden_norm(h))`` (2H wide, so q/k/v take 2H) and its
residual is the un-normed ``h``; the MLP has the target's width; ``norm`` + ``lm_head``
(H -> draft vocab) give the logits. EAGLE-3 heads have that one layer. A deeper head
(``num_layers`` > 1, vLLM's multi-layer EAGLE-3 drafter) adds plain pre-norm Llama layers
(``layers.1``, ``layers.2``, ...: H-wide attention, no embedding input) on the same
residual stream between ``midlayer`` and ``norm``; each layer has its own K/V.

EAGLE-3.1 (``Eagle3Config.fc_norm`` and ``norm_output``, vLLM's and SpecForge's names; the
"Attention Drift" paper) changes two things: ``fuse`` normalises each of the three aux
states with its own RMSNorm (``fc_norm.0..2``) before ``fc``, and a later step consumes the
previous step's *post-norm* output (``norm(out)``, what the logits read) instead of the
pre-norm one. ``norm_before_fc`` (speculators' variant) puts one RMSNorm over the whole
3H concatenation (``input_norm``) before ``fc`` (and before ``fc_norm`` when both are on,
as vLLM orders them).

The token embedding is the target's: the head borrows it (``bind_embedding``), never owns,
trains or saves it. The head's own K/V live in paged blocks like the target's, written and
read through ``AttentionBackend.forward`` with an explicit ``AttentionMetadata``, so the
engine can give it its own paged cache (one per layer). The forward is free of host syncs.

Weights are stored fused as in ``llama.py`` (``qkv_proj``, ``gate_up_proj``);
``checkpoint_layout`` names the research-format keys (``midlayer.*``) each parameter is
assembled from. Reading and writing checkpoints lives in ``eagle3_formats.py``.

Optional SpecExit channels (``config.exit_signals``, docs/spec_exit.md): ``spec_exit``, a
``Linear(3H -> k)`` with bias over the same aux states ``fc`` reads — ``fc`` widened by k
output rows, kept as its own module so a head without channels is exactly EAGLE-3 and the
channels can be trained, frozen or dropped on their own (``exit_signals`` activates them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from specdec.attention.base import AttentionBackend
from specdec.models.compiling import compile_region
from specdec.models.config import ModelConfig, validate_decoder_shape
from specdec.models.exit_signals import activate, canonical_signals
from specdec.models.linear import Linear
from specdec.models.llama import MLP, Attention, KVCache, RMSNorm
from specdec.models.rope import (
    RotaryEmbedding,
    max_context_len,
)
from specdec.models.tree_defaults import TreeDefaults
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.spec_exit_params import spec_exit_fields, spec_exit_params

Embedding = Callable[[torch.Tensor], torch.Tensor]  # token ids [n] -> embeddings [n, hidden]
HeadKV = Sequence[KVCache]  # the head's K/V, one (k_cache, v_cache) per layer

NUM_AUX_LAYERS = 3  # EAGLE-3 fuses exactly three target layers (fc is 3H -> H)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """(2, N // 2, N - 3): the residual stream entering these layers of an N-layer target
    (vLLM's, EAGLE's and SGLang's default choice, in vLLM's numbering)."""
    ids = (2, num_layers // 2, num_layers - 3)
    if num_layers < 4:
        raise ValueError(
            f"a {num_layers}-layer target has no default EAGLE-3 aux layers {ids}; "
            "pass aux_layer_ids explicitly (each in [0, num_layers))"
        )
    return ids


def target_shaped_fields(
    model_config: ModelConfig,
    aux_layer_ids: Sequence[int] | None = None,
    intermediate_size: int | None = None,
) -> dict[str, Any]:
    """The config fields a draft model shaped like the target's layers takes from it
    (widths, heads, norm eps, RoPE, vocabulary; the MLP ``intermediate_size`` wide if
    given) and the aux layers it reads (``default_aux_layer_ids`` unless given), checked
    to lie inside the target: what an EAGLE-3 head and a block drafter share."""
    ids = tuple(aux_layer_ids or default_aux_layer_ids(model_config.num_layers))
    bad = [i for i in ids if not 0 <= i < model_config.num_layers]
    if bad:
        raise ValueError(
            f"aux_layer_ids {list(ids)} include {bad}, outside [0, "
            f"{model_config.num_layers}) for a {model_config.num_layers}-layer target"
        )
    return dict(
        hidden_size=model_config.hidden_size,
        intermediate_size=intermediate_size or model_config.intermediate_size,
        num_heads=model_config.num_heads,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        rms_norm_eps=model_config.rms_norm_eps,
        rope_theta=model_config.rope_theta,
        rope_scaling=model_config.rope_scaling,
        max_position_embeddings=model_config.max_position_embeddings,
        vocab_size=model_config.vocab_size,
        aux_layer_ids=ids,
    )


@dataclass(frozen=True)
class Eagle3Config:
    """Shape and numerics of one EAGLE-3 head, validated on construction.

    Invariants: sizes positive, ``num_heads % num_kv_heads == 0``, ``head_dim`` even,
    ``draft_vocab_size <= vocab_size`` (the target's), exactly three ``aux_layer_ids`` (the
    residual stream *entering* those target layers, vLLM's convention), ``rope_scaling`` a
    complete variant from ``rope.ROPE_TYPES`` or None. ``norm_before_residual`` (a
    speculators option, off in EAGLE-3 proper) makes the residual ``hidden_norm(h)``.
    ``fc_norm``, ``norm_output`` (EAGLE-3.1) and ``norm_before_fc`` (speculators) are the
    variants of the module docstring; all off is EAGLE-3.
    ``exit_signals`` names the SpecExit channels (``exit_signals.SIGNAL_ORDER`` order,
    normalised on construction; empty: none). ``spec_exit_defaults`` is the SpecExit
    setting measured best for the head (some ``SpecExitParams`` fields, canonical as
    ``spec_exit_fields`` makes them; None: no record), the base that a server's or a
    request's settings override (``spec_exit_params``); only a head with channels records
    one, and it must threshold at least one of the head's signals. ``num_layers`` >= 1
    decoder layers (EAGLE-3's is 1; module docstring).
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int  # the RoPE parameter (dynamic/yarn read it), not a limit
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_name: str = ""
    tree: TreeDefaults | None = None
    norm_before_residual: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_fc: bool = False
    exit_signals: tuple[str, ...] = ()
    spec_exit_defaults: dict[str, Any] | None = None
    num_layers: int = 1

    def __post_init__(self) -> None:
        validate_decoder_shape(self, ("draft_vocab_size", "num_layers"))
        object.__setattr__(self, "exit_signals", canonical_signals(self.exit_signals))
        if self.spec_exit_defaults is not None:
            object.__setattr__(self, "spec_exit_defaults", self._checked_spec_exit())
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds the target vocab_size="
                f"{self.vocab_size}; the draft vocabulary is a subset of the target's"
            )
        ids = self.aux_layer_ids
        if len(ids) != NUM_AUX_LAYERS or any(not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(
                f"aux_layer_ids={ids!r} must be {NUM_AUX_LAYERS} non-negative target layer "
                "ids (the residual stream entering each; low, mid, high)"
            )

    def _checked_spec_exit(self) -> dict[str, Any] | None:
        """``spec_exit_defaults`` made canonical ({} records nothing: None); raises naming
        the record and the fix."""
        record = self.spec_exit_defaults
        if not self.exit_signals:
            raise ValueError(
                f"spec_exit_defaults={record!r}: this head has no SpecExit channels "
                "(spec_exit_signals), so no request could use them; drop the record, or "
                "record it on a head trained with spec_exit.signals"
            )
        try:
            record = spec_exit_fields(record)
            enabled = spec_exit_params(record).enabled(self.exit_signals)
        except ValueError as e:
            raise ValueError(
                f"spec_exit_defaults={record!r}: {e}; fix the record or drop it"
            ) from None
        if not enabled:
            raise ValueError(
                f"spec_exit_defaults={record!r} thresholds none of this head's signals "
                f"({', '.join(self.exit_signals)}); set a threshold for one of them"
            )
        return record or None

    @property
    def max_context_len(self) -> int:
        """Positions the head's RoPE reaches by its own parameters (see ``rope.py``)."""
        return max_context_len(self.rope_scaling, self.max_position_embeddings)

    @classmethod
    def for_target(
        cls,
        model_config: ModelConfig,
        draft_vocab_size: int,
        *,
        aux_layer_ids: tuple[int, ...] | None = None,
        target_name: str = "",
        tree: TreeDefaults | None = None,
        exit_signals: tuple[str, ...] = (),
        intermediate_size: int | None = None,
        num_layers: int = 1,
        fc_norm: bool = False,
        norm_output: bool = False,
    ) -> Eagle3Config:
        """A head of ``num_layers`` layers shaped like ``model_config``'s (same widths,
        heads, norm eps and RoPE; the MLP ``intermediate_size`` wide if given), reading the
        default aux layers unless ``aux_layer_ids`` is given; EAGLE-3.1 with ``fc_norm``
        and ``norm_output``."""
        return cls(
            **target_shaped_fields(model_config, aux_layer_ids, intermediate_size),
            draft_vocab_size=draft_vocab_size,
            target_name=target_name,
            tree=tree,
            exit_signals=exit_signals,
            num_layers=num_layers,
            fc_norm=fc_norm,
            norm_output=norm_output,
        )

    @property
    def variant(self) -> str:
        """``"eagle3.1"`` with both of EAGLE-3.1's changes, ``"eagle3"`` with neither and
        no ``norm_before_fc``, else the flags that are on (``"eagle3+fc_norm"``)."""
        flags = [n for n in ("fc_norm", "norm_output", "norm_before_fc") if getattr(self, n)]
        if flags == ["fc_norm", "norm_output"]:
            return "eagle3.1"
        return "+".join(["eagle3", *flags])


def validate_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise naming the first violation unless (d2t, t2d) is a valid draft vocabulary.

    ``d2t`` [draft_vocab] int64 holds offsets: draft id ``i`` is target id ``i + d2t[i]``.
    ``t2d`` [target_vocab] bool marks exactly those target ids. The kept ids are strictly
    ascending (sorted, no repeats) and lie in the target vocabulary.
    """
    if d2t.dtype != torch.int64 or d2t.ndim != 1:
        raise ValueError(f"d2t must be a 1-D int64 tensor; got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.ndim != 1:
        raise ValueError(f"t2d must be a 1-D bool tensor; got {t2d.dtype} {tuple(t2d.shape)}")
    draft_vocab, target_vocab = d2t.shape[0], t2d.shape[0]
    kept = torch.arange(draft_vocab, device=d2t.device) + d2t  # [draft_vocab] target ids
    out = ((kept < 0) | (kept >= target_vocab)).nonzero()
    if out.numel():
        i = int(out[0])
        raise ValueError(
            f"d2t maps draft id {i} to target id {int(kept[i])}, outside the target "
            f"vocabulary [0, {target_vocab}); the vocab map belongs to another target"
        )
    unsorted = (kept[1:] <= kept[:-1]).nonzero()
    if unsorted.numel():
        i = int(unsorted[0]) + 1
        raise ValueError(
            f"d2t kept ids are not strictly ascending: draft id {i} -> target id "
            f"{int(kept[i])} follows target id {int(kept[i - 1])}; rebuild the map with "
            "the kept ids sorted"
        )
    # Kept ids are distinct, so "all kept ids marked" plus equal counts means "exactly".
    unmarked = (~t2d.to(kept.device)[kept]).nonzero()
    marked = int(t2d.sum())
    if unmarked.numel() or marked != draft_vocab:
        detail = (
            f"target id {int(kept[int(unmarked[0])])} (draft id {int(unmarked[0])}) is kept "
            "by d2t but not marked in t2d"
            if unmarked.numel()
            else f"t2d marks {marked} target ids, d2t keeps {draft_vocab}"
        )
        raise ValueError(
            f"t2d does not mark exactly the kept ids: {detail}; build d2t and t2d from one "
            "sorted list of kept target ids"
        )


class DraftVocabulary:
    """A draft model's pruned vocabulary (DESIGN.md, "Draft vocabulary"): buffers ``d2t``
    [draft_vocab] int64 offsets and ``t2d`` [vocab] bool kept ids, the identity on the
    first ``draft_vocab_size`` ids until ``set_vocab_map``. Mixed into ``nn.Module``s
    whose ``config`` has ``draft_vocab_size`` and ``vocab_size``."""

    config: Any
    d2t: torch.Tensor
    t2d: torch.Tensor

    def init_vocab_map(self) -> None:
        c = self.config
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [...]
        """Target token ids of draft-vocabulary ids (int64, same shape)."""
        return draft_ids + self.d2t[draft_ids]

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Validate (``validate_vocab_map``) and install a draft vocabulary."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab map shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match "
                f"the draft model's draft_vocab_size={self.config.draft_vocab_size}, target "
                f"vocab_size={self.config.vocab_size}"
            )
        validate_vocab_map(d2t, t2d)
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)


class Eagle3DecoderLayer(nn.Module):
    """The head's first decoder layer (``midlayer`` in the research checkpoints; EAGLE-3's
    only one), reading the token embedding beside the hidden state."""

    def __init__(self, config: Eagle3Config, backend: AttentionBackend) -> None:
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Llama attention whose q/k/v read the 2H-wide cat(embed, hidden).
        self.self_attn = Attention(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            backend,
            input_size=2 * config.hidden_size,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        embeds: torch.Tensor,  # [num_tokens, hidden]: target embeddings of the input tokens
        hidden: torch.Tensor,  # [num_tokens, hidden]: fuse(aux) or the previous step's out
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]: pre-norm output
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [num_tokens, 2H]
        attended = self.self_attn(x, cos, sin, kv_cache, meta)
        out, hidden = self.mlp.forward_add_norm(attended, residual, self.post_attention_layernorm)
        return hidden + out


class Eagle3StackedLayer(nn.Module):
    """A layer after ``midlayer`` in a deeper head (``layers.<i>``): a plain pre-norm
    Llama block on the head's residual stream (vLLM's EAGLE-3 layers after the first)."""

    def __init__(self, config: Eagle3Config, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, backend
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the stream leaving the layer before
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]: the stream leaving this layer (pre-norm)
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        out, stream = self.mlp.forward_add_norm(attended, hidden, self.post_attention_layernorm)
        return stream + out


class Eagle3Head(DraftVocabulary, nn.Module):
    """The EAGLE-3 draft head over a paged KV cache (see the module docstring).

    Buffers: ``d2t`` [draft_vocab] int64 (draft id ``i`` is target id ``i + d2t[i]``) and
    ``t2d`` [target_vocab] bool (the kept target ids); both ship inside the weights. A new
    head keeps target ids ``0 .. draft_vocab - 1`` until ``set_vocab_map``.
    """

    # Fused parameter -> the research-format projections concatenated into it, in order.
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    d2t: torch.Tensor  # [draft_vocab] int64
    t2d: torch.Tensor  # [target_vocab] bool

    def __init__(
        self,
        config: Eagle3Config,
        attention: AttentionBackend,
        *,
        embed: Embedding | None = None,
        max_positions: int | None = None,
    ) -> None:
        """``embed`` is the target's token embedding (bind later with ``bind_embedding``);
        ``max_positions`` sizes the RoPE table and must cover every position the target
        runs at (default: the head's own ``config.max_context_len``)."""
        super().__init__()
        if max_positions is not None and max_positions <= 0:
            raise ValueError(f"max_positions must be positive; got {max_positions}")
        self.config = config
        self.attention = attention
        width = NUM_AUX_LAYERS * config.hidden_size
        # Variants' norms on the fused aux states (module docstring), vLLM's names.
        self.input_norm = RMSNorm(width, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(
                RMSNorm(config.hidden_size, config.rms_norm_eps) for _ in range(NUM_AUX_LAYERS)
            )
            if config.fc_norm
            else None
        )
        self.fc = Linear(width, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config, attention)
        # Keyed "1", "2", ...: stored as layers.<i>, vLLM's names (midlayer is its layers.0).
        self.layers = nn.ModuleDict(
            {str(i): Eagle3StackedLayer(config, attention) for i in range(1, config.num_layers)}
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.spec_exit: nn.Linear | None = None  # SpecExit channels (module docstring)
        if config.exit_signals:
            self.spec_exit = nn.Linear(width, len(config.exit_signals), bias=True)
        self.rotary = RotaryEmbedding.for_config(config, max_positions or config.max_context_len)
        self.init_vocab_map()
        self.bind_embedding(embed)
        # (layers, logits) compiled by ``compile_regions``; a plain attribute, not
        # submodules, so the state dict and ``.to()`` never see the wrappers.
        self.__dict__["_compiled"] = None

    def compile_regions(self, **compile_kwargs) -> None:
        """``torch.compile`` each decoder layer and the logits (norm + lm_head) for
        ``forward(..., compiled=True)``: inside a proposer's CUDA graphs each draft level
        then replays fused kernels instead of dozens of small ones (norms, RoPE,
        projections, activation). Eager callers keep the plain modules, whose varying
        shapes would recompile."""
        layers = [compile_region(m, **compile_kwargs) for m in self.decoder_layers]
        self.__dict__["_compiled"] = (layers, compile_region(self.compute_logits, **compile_kwargs))

    @property
    def decoder_layers(self) -> list[nn.Module]:
        """``midlayer`` then ``layers.1``, ``layers.2``, ...: the order they run in."""
        return [self.midlayer, *self.layers.values()]

    @property
    def decoder_layer_names(self) -> list[str]:
        """``decoder_layers``' module names (their state-dict prefixes), in the same order."""
        return ["midlayer", *(f"layers.{i}" for i in self.layers)]

    def bind_embedding(self, embed: Embedding | None) -> None:
        """Use the target's embedding (``CausalLM.embed`` or its ``nn.Embedding``).

        Kept outside ``nn.Module`` registration on purpose: it is the target's frozen
        weight, so it must not appear in the head's parameters, state dict or ``.to()``.
        """
        self.__dict__["_embed"] = embed

    def fuse(
        self,
        aux_hidden: torch.Tensor,  # [n, 3 * hidden]: entering aux layers low | mid | high
    ) -> torch.Tensor:  # [n, hidden]
        """The first step's ``hidden``: ``fc`` over the aux states (normalised first by
        the variants that say so)."""
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        if self.fc_norm is not None:
            chunks = aux_hidden.chunk(NUM_AUX_LAYERS, dim=-1)  # 3 x [n, hidden]
            normed = [norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)]
            aux_hidden = torch.cat(normed, dim=-1)
        return self.fc(aux_hidden)

    def exit_logits(
        self,
        aux_hidden: torch.Tensor,  # [n, 3 * hidden]: what ``fuse`` reads
    ) -> torch.Tensor:  # [n, len(config.exit_signals)]: raw channel values
        if self.spec_exit is None:
            raise RuntimeError(
                "this head has no SpecExit channels (config.exit_signals is empty); train "
                "them with the spec_exit section of the train config"
            )
        return self.spec_exit(aux_hidden)

    def exit_signals(
        self,
        aux_hidden: torch.Tensor,  # [n, 3 * hidden]
    ) -> torch.Tensor:  # [n, len(config.exit_signals)] float32, activated
        """The SpecExit signals at each row (``exit_signals.activate``); device ops only."""
        return activate(self.config.exit_signals, self.exit_logits(aux_hidden))

    def forward(
        self,
        input_ids: torch.Tensor,  # [n] int64: target token ids
        hidden: torch.Tensor,  # [n, hidden]: fuse(aux) at the first step, else prev out
        positions: torch.Tensor,  # [n] int64
        kv_cache: HeadKV,  # the head's own (k_cache, v_cache), one per layer
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,  # [m] int64: rows to project; None = all
        *,
        compiled: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``out`` [n, hidden] (the next step's ``hidden``: the last layer's
        pre-norm output, or its ``norm`` with ``norm_output``) and draft logits [m,
        draft_vocab] float32 (m = n without ``logits_indices``). ``compiled``: run the
        regions ``compile_regions`` built (same results)."""
        layers, logits_fn = self.decoder_layers, self.compute_logits
        if compiled:
            if self.__dict__["_compiled"] is None:
                raise RuntimeError("forward(compiled=True) needs compile_regions() first")
            layers, logits_fn = self.__dict__["_compiled"]
        if len(kv_cache) != len(layers):
            raise ValueError(
                f"{len(kv_cache)} K/V caches for a head of {len(layers)} layers; pass one "
                "(k_cache, v_cache) per layer"
            )
        embed: Embedding | None = self.__dict__["_embed"]
        if embed is None:
            raise RuntimeError(
                "Eagle3Head has no token embedding; call head.bind_embedding(target.embed) "
                "(the head always uses the target's embedding)"
            )
        embeds = embed(input_ids).to(hidden.dtype)  # [n, hidden]
        cos, sin = self.rotary(positions, hidden.dtype)
        out = layers[0](embeds, hidden, cos, sin, kv_cache[0], meta)  # [n, hidden]
        for layer, layer_kv in zip(layers[1:], kv_cache[1:], strict=True):
            out = layer(out, cos, sin, layer_kv, meta)
        rows = out if logits_indices is None else out.index_select(0, logits_indices)
        logits = logits_fn(rows)
        return (self.norm(out) if self.config.norm_output else out), logits

    def compute_logits(
        self,
        out_prenorm: torch.Tensor,  # [m, hidden]
    ) -> torch.Tensor:  # [m, draft_vocab] float32
        return self.lm_head(self.norm(out_prenorm)).float()

    def checkpoint_layout(self, param_name: str) -> list[tuple[str, int]]:
        """The research-format keys that, concatenated along dim 0 in order, form
        ``param_name``, each with its number of rows.

        ``midlayer.self_attn.qkv_proj.weight`` -> ``[("midlayer.self_attn.q_proj.weight",
        q_rows), (... k_proj ...), (... v_proj ...)]``; unfused names map to themselves.
        """
        module, _, leaf = param_name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last not in self.packed_modules:
            return [(param_name, self.get_parameter(param_name).shape[0])]
        c = self.config
        rows_by_part = {
            "q_proj": c.num_heads * c.head_dim,
            "k_proj": c.num_kv_heads * c.head_dim,
            "v_proj": c.num_kv_heads * c.head_dim,
            "gate_proj": c.intermediate_size,
            "up_proj": c.intermediate_size,
        }
        return [
            (f"{parent}.{part}.{leaf}", rows_by_part[part]) for part in self.packed_modules[last]
        ]
