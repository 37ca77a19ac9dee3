"""Peer benchmark: the fastest plain-PyTorch decode of a Llama model (gpt-fast style).

The decoder below is self-contained: it reads an HF-format directory (config.json +
*.safetensors), fuses q/k/v into one matmul and gate/up into one matmul at load, and
keeps a static KV cache per layer of shape [batch, kv_heads, max_len, head_dim].

Variants, measured in one run for every batch size:

- ``eager``: the decode step called from Python, one kernel launch at a time.
- ``graph``: the same uncompiled step captured once as a CUDA graph and replayed per step.
- ``graph+compile``: the step compiled with ``torch.compile`` (inductor, CUDA graphs off),
  then captured by us as one CUDA graph per step. We capture ourselves instead of using
  ``mode="reduce-overhead"`` because the step mutates the KV cache, the token and the
  position buffers in place, and doing the capture explicitly keeps the replayed work
  identical to the ``graph`` variant.
- ``compile``: compiled, no graph (the only compiled variant on CPU; opt-in on CUDA).

Decode loop invariants: tokens stay on the device (greedy argmax inside the step), nothing
in the loop synchronises with the host, and the timed region ends with one event sync.
Every sequence in a batch shares one position (equal-length prompts), so a step's
``input_pos`` is a [1] tensor. Units: ms/step is one new token for every sequence;
tokens/s = batch * steps / seconds; prefill tokens/s = batch * prompt_len / seconds.

Correctness: the first ``--check-tokens`` greedy tokens of every variant are compared with
``eager`` (a mismatch is a warning in bf16, where near-ties can flip, and an error in
``--smoke``); with ``--check-hf`` (on in ``--smoke``) also with HF ``generate``.

    python benchmarks/peer_gpt_fast.py --model-dir HF_DIR --batch-sizes 1,64 --json out/peer.json
    python benchmarks/peer_gpt_fast.py --smoke --random-tiny                    # CPU check

``HF_DIR``: an HF directory; for a specdec alias or GGUF, the one it converts to
(``specdec.models.loader.resolve_model(name).hf_dir``). Prints a table last: ms/step,
decode and prefill tokens/s per (variant, batch).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

if __package__:  # python -m benchmarks.peer_gpt_fast
    from . import common
    from .peer_hf_generate import hf_greedy_tokens, load_hf_model
else:  # python benchmarks/peer_gpt_fast.py
    import common
    from peer_hf_generate import hf_greedy_tokens, load_hf_model

BENCH = "gpt-fast"
GRAPH_VARIANTS = ("graph", "graph+compile")
ALL_VARIANTS = ("eager", "graph", "graph+compile", "compile")
# Modes that add inductor's own CUDA graphs would nest inside our capture.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")

# ---------------------------------------------------------------------------- model


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict) -> LlamaArgs:
        """Read an HF Llama config.json (transformers 4.x ``rope_theta``/``rope_scaling`` or
        5.x ``rope_parameters``). Only plain RoPE, SiLU and bias-free projections exist here."""
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r}; this peer supports 'default'")
        theta = cfg.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise NotImplementedError("attention_bias/mlp_bias=true; this peer has no biases")
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg['hidden_act']!r}; expected 'silu'")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32, cast back, then scale: the same rounding points as HF Llama.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(
    x: torch.Tensor,  # [B, T, heads, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> torch.Tensor:  # [B, T, heads, D]
    # HF "rotate half" layout: dims (i, i + D/2) form one rotating pair.
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class KVCache(nn.Module):
    """Static per-layer cache. Positions > the current one hold stale values and are
    always masked out; a run writes every position before any query may read it."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, **kw) -> None:
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, **kw), persistent=False)
        self.register_buffer("v", torch.zeros(shape, **kw), persistent=False)

    def update(
        self,
        input_pos: torch.Tensor,  # [T] int64
        k: torch.Tensor,  # [B, kv_heads, T, D]
        v: torch.Tensor,  # [B, kv_heads, T, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [B, kv_heads, max_len, D]
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Block(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.a = a
        qkv_out = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        self.attn_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.wqkv = nn.Linear(a.hidden_size, qkv_out, bias=False)
        self.wo = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(a.hidden_size))
        self.w_gate_up = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.w_down = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        input_pos: torch.Tensor,  # [T] int64
        mask: torch.Tensor,  # [T, max_len] bool, True = may attend
    ) -> torch.Tensor:  # [B, T, hidden]
        a, cache = self.a, self.kv_cache
        assert cache is not None, "call setup_caches() first"
        bsz, seq, _ = x.shape
        nh, nkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        group = nh // nkv

        qkv = self.wqkv(rms_norm(x, self.attn_norm, a.rms_norm_eps))
        q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
        q = apply_rope(q.view(bsz, seq, nh, d), cos, sin)  # [B, T, nh, D]
        k = apply_rope(k.view(bsz, seq, nkv, d), cos, sin).transpose(1, 2)  # [B, nkv, T, D]
        v = v.view(bsz, seq, nkv, d).transpose(1, 2)  # [B, nkv, T, D]
        k_all, v_all = cache.update(input_pos, k, v)

        if seq == 1:
            # Decode. Query head h reads KV head h // group (HF repeat_kv order), so the
            # group's query heads can stand in as `group` query rows of one KV head: GQA
            # without materialising repeated K/V. All rows share the one position's mask.
            qg = q.reshape(bsz, nkv, group, d)
            o = F.scaled_dot_product_attention(qg, k_all, v_all, attn_mask=mask[None, None])
            o = o.reshape(bsz, 1, nh * d)  # [B, nkv, group, D] -> [B, 1, nh * D]
        else:
            # Prefill always starts at position 0 (invariant of this benchmark), so the
            # fresh K/V are the whole context and plain causal attention applies.
            kx = k.repeat_interleave(group, dim=1)  # [B, nh, T, D]
            vx = v.repeat_interleave(group, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kx, vx, is_causal=True)
            o = o.transpose(1, 2).reshape(bsz, seq, nh * d)
        x = x + self.wo(o)

        gate, up = self.w_gate_up(rms_norm(x, self.ffn_norm, a.rms_norm_eps)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class LlamaDecoder(nn.Module):
    def __init__(self, a: LlamaArgs) -> None:
        super().__init__()
        self.a = a
        self.embed = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_layers))
        self.norm = nn.Parameter(torch.ones(a.hidden_size))
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.max_len = 0

    def setup_caches(self, batch: int, max_len: int) -> None:
        """(Re)allocate every layer's static cache and the RoPE / mask tables."""
        w = self.embed.weight
        kw = {"device": w.device, "dtype": w.dtype}
        a = self.a
        for layer in self.layers:
            layer.kv_cache = KVCache(batch, a.num_kv_heads, max_len, a.head_dim, **kw)
        inv_freq = 1.0 / (
            a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim)
        )
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1).to(w.device)  # [max_len, D], fp32 like HF
        self.register_buffer("rope_cos", emb.cos().to(w.dtype), persistent=False)
        self.register_buffer("rope_sin", emb.sin().to(w.dtype), persistent=False)
        causal = torch.ones(max_len, max_len, dtype=torch.bool, device=w.device).tril()
        self.register_buffer("causal_mask", causal, persistent=False)
        self.max_len = max_len

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        input_pos: torch.Tensor,  # [T] int64, absolute positions of `tokens`
    ) -> torch.Tensor:  # [B, vocab] logits of the last position only
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [T, D]
        mask = self.causal_mask[input_pos]  # [T, max_len]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, mask)
        return self.lm_head(rms_norm(x[:, -1], self.norm, self.a.rms_norm_eps))


def _hf_to_ours(hf: dict[str, torch.Tensor], a: LlamaArgs) -> dict[str, torch.Tensor]:
    """Rename HF keys and fuse q/k/v and gate/up. Leftover HF keys are an error."""
    hf = dict(hf)
    pop = hf.pop
    out = {"embed.weight": pop("model.embed_tokens.weight"), "norm": pop("model.norm.weight")}
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        attn = [pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]
        mlp = [pop(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
        out[f"layers.{i}.attn_norm"] = pop(f"{p}input_layernorm.weight")
        out[f"layers.{i}.wqkv.weight"] = torch.cat(attn, dim=0)
        out[f"layers.{i}.wo.weight"] = pop(f"{p}self_attn.o_proj.weight")
        out[f"layers.{i}.ffn_norm"] = pop(f"{p}post_attention_layernorm.weight")
        out[f"layers.{i}.w_gate_up.weight"] = torch.cat(mlp, dim=0)
        out[f"layers.{i}.w_down.weight"] = pop(f"{p}mlp.down_proj.weight")
    lm_head = pop("lm_head.weight", None)
    if lm_head is None and not a.tie_word_embeddings:
        raise ValueError("lm_head.weight missing and tie_word_embeddings is false")
    out["lm_head.weight"] = out["embed.weight"] if a.tie_word_embeddings else lm_head
    leftover = [k for k in hf if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}")
    return out


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> LlamaDecoder:
    """Build the decoder from an HF directory; tied embeddings stay one tensor."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    args = LlamaArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(load_file(f))
    with torch.device("meta"):
        model = LlamaDecoder(args)
    model.load_state_dict(_hf_to_ours(hf, args), strict=True, assign=True)
    model = model.to(device=device, dtype=dtype).eval()
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model


# ---------------------------------------------------------------------------- decode


@dataclass
class DecodeBuffers:
    """Static inputs/outputs of one decode step; the step updates all of them in place."""

    tokens: torch.Tensor  # [B, 1] int64, token fed to the next step
    input_pos: torch.Tensor  # [1] int64, position of `tokens`
    step_idx: torch.Tensor  # [1] int64, column of out_tokens the next step writes
    out_tokens: torch.Tensor  # [B, capacity] int64, greedy tokens produced so far

    def reset(self, first_token: torch.Tensor, prompt_len: int) -> None:
        """Rewind to just after prefill; first_token: [B, 1] int64."""
        self.tokens.copy_(first_token)
        self.input_pos.fill_(prompt_len)
        self.step_idx.zero_()


def make_step(
    next_token: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], buf: DecodeBuffers
) -> Callable[[], None]:
    """One decode step as a no-argument function of static buffers (capturable)."""

    def step() -> None:
        nxt = next_token(buf.tokens, buf.input_pos)  # [B, 1]
        buf.tokens.copy_(nxt)
        buf.out_tokens.index_copy_(1, buf.step_idx, nxt)
        buf.input_pos.add_(1)
        buf.step_idx.add_(1)

    return step


def capture_graph(step: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (compiles, autotunes, lazily inits kernels), then capture
    one step. Leaves the buffers advanced by the warm-up steps: reset before use."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def build_runner(
    variant: str, model: LlamaDecoder, buf: DecodeBuffers, device: torch.device, mode: str
) -> Callable[[int], None]:
    """A function running n decode steps for one variant (compiling/capturing first)."""

    def next_token(tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return model(tokens, input_pos).argmax(dim=-1, keepdim=True)  # [B, 1]

    fn = next_token
    if "compile" in variant:
        torch._dynamo.reset()  # fresh cache per batch size: no recompile-limit surprises
        fn = torch.compile(next_token, mode=mode, fullgraph=True, dynamic=False)
    step = make_step(fn, buf)
    if variant in GRAPH_VARIANTS:
        graph = capture_graph(step, device)

        def run_steps(n: int) -> None:
            for _ in range(n):
                graph.replay()

        return run_steps
    # Warm up here too, so compilation never lands in a timed region.
    for _ in range(3):
        step()

    def run_steps(n: int) -> None:
        for _ in range(n):
            step()

    return run_steps


# ---------------------------------------------------------------------------- benchmark


@dataclass(frozen=True)
class Options:
    model_dir: str | None
    random_tiny: bool = False
    device: str | None = None
    dtype: str | None = None
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    prompt_len: int = 128
    steps: int = 256  # decode steps timed per repeat
    repeats: int = 5
    warmup: int = 1
    variants: tuple[str, ...] | None = None  # None: device default
    compile_mode: str = "default"
    check_tokens: int = 16
    check_hf: bool = False
    seed: int = 0
    json_path: str | None = None
    smoke: bool = False

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (not self.random_tiny):
            raise ValueError("give exactly one of --model-dir DIR or --random-tiny")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"--compile-mode {self.compile_mode!r}: choose from {COMPILE_MODES} "
                "(modes with CUDA graphs would nest inside our own capture)"
            )
        bad = [v for v in self.variants or () if v not in ALL_VARIANTS]
        if bad:
            raise ValueError(f"unknown variants {bad}; choose from {ALL_VARIANTS}")
        if min(self.prompt_len, self.steps, self.repeats, self.check_tokens) <= 0:
            raise ValueError("prompt_len, steps, repeats and check_tokens must be positive")


def run_batch(
    model: LlamaDecoder, opts: Options, batch: int, device: torch.device, variants: list[str]
) -> tuple[list[common.ResultRow], dict[str, torch.Tensor]]:
    """Prefill once, then time every variant's decode; returns rows and each variant's
    first check_tokens greedy tokens ([B, check_tokens], prefill's token first)."""
    steps, t = opts.steps, opts.prompt_len
    capacity = max(steps, opts.check_tokens, 4)  # 4 > warm-up steps
    max_len = -(-(t + capacity + 1) // 64) * 64  # round up: aligned mask rows for SDPA
    model.setup_caches(batch, max_len)
    prompt = common.random_prompt_ids(batch, t, model.a.vocab_size, opts.seed, device)
    prompt_pos = torch.arange(t, device=device)

    def prefill() -> torch.Tensor:  # [B, 1]
        return model(prompt, prompt_pos).argmax(dim=-1, keepdim=True)

    first_token = prefill()
    prefill_s = common.measure(prefill, device, warmup=opts.warmup, repeats=opts.repeats)
    row_kw = {"bench": BENCH, "batch_size": batch, "prompt_len": t, "new_tokens": steps}
    rows = [
        common.ResultRow(
            variant="prefill (eager)", prefill_tokens_per_s=batch * t / prefill_s, **row_kw
        )
    ]
    buf = DecodeBuffers(
        tokens=first_token.clone(),
        input_pos=torch.tensor([t], device=device),
        step_idx=torch.zeros(1, dtype=torch.long, device=device),
        out_tokens=torch.zeros(batch, capacity, dtype=torch.long, device=device),
    )
    generated: dict[str, torch.Tensor] = {}
    for variant in variants:
        print(f"  batch {batch}: {variant} ...", flush=True)
        try:
            buf.reset(first_token, t)
            runner = build_runner(variant, model, buf, device, opts.compile_mode)
            seconds = common.measure(
                lambda runner=runner: runner(steps),
                device,
                warmup=opts.warmup,
                repeats=opts.repeats,
                setup=lambda: buf.reset(first_token, t),
            )
            buf.reset(first_token, t)
            runner(opts.check_tokens - 1)
            cols = buf.out_tokens[:, : opts.check_tokens - 1]
            generated[variant] = torch.cat((first_token, cols), dim=1).cpu()
            del runner  # frees its CUDA graph and memory pool
        except Exception as exc:  # report and keep measuring the other variants
            if opts.smoke:
                raise
            traceback.print_exc()
            msg = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
            rows.append(common.ResultRow(variant=variant, note=msg, **row_kw))
            print(f"  {variant}: {msg}", flush=True)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(
            common.ResultRow(
                variant=variant,
                ms_per_step=seconds / steps * 1e3,
                decode_tokens_per_s=batch * steps / seconds,
                **row_kw,
            )
        )
        print(f"  {variant}: {seconds / steps * 1e3:.3f} ms/step", flush=True)
    return rows, generated


def check_tokens(
    generated: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], strict: bool
) -> dict[str, str]:
    """Compare each source's tokens ([B, n]) with each reference; returns a note per
    mismatching source. In strict mode (fp32 smoke) a mismatch raises instead."""
    notes: dict[str, str] = {}
    for ref_name, ref in reference.items():
        for name, toks in generated.items():
            if name == ref_name or torch.equal(toks, ref):
                continue
            first = int((toks != ref).any(dim=0).int().argmax())
            msg = f"tokens differ from {ref_name} at {first}/{ref.shape[1]}"
            if strict:
                raise AssertionError(
                    f"{name} {msg}\n{name}: {toks.tolist()}\n{ref_name}: {ref.tolist()}"
                )
            print(f"WARNING: {name} {msg} (near-ties can flip in low precision)", flush=True)
            notes[name] = "; ".join(filter(None, (notes.get(name), msg)))
    return notes


def run(opts: Options) -> list[common.ResultRow]:
    device = common.resolve_device(opts.device)
    dtype = common.resolve_dtype(opts.dtype, device)
    on_cuda = device.type == "cuda"
    default = ("eager", *GRAPH_VARIANTS) if on_cuda else ("eager", "compile")
    variants = list(opts.variants or default)
    if not on_cuda and any(v in GRAPH_VARIANTS for v in variants):
        raise ValueError(f"variants {variants} need CUDA graphs; device is {device}")
    env = common.env_info(device, dtype)
    common.print_env(env)
    rows: list[common.ResultRow] = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        model_dir = (
            common.make_random_tiny_model_dir(tmp) if opts.random_tiny else Path(opts.model_dir)
        )
        model = load_model(model_dir, device, dtype)
        hf_model = load_hf_model(model_dir, device, dtype, "eager") if opts.check_hf else None
        for batch in opts.batch_sizes:
            batch_rows, generated = run_batch(model, opts, batch, device, variants)
            reference = {k: v for k, v in generated.items() if k == "eager"}
            if hf_model is not None:
                prompt = common.random_prompt_ids(
                    batch, opts.prompt_len, model.a.vocab_size, opts.seed, device
                )
                reference["hf-generate"] = hf_greedy_tokens(hf_model, prompt, opts.check_tokens)
                generated = {**generated, "hf-generate": reference["hf-generate"]}
            strict = opts.smoke and dtype == torch.float32
            notes = check_tokens(generated, reference, strict)
            print(
                f"  batch {batch}: first {opts.check_tokens} greedy tokens of "
                f"{sorted(generated)} vs {sorted(reference)}: {len(notes)} mismatching",
                flush=True,
            )
            for r in batch_rows:
                if r.variant in notes:
                    r.note = "; ".join(filter(None, (r.note, notes[r.variant])))
            rows.extend(batch_rows)
            if opts.json_path:
                common.write_json(opts.json_path, env=env, options=opts, rows=rows)
    print()
    print(common.markdown_table(rows))
    return rows


def parse_args(argv: list[str] | None = None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", help="HF-format dir: config.json + *.safetensors")
    p.add_argument("--random-tiny", action="store_true", help="tiny random Llama, no weights")
    p.add_argument("--device", help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(common.DTYPES), help="default: bf16 cuda, fp32 cpu")
    p.add_argument("--batch-sizes", default="1,8,64", type=common.parse_int_list)
    p.add_argument("--prompt-len", type=int, default=128, help="random ids, fixed seed")
    p.add_argument("--steps", type=int, default=256, help="decode steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; medians reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats before timing")
    p.add_argument(
        "--variants",
        type=common.parse_str_list,
        help=f"from {ALL_VARIANTS}; default eager,graph,graph+compile (cpu: eager,compile)",
    )
    p.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    p.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared")
    p.add_argument("--check-hf", action="store_true", help="also compare with HF generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write env, options and rows here")
    p.add_argument(
        "--smoke", action="store_true", help="cpu fp32, batch 1,2, 8 steps, 1 repeat, strict"
    )
    ns = p.parse_args(argv)
    opts = Options(
        model_dir=ns.model_dir,
        random_tiny=ns.random_tiny,
        device=ns.device,
        dtype=ns.dtype,
        batch_sizes=tuple(ns.batch_sizes),
        prompt_len=ns.prompt_len,
        steps=ns.steps,
        repeats=ns.repeats,
        warmup=ns.warmup,
        variants=tuple(ns.variants) if ns.variants else None,
        compile_mode=ns.compile_mode,
        check_tokens=ns.check_tokens,
        check_hf=ns.check_hf,
        seed=ns.seed,
        json_path=ns.json_path,
        smoke=ns.smoke,
    )
    if opts.smoke:
        opts = replace(
            opts,
            device="cpu",
            dtype="fp32",
            batch_sizes=(1, 2),
            prompt_len=32,
            steps=8,
            repeats=1,
            warmup=0,
            check_hf=True,
        )
    return opts


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
