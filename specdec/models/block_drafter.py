"""The block drafter (DFlash-style): one forward drafts a whole block of tokens.

Where an EAGLE-3 head drafts token by token, the block drafter fills ``block_size`` (B)
positions at once. A block starts at an *anchor*: the last committed token ``x[a]``, whose
target states are not in the context yet. Its inputs are ``[x[a], MASK, ..., MASK]`` (B
tokens, ``mask_token_id`` B-1 times), embedded with the target's frozen embedding, at
positions ``a .. a+B-1``. Slot ``k`` (1 .. B-1) predicts the token at position ``a + k``
(no shift); verification takes the chain of the B-1 argmaxes.

Conditioning. The target's residual streams entering ``aux_layer_ids`` (our convention,
DESIGN.md "Aux layers") are concatenated and fused: ``context = hidden_norm(fc(aux))``
(``fc``: Linear(len(ids) * H -> H), no bias). Context enters *only* through keys and values:
in each layer ``k = k_norm(k_proj(context))`` (RoPE at the context position) and ``v =
v_proj(context)``, next to the block's own K/V; queries come from the block alone, and the
context never joins the residual stream. A block token sees every context position before
the anchor and every token of its own block (bidirectional), nothing else.

Layers are Qwen3-style pre-norm decoder layers of the target's width: ``input_layernorm``,
attention with per-head ``q_norm``/``k_norm`` (RMSNorm) before RoPE, ``o_proj``,
``post_attention_layernorm``, SwiGLU MLP; a final ``norm``. Logits come from the target's
frozen lm_head over its whole vocabulary, or, with a pruned draft vocabulary
(``draft_vocab_size`` < ``vocab_size``), from the drafter's own ``lm_head`` over the kept ids
(``d2t``/``t2d`` as for EAGLE-3, DESIGN.md "Draft vocabulary").

The API is split the way an engine uses it:

- ``context_kv(aux, positions)``: per-layer K/V of context positions, computed once per
  position (the engine caches them in paged blocks);
- ``block_hidden(embeds, positions, attend)``: the decoder over block tokens, attention
  delegated to ``attend`` (the training path passes a packed, masked attention);
- ``block_logits(embeds, positions, context, context_lens)``: the engine-style forward over
  dense per-block context K/V, returning logits for slots 1..B-1.

Weights are stored fused (``qkv_proj``, ``gate_up_proj``); ``checkpoint_layout`` names the
HF keys each is assembled from. Formats live in ``block_drafter_formats.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specdec.models.config import ModelConfig, validate_decoder_shape
from specdec.models.eagle3_head import DraftVocabulary, target_shaped_fields
from specdec.models.linear import Linear
from specdec.models.llama import MLP, RMSNorm
from specdec.models.rope import RotaryEmbedding, max_context_len
from specdec.ops.rope import apply_rotary

Embedding = Callable[[torch.Tensor], torch.Tensor]  # token ids [...] -> embeddings [..., H]

# The block forward's attention kernels. cuDNN's is left out: it builds an execution plan
# for every new (blocks, context) shape (~20 ms of host time per call on an H100), and a
# drafting engine meets new context widths as its requests grow.
BLOCK_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]

# Tokens a target's tokenizer reserves and chat never emits, tried in order when no
# mask_token_id is given: DFlash's own added token, then SmolLM2's (StarCoder-family)
# code-pretraining markers, unused by the instruct models' chat template.
MASK_TOKEN_CANDIDATES = ("<|MASK|>", "<empty_output>")


class ContextKV(NamedTuple):
    """One layer's keys and values of some context positions (keys normed and rotated)."""

    k: torch.Tensor  # [..., kv_heads, head_dim]
    v: torch.Tensor  # [..., kv_heads, head_dim]


# attend(layer, q [m, heads, d], k [m, kv_heads, d], v [m, kv_heads, d]) -> [m, heads, d]:
# the block's queries, keys and values (normed, rotated) of one layer, attended over the
# block's keys plus whatever context K/V the caller holds for that layer.
BlockAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class BlockDrafterConfig:
    """Shape and numerics of one block drafter, validated on construction.

    Invariants: sizes positive, ``num_heads % num_kv_heads == 0``, ``head_dim`` even,
    ``block_size >= 2`` (the anchor and at least one drafted slot), ``draft_vocab_size <=
    vocab_size``, ``mask_token_id`` in the target vocabulary, ``aux_layer_ids`` non-empty,
    distinct and non-negative (the residual stream *entering* those target layers; the
    DFlash formats' ``target_layer_ids`` are these minus one). The hidden size is the
    target's (the block embeds with the target's embedding).
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
    mask_token_id: int
    block_size: int = 16
    num_layers: int = 2
    target_name: str = ""

    def __post_init__(self) -> None:
        validate_decoder_shape(self, ("draft_vocab_size", "num_layers", "block_size"))
        if self.block_size < 2:
            raise ValueError(
                f"block_size={self.block_size}; a block holds the anchor and at least one "
                "drafted slot, so it is >= 2"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds the target vocab_size="
                f"{self.vocab_size}; the draft vocabulary is a subset of the target's"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the target vocabulary "
                f"[0, {self.vocab_size}); pick a reserved token the target never emits"
            )
        ids = self.aux_layer_ids
        if (
            not ids
            or any(not isinstance(i, int) or i < 0 for i in ids)
            or len(set(ids)) != len(ids)
        ):
            raise ValueError(
                f"aux_layer_ids={ids!r} must be distinct non-negative target layer ids (the "
                "residual stream entering each), at least one"
            )

    @property
    def full_vocab(self) -> bool:
        """Whether the drafter drafts over the target's whole vocabulary (target lm_head)."""
        return self.draft_vocab_size == self.vocab_size

    @property
    def max_context_len(self) -> int:
        return max_context_len(self.rope_scaling, self.max_position_embeddings)

    @classmethod
    def for_target(
        cls,
        model_config: ModelConfig,
        draft_vocab_size: int,
        *,
        mask_token_id: int,
        aux_layer_ids: tuple[int, ...] | None = None,
        block_size: int = 16,
        num_layers: int = 2,
        intermediate_size: int | None = None,
        target_name: str = "",
    ) -> BlockDrafterConfig:
        """A drafter shaped like ``model_config``'s layers (widths, heads, norm eps, RoPE),
        reading EAGLE-3's default aux layers unless ``aux_layer_ids`` is given (so the
        same hidden-state dumps train both)."""
        return cls(
            **target_shaped_fields(model_config, aux_layer_ids, intermediate_size),
            draft_vocab_size=draft_vocab_size,
            mask_token_id=mask_token_id,
            block_size=block_size,
            num_layers=num_layers,
            target_name=target_name,
        )


def resolve_mask_token_id(tokenizer, mask_token_id: int | None = None) -> int:
    """``mask_token_id`` if given, else the first of ``MASK_TOKEN_CANDIDATES`` that the
    target's tokenizer holds as a single token. Any id works as long as it never appears
    in the data the drafter reads: only its (frozen) embedding matters, and a token that
    also occurs as text would give masked slots and real tokens one input."""
    if mask_token_id is not None:
        return mask_token_id
    vocab = tokenizer.get_vocab()
    for token in MASK_TOKEN_CANDIDATES:
        if token in vocab:
            return int(vocab[token])
    raise ValueError(
        f"the target's tokenizer has none of {list(MASK_TOKEN_CANDIDATES)}; set "
        "block.mask_token_id to a reserved token id the target never emits"
    )


class BlockAttention(nn.Module):
    """Qwen3-style attention whose keys and values also come from context states.

    ``qkv_proj`` projects the block (fused q | k | v rows); ``context_kv`` applies its k
    and v rows to context states. Both sides' keys get ``k_norm`` and RoPE by absolute
    position, so a context key is the same whether computed with its block or on its own.
    """

    def __init__(self, config: BlockDrafterConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def context_kv(
        self,
        context: torch.Tensor,  # [n, hidden]: hidden_norm(fc(aux))
        cos: torch.Tensor,  # [n, 1, head_dim // 2]
        sin: torch.Tensor,  # [n, 1, head_dim // 2]
    ) -> ContextKV:  # k, v: [n, kv_heads, head_dim]
        n = context.shape[0]
        kv = F.linear(context, self.qkv_proj.weight[self.q_size :])  # [n, 2 * kv_size]
        k, v = kv.view(n, 2, self.num_kv_heads, self.head_dim).unbind(1)
        return ContextKV(apply_rotary(self.k_norm(k), cos, sin), v)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,  # [m, hidden]: input_layernorm of the block tokens
        cos: torch.Tensor,  # [m, 1, head_dim // 2]
        sin: torch.Tensor,  # [m, 1, head_dim // 2]
        attend: BlockAttend,
    ) -> torch.Tensor:  # [m, hidden]
        m, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.reshape(m, self.num_heads, d)), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(m, self.num_kv_heads, d)), cos, sin)
        out = attend(layer, q, k, v.reshape(m, self.num_kv_heads, d))  # [m, heads, d]
        return self.o_proj(out.reshape(m, self.q_size))


class BlockDrafterLayer(nn.Module):
    """One pre-norm decoder layer over the block tokens (context only via K/V)."""

    def __init__(self, config: BlockDrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        layer: int,
        hidden: torch.Tensor,  # [m, hidden]: the stream entering the layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: BlockAttend,
    ) -> torch.Tensor:  # [m, hidden]: the stream leaving it
        hidden = hidden + self.self_attn(layer, self.input_layernorm(hidden), cos, sin, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class BlockDrafter(DraftVocabulary, nn.Module):
    """The block drafter (module docstring). Buffers ``d2t`` [draft_vocab] int64 and
    ``t2d`` [vocab] bool hold the draft vocabulary (the identity for a full-vocabulary
    drafter); ``lm_head`` exists only for a pruned one. The target's embedding (and, for
    a full vocabulary, its lm_head) are bound with ``bind_target``, never registered."""

    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    d2t: torch.Tensor  # [draft_vocab] int64
    t2d: torch.Tensor  # [vocab] bool

    def __init__(self, config: BlockDrafterConfig, *, max_positions: int | None = None) -> None:
        """``max_positions`` sizes the RoPE table; it must cover every block position the
        caller runs at (default: ``config.max_context_len``)."""
        super().__init__()
        self.config = config
        c = config
        self.fc = Linear(len(c.aux_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(BlockDrafterLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = (
            None if c.full_vocab else Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding.for_config(c, max_positions or c.max_context_len)
        self.init_vocab_map()
        self.bind_target(None)

    @property
    def decoder_layer_names(self) -> list[str]:
        """The decoder layers' module names (their state-dict prefixes), in run order."""
        return [f"layers.{i}" for i in range(len(self.layers))]

    # ---------------------------------------------------------------- the target's parts

    def bind_target(self, embed: Embedding | None, lm_head: torch.Tensor | None = None) -> None:
        """Use the target's token embedding and, for a full-vocabulary drafter, its lm_head
        weight [vocab, hidden]. Kept outside module registration: they are the target's
        frozen weights, never in the drafter's parameters, state dict or ``.to()``."""
        self.__dict__["_embed"] = embed
        self.__dict__["_target_lm_head"] = lm_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., hidden]
        embed: Embedding | None = self.__dict__["_embed"]
        if embed is None:
            raise RuntimeError(
                "BlockDrafter has no token embedding; call drafter.bind_target(target.embed, "
                "...) (the drafter always embeds with the target's embedding)"
            )
        return embed(ids)

    def block_inputs(self, anchor_ids: torch.Tensor) -> torch.Tensor:  # [b] -> [b, B] int64
        """Each block's input ids: its anchor token, then ``mask_token_id`` B-1 times."""
        ids = anchor_ids.new_full((anchor_ids.shape[0], self.config.block_size),
                                  self.config.mask_token_id)  # fmt: skip
        ids[:, 0] = anchor_ids
        return ids

    # ------------------------------------------------------------------------ context

    def context_states(
        self,
        aux_hidden: torch.Tensor,  # [n, len(aux_layer_ids) * hidden]: low .. high
    ) -> torch.Tensor:  # [n, hidden]
        """``hidden_norm(fc(aux))``: what every layer's k/v projections read."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def context_kv(
        self,
        aux_hidden: torch.Tensor,  # [n, len(aux_layer_ids) * hidden]
        positions: torch.Tensor,  # [n] int64: each state's absolute position
    ) -> list[ContextKV]:  # one per layer; k, v: [n, kv_heads, head_dim]
        """The context K/V of each layer at these positions. Each row depends only on its
        own aux states and position, so an engine computes it once per committed position
        and caches it; ``block_logits`` then reads the cached rows."""
        context = self.context_states(aux_hidden)
        cos, sin = self.rotary(positions, context.dtype)
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    # -------------------------------------------------------------------------- block

    def block_hidden(
        self,
        embeds: torch.Tensor,  # [m, hidden]: block token embeddings (any number of blocks)
        positions: torch.Tensor,  # [m] int64: absolute positions (anchor + slot)
        attend: BlockAttend,
    ) -> torch.Tensor:  # [m, hidden]: after the final norm
        """The decoder over block tokens; ``attend`` supplies each layer's attention over
        the block's own K/V and the context K/V the caller holds (visibility is its job)."""
        hidden = embeds.to(self.fc.weight.dtype)
        cos, sin = self.rotary(positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(i, hidden, cos, sin, attend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V_d]
        """Draft-vocabulary logits (float32) of final-normed states."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        weight: torch.Tensor | None = self.__dict__["_target_lm_head"]
        if weight is None:
            raise RuntimeError(
                "a full-vocabulary BlockDrafter drafts with the target's lm_head; call "
                "drafter.bind_target(target.embed, target_lm_head_weight)"
            )
        return F.linear(hidden, weight.to(hidden.dtype)).float()

    def block_logits(
        self,
        embeds: torch.Tensor,  # [b, B, hidden]: block_inputs embedded
        positions: torch.Tensor,  # [b, B] int64: anchor .. anchor + B - 1
        context: Sequence[ContextKV],  # per layer; k, v: [b, C, kv_heads, head_dim]
        context_lens: torch.Tensor,  # [b] int64: valid context rows of each block (<= C)
    ) -> torch.Tensor:  # [b, B - 1, draft_vocab] float32: slot k predicts anchor + k
        """Draft ``b`` blocks against dense per-block context K/V (``context_kv`` rows of
        the positions before each anchor, in any order, padded to C): each block token
        sees its block's first ``context_lens`` context rows and its whole block. The
        caller guarantees those rows are exactly the positions before the anchor."""
        b, block, _ = embeds.shape
        if len(context) != self.config.num_layers:
            raise ValueError(
                f"{len(context)} context K/V layers for a drafter of "
                f"{self.config.num_layers}; pass context_kv's list (gathered per block)"
            )
        cols = torch.arange(context[0].k.shape[1] + block, device=embeds.device)
        visible = (cols[None, :] < context_lens[:, None]) | (cols[None, :] >= context[0].k.shape[1])
        mask = visible[:, None, None, :]  # [b, 1, 1, C + B]: every query alike

        def attend(layer: int, q, k, v):
            ctx = context[layer]
            keys = torch.cat([ctx.k, k.view(b, block, *k.shape[1:])], dim=1)  # [b, C+B, kv, d]
            values = torch.cat([ctx.v, v.view(b, block, *v.shape[1:])], dim=1)
            out = F.scaled_dot_product_attention(
                q.view(b, block, *q.shape[1:]).transpose(1, 2), keys.transpose(1, 2),
                values.transpose(1, 2), attn_mask=mask, scale=self.layers[0].self_attn.scale,
                enable_gqa=True,
            )  # fmt: skip
            return out.transpose(1, 2).reshape(b * block, *q.shape[1:])

        with sdpa_kernel(BLOCK_SDPA_BACKENDS):
            hidden = self.block_hidden(embeds.reshape(b * block, -1), positions.reshape(-1), attend)
        return self.compute_logits(hidden.view(b, block, -1)[:, 1:])

    # -------------------------------------------------------------------------------- checkpoint

    def checkpoint_layout(self, param_name: str) -> list[tuple[str, int]]:
        """The HF keys that, concatenated along dim 0 in order, form ``param_name``:
        ``layers.0.self_attn.qkv_proj.weight`` -> q_proj, k_proj, v_proj rows."""
        module, _, leaf = param_name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last not in self.packed_modules:
            return [(param_name, self.get_parameter(param_name).shape[0])]
        c = self.config
        rows = {
            "q_proj": c.num_heads * c.head_dim,
            "k_proj": c.num_kv_heads * c.head_dim,
            "v_proj": c.num_kv_heads * c.head_dim,
            "gate_proj": c.intermediate_size,
            "up_proj": c.intermediate_size,
        }
        return [(f"{parent}.{part}.{leaf}", rows[part]) for part in self.packed_modules[last]]
