"""The decoder for every supported target family (Llama 2/3, SmolLM2, Qwen2, Qwen3).

Families differ only in ``ModelConfig`` flags: q/k/v and o_proj biases, per-head q/k
RMSNorm, tied embeddings, RoPE variant. The forward runs on a flattened varlen batch over
the paged KV cache, is free of host syncs and of Python branches on tensor values, and
routes all attention through the ``AttentionBackend`` (one seam to wrap as a custom op).

Weights are stored fused: ``qkv_proj`` = cat(q, k, v) and ``gate_up_proj`` = cat(gate, up)
along the output dimension, one matmul each. ``checkpoint_layout`` maps every parameter
back to the HF checkpoint keys it is assembled from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention.base import AttentionBackend
from specdec.models.compiling import compile_region
from specdec.models.config import ModelConfig
from specdec.models.linear import Linear, add_norm_gate_up_silu, add_norm_linear
from specdec.models.module_flags import set_on_modules
from specdec.models.rope import RotaryEmbedding
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.rope import apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, kv_heads, head_dim]


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose initialisation leaves a meta weight alone. A model built on
    the meta device is filled from a checkpoint; initialising its meta embedding would run
    ``normal_`` through ``torch._refs``, whose first call imports ``torch._dynamo`` (~0.7 s
    of a CPU start-up) for values a meta tensor does not hold."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back, then scaled (HF's order, so bf16 matches).

    ``invariant`` (set by ``models.invariant.use_invariant_kernels``): the Triton kernel of
    ``kernels/rmsnorm.py``, one program per row, whose results do not depend on the rows
    around it; same roundings, its own summation order. ``eager_kernel`` (set by
    ``use_kernel_norms``): the same kernel where the module runs uncompiled (the engine's
    prefill steps), code that ``torch.compile`` traces keeping the torch ops it fuses."""

    invariant: bool = False
    eager_kernel: bool = False

    @property
    def _on_kernel(self) -> bool:
        return self.invariant or (self.eager_kernel and not torch.compiler.is_compiling())

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if self._on_kernel:
            from specdec.kernels.rmsnorm import rmsnorm  # triton loads only when used

            return rmsnorm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(
        self,
        x: torch.Tensor,  # [..., dim]
        residual: torch.Tensor,  # [..., dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (self(x + residual), x + residual)
        """The norm of the stream ``x + residual``, and the stream; one launch on the
        kernel (``invariant``, or ``eager_kernel`` uncompiled)."""
        if self._on_kernel:
            from specdec.kernels.rmsnorm import add_rmsnorm

            return add_rmsnorm(x, residual, self.weight, self.eps)
        stream = x + residual
        return self(stream), stream


def use_kernel_norms(model: nn.Module) -> int:
    """Run every ``RMSNorm`` of ``model`` on the one-launch Triton kernel wherever it runs
    uncompiled (``RMSNorm.eager_kernel``): eager, a norm over a prefill step's rows is
    nine elementwise passes over them in float32 (the add before it, cast, square, mean,
    add eps, rsqrt, scale, cast back, weight), each a launch over the whole [tokens,
    hidden]. Returns how many modules it set."""
    return set_on_modules(model, RMSNorm, "eager_kernel", True)


class Attention(nn.Module):
    """Rotary GQA attention on the paged cache: fused qkv projection (optional bias),
    optional per-head q/k RMSNorm (Qwen3), output projection back to ``hidden_size``.
    ``input_size`` defaults to ``hidden_size``; the EAGLE-3 head reads a 2H-wide input."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        *,
        input_size: int | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,  # None: no q/k norm
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.qkv_proj = Linear(
            input_size or hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias
        )
        self.o_proj = Linear(self.q_size, hidden_size, bias=o_bias)
        norm = qk_norm_eps is not None
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if norm else nn.Identity()

    @classmethod
    def from_config(cls, config: ModelConfig, backend: AttentionBackend) -> Attention:
        return cls(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            backend,
            qkv_bias=config.attention_bias,
            o_bias=config.o_proj_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        )

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.attend(self.qkv_proj(x), cos, sin, kv_cache, meta)

    def forward_add_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor,  # [num_tokens, hidden]
        norm: RMSNorm,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (attention output, the stream x + residual)
        """``(self(norm(x + residual)), x + residual)``; on the Triton GEMM path the add,
        the norm and the qkv projection are one launch."""
        entry = add_norm_linear(x, residual, norm, self.qkv_proj)
        if entry is None:
            normed, stream = norm.add_forward(x, residual)
            return self(normed, cos, sin, kv_cache, meta), stream
        qkv, stream = entry
        return self.attend(qkv, cos, sin, kv_cache, meta), stream

    def attend(
        self,
        qkv: torch.Tensor,  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Everything after the qkv projection: RoPE, the cache write, attention, o_proj."""
        n, h, d = qkv.shape[0], self.num_heads, self.head_dim
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, d)
        k_cache, v_cache = kv_cache
        if isinstance(self.q_norm, nn.Identity):
            # q and k go to the backend before RoPE, as strided views of the projection:
            # the Triton backend rotates them inside its cache write (a decode step is
            # launch-bound: one kernel per layer fewer).
            q = qkv[:, : self.q_size].view(n, h, d)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, self.num_kv_heads, d)
            out = self.backend.forward_rope(
                q, k, v, cos, sin, k_cache, v_cache, meta, self.scale
            )  # [num_tokens, heads, head_dim]
        else:  # Qwen3: per-head norms before RoPE
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q = apply_rotary(self.q_norm(q.view(n, h, d)), cos, sin)
            k = apply_rotary(self.k_norm(k.view(n, self.num_kv_heads, d)), cos, sin)
            out = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    """SiLU-gated MLP (gate and up fused into one matmul); shared with the EAGLE-3 head."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        # One launch for gate, up and SiLU on the Triton path (LoRA training wraps the
        # projection in another module: it runs unfused).
        gate_up = self.gate_up_proj
        act = gate_up.gate_up_silu(x) if isinstance(gate_up, Linear) else None
        if act is None:
            gate, up = gate_up(x).chunk(2, dim=-1)
            act = F.silu(gate) * up  # [num_tokens, intermediate]
        return self.down_proj(act)

    def forward_add_norm(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor,  # [num_tokens, hidden]
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, the stream x + residual)
        """``(self(norm(x + residual)), x + residual)``; on the Triton GEMM path the add,
        the norm, gate/up and SiLU are one launch."""
        entry = add_norm_gate_up_silu(x, residual, norm, self.gate_up_proj)
        if entry is None:
            normed, stream = norm.add_forward(x, residual)
            return self(normed), stream
        act, stream = entry
        return self.down_proj(act), stream


class DecoderLayer(nn.Module):
    """One pre-norm block. The residual stream travels split in two, ``x + residual``, as
    in vLLM: each norm then sits in the same compiled region as the add before it (one
    fused kernel) even when every layer is compiled on its own (``compile_regions``)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention.from_config(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor,  # [num_tokens, hidden]: the stream entering is x + residual
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x, residual): the stream leaving, split
        # x + residual is the stream entering the layer (HF hidden_states[i]); each
        # forward_add_norm returns the stream after its add.
        h, stream = self.self_attn.forward_add_norm(
            x, residual, self.input_layernorm, cos, sin, kv_cache, meta
        )
        return self.mlp.forward_add_norm(h, stream, self.post_attention_layernorm)


@dataclass(frozen=True)
class _Stages:
    """How ``CausalLM.forward`` runs: eager modules, or their compiled regions."""

    enter: Callable  # (input_ids, positions) -> (x, residual, cos, sin)
    layers: Sequence[Callable]  # (x, residual, cos, sin, kv_cache, meta) -> (x, residual)
    leave: Callable  # (x, residual) -> hidden after the final norm


class CausalLM(nn.Module):
    """A decoder-only LM over the paged KV cache.

    ``forward`` returns the final-normed hidden states and, for ``aux_layer_ids``, the
    residual stream *entering* those layers (HF ``hidden_states[i]``; EAGLE-3's inputs).
    ``compute_logits`` is separate so callers project only the rows they sample from.
    """

    # Fused parameter -> the HF projections concatenated into it, in order.
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        *,
        max_positions: int | None = None,
    ) -> None:
        """``max_positions`` bounds the RoPE table (default ``config.max_context_len``);
        an engine with a shorter ``max_model_len`` can pass it to save memory."""
        super().__init__()
        if max_positions is not None and max_positions <= 0:
            raise ValueError(f"max_positions must be positive; got {max_positions}")
        self.config = config
        self.attention = attention
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding.for_config(config, max_positions or config.max_context_len)
        self.tie_weights()
        # A plain attribute, not submodules: the compiled wrappers share these parameters.
        self._compiled: _Stages | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config ties them. Call again after
        anything that may replace parameters (``materialize``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: Sequence[KVCache],  # one (k_cache, v_cache) per layer
        meta: AttentionMetadata,
        aux_layer_ids: Sequence[int] = (),
        *,
        compiled: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns ``hidden`` [num_tokens, hidden] after the final norm, and ``aux``
        [num_tokens, len(aux_layer_ids) * hidden] (None when no ids are asked for).
        ``compiled``: run the regions ``compile_regions`` built (same results)."""
        num_layers = self.config.num_layers
        if any(not 0 <= i < num_layers for i in aux_layer_ids):
            raise ValueError(
                f"aux_layer_ids {list(aux_layer_ids)} must lie in [0, {num_layers}) "
                "(the residual stream entering layer i)"
            )
        if not compiled:
            stages = _Stages(self._enter, self.layers, self._leave)
        elif self._compiled is None:
            raise RuntimeError("forward(compiled=True) needs compile_regions() first")
        else:
            stages = self._compiled
        x, residual, cos, sin = stages.enter(input_ids, positions)
        entering: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(stages.layers):
            if i in aux_layer_ids:
                entering[i] = x + residual
            x, residual = layer(x, residual, cos, sin, kv_caches[i], meta)
        aux = torch.cat([entering[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return stages.leave(x, residual), aux

    def _enter(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # x, residual, cos, sin
        """The stream entering layer 0 as (embedding, zeros): adding zero is exact, and a
        zero tensor rather than None keeps one compiled variant for every layer."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary(positions, x.dtype)
        return x, torch.zeros_like(x), cos, sin

    def _leave(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm.add_forward(x, residual)[0]  # [num_tokens, hidden]

    def compile_regions(self, **compile_kwargs) -> None:
        """Compile the repeated region, not the whole model: ``torch.compile`` per decoder
        layer (every layer shares one compilation: same code, parameters as inputs) plus
        the small regions before and after. A whole-model graph took ~1 min per
        compilation on the H200's host, and shapes need three (a static first shape, the
        dynamic one, batch 1); a layer's graph is a thirtieth of it. Kernels only fuse within a
        region, so the split residual stream (``DecoderLayer``) keeps add + norm fused.
        ``forward(..., compiled=True)`` runs the compiled regions; eager callers (prefill,
        mixed steps) keep the plain modules, whose varying shapes would recompile.

        Refused once ``models.invariant.use_invariant_kernels`` switched the model: the
        compiled regions would round the elementwise chains between the kernels
        differently from the eager modules that the other steps run."""
        if any(getattr(m, "invariant", False) for m in self.modules()):
            raise ValueError(
                "this model runs batch-invariant kernels (deterministic mode); compiling its "
                "regions would make a token's logits depend on whether its step ran "
                "compiled or eagerly: run it uncompiled (EngineConfig.compile unset or False)"
            )
        self._compiled = _Stages(
            enter=compile_region(self._enter, **compile_kwargs),
            layers=tuple(compile_region(layer, **compile_kwargs) for layer in self.layers),
            leave=compile_region(self._leave, **compile_kwargs),
        )

    def compute_logits(
        self,
        hidden: torch.Tensor,  # [n, hidden]
    ) -> torch.Tensor:  # [n, vocab] float32
        return self.lm_head(hidden).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        return self.embed_tokens(input_ids)

    def checkpoint_layout(self, param_name: str) -> list[tuple[str, int]]:
        """The HF checkpoint keys that, concatenated along dim 0 in order, form
        ``param_name``, each with its number of rows.

        ``layers.3.self_attn.qkv_proj.weight`` ->
        ``[("model.layers.3.self_attn.q_proj.weight", q_rows), (... k ...), (... v ...)]``.
        """
        prefix = "" if param_name.startswith("lm_head.") else "model."
        module, _, leaf = param_name.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last not in self.packed_modules:
            rows = self.get_parameter(param_name).shape[0]
            return [(prefix + param_name, rows)]
        c = self.config
        rows_by_part = {
            "q_proj": c.num_heads * c.head_dim,
            "k_proj": c.num_kv_heads * c.head_dim,
            "v_proj": c.num_kv_heads * c.head_dim,
            "gate_proj": c.intermediate_size,
            "up_proj": c.intermediate_size,
        }
        return [
            (f"{prefix}{parent}.{part}.{leaf}", rows_by_part[part])
            for part in self.packed_modules[last]
        ]
