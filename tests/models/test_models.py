"""Our decoder on the paged cache equals HF transformers; loading fails loudly.

Tiny random models of each family (and each RoPE variant) are saved with HF
``save_pretrained`` and loaded with our loader; a ragged batch then runs through a varlen
prefill, a chunked prefill and decode steps on a paged cache whose blocks are scattered,
and every logit and aux hidden state must match HF run one sequence at a time.
"""

from __future__ import annotations

import inspect
import json
import os
import random
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdec.models import (
    ALIASES,
    CausalLM,
    ModelConfig,
    ModelNotFoundError,
    WeightLoadError,
    load_model,
    resolve_model,
)
from specdec.models import gguf as gguf_module
from specdec.models.rope import RopeParams, rope_cos_sin
from specdec.ops.attention_metadata import AttentionMetadata

TOL = 1e-4
VOCAB = 96
BLOCK_SIZE = 4

# ---------------------------------------------------------------- tiny HF models

_TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)

# name -> (config class, overrides). Prompts reach position ~20 and decoding ~28, so the
# scaled variants are exercised past their original context (16).
TINY_CASES: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama-tied": (LlamaConfig, dict(tie_word_embeddings=True)),
    "llama-untied-gqa1": (LlamaConfig, dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "llama-linear": (LlamaConfig, dict(rope_parameters={"rope_type": "linear", "factor": 2.0})),
    "llama-llama3": (
        LlamaConfig,
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    "llama-yarn": (
        LlamaConfig,
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
    ),
    # Dynamic NTK: prompts stay below the trained 16 positions, decoding runs past them
    # (where HF's incremental decoding and our per-position rule agree).
    "llama-dynamic": (
        LlamaConfig,
        dict(
            max_position_embeddings=16,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0},
        ),
    ),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (Qwen3Config, dict(head_dim=24, tie_word_embeddings=False)),  # head_dim != 64/4
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations and non-trivial norms/biases, so that a 1e-4 logit
    tolerance separates a correct implementation from a subtly wrong one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif p.ndim == 1:  # biases
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)


def save_tiny(case: str, path: Path, seed: int = 0):
    cls, overrides = TINY_CASES[case]
    hf_config = cls(**{**_TINY, **overrides})
    hf_config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(hf_config).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model


# ------------------------------------------------------------- paged-cache driver


@dataclass
class PagedDriver:
    """Runs ``CausalLM`` steps over a paged cache with a scattered block allocation."""

    model: CausalLM  # or a torch.compile'd CausalLM
    num_blocks: int = 64
    seed: int = 0
    tables: dict[int, list[int]] = field(default_factory=dict)
    lens: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.model.config
        shape = (self.num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_layers)]
        self.free = list(range(1, self.num_blocks))  # block 0 is the null block
        random.Random(self.seed).shuffle(self.free)

    def step(
        self, chunks: list[tuple[int, list[int]]], aux_ids: tuple[int, ...] = ()
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward over ``(seq, new tokens)`` chunks -> per chunk (logits, aux)."""
        ids, positions, slots, q_lens, seq_lens = [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            for pos in range(start, end):
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids += tokens
            positions += range(start, end)
            q_lens.append(len(tokens))
            seq_lens.append(end)
            self.lens[seq] = end
        width = max(len(self.tables[s]) for s, _ in chunks)
        block_tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _ in chunks]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, *accumulate(q_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(block_tables, dtype=torch.int32),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )
        with torch.no_grad():
            hidden, aux = self.model(
                torch.tensor(ids), torch.tensor(positions), self.kv, meta, aux_ids
            )
            logits = self.model.compute_logits(hidden)
        assert hidden.shape == (len(ids), self.model.config.hidden_size)
        assert logits.dtype == torch.float32
        out, start = [], 0
        for n in q_lens:
            out.append((logits[start : start + n], None if aux is None else aux[start : start + n]))
            start += n
        return out


def run_schedule(
    driver: PagedDriver, seqs: list[list[int]], prompt_lens: list[int], aux_ids: tuple[int, ...]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step 1: varlen prefill of seqs 0 and 2 plus the first half of seq 1's prompt.
    Step 2: decode 0 and 2, the rest of seq 1's prompt (an extend), seq 3's whole prompt.
    Then decode steps until every sequence is consumed (teacher-forced).
    Returns per sequence (logits [L, vocab], aux [L, len(aux_ids) * hidden])."""
    fed = [0] * len(seqs)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    aux: list[list[torch.Tensor]] = [[] for _ in seqs]

    def chunk(s: int, n: int) -> tuple[int, list[int]]:
        tokens = seqs[s][fed[s] : fed[s] + n]
        fed[s] += n
        return s, tokens

    half = prompt_lens[1] // 2
    plan = [
        [chunk(0, prompt_lens[0]), chunk(1, half), chunk(2, prompt_lens[2])],
        [chunk(0, 1), chunk(1, prompt_lens[1] - half), chunk(2, 1), chunk(3, prompt_lens[3])],
    ]
    for chunks in plan:
        for (s, _), (lg, ax) in zip(chunks, driver.step(chunks, aux_ids), strict=True):
            logits[s].append(lg)
            aux[s].append(ax)
    while any(fed[s] < len(seqs[s]) for s in range(len(seqs))):
        chunks = [chunk(s, 1) for s in range(len(seqs)) if fed[s] < len(seqs[s])]
        for (s, _), (lg, ax) in zip(chunks, driver.step(chunks, aux_ids), strict=True):
            logits[s].append(lg)
            aux[s].append(ax)
    return [(torch.cat(lg), torch.cat(ax)) for lg, ax in zip(logits, aux, strict=True)]


def hf_reference(hf_model, tokens: list[int], prompt_len: int) -> tuple[torch.Tensor, list]:
    """HF logits [L, vocab] and hidden_states (per layer [L, hidden]): the prompt in one
    forward, then one token per forward with HF's KV cache (its incremental decoding)."""
    cache = DynamicCache()  # filled in place by each forward
    # Newer transformers call the argument `cache`, older ones `past_key_values`.
    params = inspect.signature(hf_model.forward).parameters
    cache_kwargs = {"cache" if "cache" in params else "past_key_values": cache}
    logits, hidden = [], []
    with torch.no_grad():
        for chunk in [tokens[:prompt_len]] + [[t] for t in tokens[prompt_len:]]:
            out = hf_model(
                torch.tensor([chunk]), use_cache=True, output_hidden_states=True, **cache_kwargs
            )
            logits.append(out.logits[0])
            hidden.append(out.hidden_states)
    per_layer = [torch.cat([h[i][0] for h in hidden]) for i in range(len(hidden[0]))]
    return torch.cat(logits), per_layer


# ------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_models_match_hf_on_paged_cache(case: str, tmp_path: Path) -> None:
    hf_model = save_tiny(case, tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device="cpu", attention="torch")
    cfg = model.config
    assert cfg.tie_word_embeddings == (model.lm_head.weight is model.embed_tokens.weight)

    rng = random.Random(1)
    prompt_lens = [9, 12, 1, 15]
    seq_lens = [14, 16, 8, 18]  # prompt + teacher-forced decode tokens
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in seq_lens]
    aux_ids = (2, 0, cfg.num_layers - 1)  # any order; the concatenation follows it
    ours = run_schedule(PagedDriver(model), seqs, prompt_lens, aux_ids)

    for tokens, p_len, (logits, aux) in zip(seqs, prompt_lens, ours, strict=True):
        ref_logits, ref_hidden = hf_reference(hf_model, tokens, p_len)
        assert ref_logits.std() > 0.3, "weights too small for the tolerance to mean much"
        torch.testing.assert_close(logits, ref_logits, atol=TOL, rtol=0)
        expected_aux = torch.cat([ref_hidden[i] for i in aux_ids], dim=-1)
        torch.testing.assert_close(aux, expected_aux, atol=TOL, rtol=0)


def test_aux_empty_is_none_and_bad_layer_ids_raise(tmp_path: Path) -> None:
    save_tiny("llama-tied", tmp_path)
    model = load_model(str(tmp_path))
    driver = PagedDriver(model)
    [(_, aux)] = driver.step([(0, [1, 2, 3])])
    assert aux is None
    with pytest.raises(ValueError, match=r"aux_layer_ids \[4\] must lie in \[0, 4\)"):
        driver.step([(1, [1, 2])], aux_ids=(4,))


def test_decode_step_compiles_as_one_graph(tmp_path: Path) -> None:
    """fullgraph=True fails on any host sync (.item(), .tolist()) or data-dependent branch
    in the model; the torch backend's decode path is itself sync-free."""
    save_tiny("qwen3", tmp_path)
    model = load_model(str(tmp_path))
    eager, compiled = PagedDriver(model), PagedDriver(model)
    prefill = [(0, [1, 2, 3, 4, 5]), (1, [6, 7])]
    eager.step(prefill)
    compiled.step(prefill)
    compiled.model = torch.compile(model, backend="eager", fullgraph=True)
    for token in (9, 10, 11):
        decode = [(0, [token]), (1, [token + 1])]
        for (want, want_aux), (got, got_aux) in zip(
            eager.step(decode, (1, 2)), compiled.step(decode, (1, 2)), strict=True
        ):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
            torch.testing.assert_close(got_aux, want_aux, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("case", "inner"),
    [("qwen3", "torch"), ("llama-tied", "triton")],
    ids=["qk-norm-rotates-in-compiled-code", "rope-fused-into-the-op"],
)
def test_compiled_regions_equal_eager_and_share_one_layer_compilation(
    tmp_path: Path, case: str, inner: str
) -> None:
    """What CUDA-graph capture runs (``compile_regions``, attention behind the custom op):
    the same outputs as eager across batch sizes, and every decoder layer served by the
    same compiled entries — a per-layer compilation would multiply cold start by the depth.
    Llama's q and k reach the op before RoPE when the backend fuses the rotation (Triton,
    here under the interpreter); Qwen3's are normed and rotated in the compiled code.
    """
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from specdec.attention.custom_op import OpaqueAttention
    from specdec.models.llama import DecoderLayer

    if inner == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1")
    save_tiny(case, tmp_path)
    model = load_model(str(tmp_path), attention=OpaqueAttention(inner))
    eager, compiled = PagedDriver(load_model(str(tmp_path))), PagedDriver(model)
    prefill = [(0, [1, 2, 3, 4, 5]), (1, [6, 7]), (2, [8, 9, 10])]
    eager.step(prefill)
    compiled.step(prefill)
    torch._dynamo.reset()
    model.compile_regions(backend="eager", fullgraph=True)  # fullgraph: no break in a region
    compiled.model = _CompiledCall(model)
    for step, batch in enumerate([[0, 1, 2], [0, 1], [0, 1, 2], [0], [0, 1]]):
        chunks = [(seq, [11 + step + seq]) for seq in batch]
        for (want, want_aux), (got, got_aux) in zip(
            eager.step(chunks, (1, 2)), compiled.step(chunks, (1, 2)), strict=True
        ):
            # The eager model runs the torch backend: Triton kernels sum in another order.
            atol = 1e-5 if inner == "torch" else 1e-4
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
            torch.testing.assert_close(got_aux, want_aux, atol=atol, rtol=0)
    # A first static shape, the dynamic one, batch 1, a changed context bound: <= 4
    # entries for all 4 layers (separate compilations would hold 4 per layer).
    entries = _debug_get_cache_entry_list(DecoderLayer.forward.__code__)
    assert 2 <= len(entries) <= 4, len(entries)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-regions"])
def test_triton_gemm_steps_equal_torch_linear(tmp_path: Path, monkeypatch, compiled: bool) -> None:
    """``use_triton_gemm``: steps of at most ``max_rows`` tokens run every projection on
    the skinny Triton GEMM, eagerly or as custom ops inside the compiled regions
    (fullgraph: no break): per layer the residual add + RMSNorm + qkv (with its bias), o,
    the add + RMSNorm + gate/up + SiLU, down; then the LM head. Logits and aux equal
    torch's. The prefill (more rows) keeps ``F.linear``."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1")
    from specdec.kernels import skinny_gemm
    from specdec.models.linear import use_triton_gemm

    launches: list[tuple[int, bool, bool]] = []  # (N, silu_mul, norm prologue)
    launch = skinny_gemm._launch

    def counted(x, weight, bias, n, silu_mul, config, norm=None):
        launches.append((n, silu_mul, norm is not None))
        return launch(x, weight, bias, n, silu_mul, config, norm)

    monkeypatch.setattr(skinny_gemm, "_launch", counted)
    save_tiny("qwen2", tmp_path)  # q/k/v biases, untied LM head
    model = load_model(str(tmp_path))
    assert use_triton_gemm(model, 4) == 4 * model.config.num_layers + 1
    reference, ours = PagedDriver(load_model(str(tmp_path))), PagedDriver(model)
    prefill = [(0, [1, 2, 3, 4, 5]), (1, [6, 7]), (2, [8, 9, 10])]
    for (want, _), (got, _) in zip(reference.step(prefill), ours.step(prefill), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert launches == []  # 10 rows > 4
    if compiled:
        torch._dynamo.reset()
        model.compile_regions(backend="eager", fullgraph=True)
        ours.model = _CompiledCall(model)
    for step, batch in enumerate([[0, 1, 2], [0, 1], [2]]):
        chunks = [(seq, [11 + step + seq]) for seq in batch]
        for (want, want_aux), (got, got_aux) in zip(
            reference.step(chunks, (1, 2)), ours.step(chunks, (1, 2)), strict=True
        ):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            torch.testing.assert_close(got_aux, want_aux, atol=1e-5, rtol=0)
    c = model.config
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layer = [(qkv, False, True), (c.hidden_size, False, False), (c.intermediate_size, True, True)]
    layer.append((c.hidden_size, False, False))
    step = layer * c.num_layers + [(c.vocab_size, False, False)]
    assert launches == step * 3


@dataclass
class _CompiledCall:
    """A ``CausalLM`` whose calls run its compiled regions (for ``PagedDriver``)."""

    model: CausalLM

    @property
    def config(self):
        return self.model.config

    def __call__(self, *args):
        return self.model(*args, compiled=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


# ---------------------------------------------------------------------- RoPE


# variant -> (max_position_embeddings, scaling). Anchored variants were trained on 32
# positions and extended to 128; dynamic NTK runs to 3 x 32.
_ROPE_VARIANTS: dict[str, tuple[int, dict | None]] = {
    "default": (32, None),
    "linear": (32, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": (32, {"rope_type": "dynamic", "factor": 3.0}),
    "llama3": (
        128,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "yarn": (128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "yarn-mscale": (
        128,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "truncate": False,
        },
    ),
    "longrope": (
        128,
        {
            "rope_type": "longrope",
            "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(16)],
            "long_factor": [1.0 + 0.7 * i for i in range(16)],
        },
    ),
}


@pytest.mark.parametrize("variant", list(_ROPE_VARIANTS))
def test_rope_table_matches_hf_per_position(variant: str) -> None:
    """Row p of our table equals HF's cos/sin for a forward whose last position is p
    (HF incremental decoding); for dynamic/longrope this crosses the trained length."""
    max_pos, scaling = _ROPE_VARIANTS[variant]
    hf_cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})},
    )
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    params = RopeParams(32, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling or {})
    table = rope_cos_sin(params, cfg.max_context_len)
    x = torch.zeros(1, 1, 32)
    last = cfg.max_context_len - 1
    for pos in sorted({0, 1, 17, 31, 32, 33, 50, last} & set(range(last + 1))):
        cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, torch.tensor([[pos]]))  # fresh: no state
        ours_cos, ours_sin = table[pos].chunk(2)
        torch.testing.assert_close(ours_cos, cos[0, 0, :16], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours_sin, sin[0, 0, :16], atol=1e-6, rtol=1e-6)
        assert torch.equal(cos[0, 0, :16], cos[0, 0, 16:])  # HF's half layout


def test_dynamic_context_is_factor_times_trained() -> None:
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 100,
        "rope_scaling": {"type": "dynamic", "factor": 2.5},
    }
    assert ModelConfig.from_hf(hf).max_context_len == 250
    hf["rope_scaling"] = {"type": "linear", "factor": 2.5}
    assert ModelConfig.from_hf(hf).max_context_len == 100


# ------------------------------------------------------------------- config


def _hf_dict(**overrides) -> dict:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "eos_token_id": [7, 8],
        "bos_token_id": 1,
    }
    return {**base, **overrides}


def test_config_reads_old_and_new_rope_keys_alike() -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    old = _hf_dict(
        rope_theta=500000.0,
        rope_scaling={"type": "llama3", "original_max_position_embeddings": 1024, **scaling},
    )
    new = _hf_dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "original_max_position_embeddings": 1024,
            **scaling,
        }
    )
    a, b = ModelConfig.from_hf(old), ModelConfig.from_hf(new)
    assert a == b
    assert a.rope_theta == 500000.0
    assert a.rope_scaling == {
        "rope_type": "llama3",
        "original_max_position_embeddings": 1024,
        **scaling,
    }
    assert a.head_dim == 16 and a.eos_token_ids == [7, 8] and a.bos_token_id == 1
    plain = ModelConfig.from_hf(_hf_dict(rope_theta=1e5, eos_token_id=2))
    assert plain.rope_scaling is None and plain.rope_theta == 1e5 and plain.eos_token_ids == [2]


def test_config_family_flags() -> None:
    qwen2 = ModelConfig.from_hf(_hf_dict(architectures=["Qwen2ForCausalLM"]))
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = ModelConfig.from_hf(_hf_dict(architectures=["Qwen3ForCausalLM"], head_dim=128))
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 128)
    llama = ModelConfig.from_hf(_hf_dict(attention_bias=True))
    assert (llama.attention_bias, llama.o_proj_bias) == (True, True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(architectures=["GPT2LMHeadModel"]),
            r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen2ForCausalLM"
            r".*Qwen3ForCausalLM",
        ),
        (dict(num_key_value_heads=3), "num_heads=4 is not a multiple of num_kv_heads=3"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(use_sliding_window=True), "sliding-window attention layers are not supported"),
        (dict(rope_scaling={"type": "su", "factor": 2.0}), "unsupported RoPE scaling type 'su'"),
        (dict(rope_scaling={"type": "linear"}), r"RoPE scaling 'linear' needs keys \['factor'\]"),
    ],
)
def test_config_errors_name_the_value(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(_hf_dict(**overrides))


# ------------------------------------------------------------------- loading


def test_weight_errors_name_the_key(tmp_path: Path) -> None:
    save_tiny("qwen2", tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)

    bad = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    save_file(bad, weights, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"missing .*model\.layers\.1\.self_attn\.k_proj"):
        load_model(str(tmp_path))

    extra = {**tensors, "model.layers.9.mlp.up_proj.weight": torch.zeros(96, 64)}
    save_file(extra, weights, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"unexpected .*model\.layers\.9\.mlp\.up_proj"):
        load_model(str(tmp_path))

    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(
        WeightLoadError,
        match=r"model\.layers\.0\.mlp\.gate_proj\.weight .*"
        r"shape \(96, 64\).*expects \(80, 64\)",
    ):
        load_model(str(tmp_path))


def test_model_errors_name_the_spec_and_the_fixes(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ModelNotFoundError, match=r"'no-such-model'.*smollm2-135m-instruct"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFoundError, match=r"'/nonexistent/x\.gguf' does not exist"):
        resolve_model("/nonexistent/x.gguf")
    with pytest.raises(ModelNotFoundError, match=r"'\./missing/dir' does not exist"):
        resolve_model("./missing/dir")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNotFoundError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ModelNotFoundError,
        match=r"hub model 'specdec-test/no-such-model' is not in the local Hugging Face cache"
        r".*local HF directory, a \.gguf file, or an alias \(smollm2-135m-instruct",
    ):
        resolve_model("specdec-test/no-such-model")


# ------------------------------------------------------------------- SmolLM2


def test_smollm2_alias_is_cached(smollm2_dir: Path, monkeypatch) -> None:
    def no_conversion(src: Path, out: Path) -> None:
        raise AssertionError(f"second resolve converted {src} again")

    monkeypatch.setattr(gguf_module, "convert_gguf", no_conversion)
    resolved = resolve_model("smollm2-135m-instruct")
    assert resolved.hf_dir == smollm2_dir and resolved.source == "alias"
    assert ALIASES["smollm2-135m-instruct"].locate().is_file()


def test_smollm2_matches_hf(smollm2_dir: Path, smollm2_hf, smollm2_tokenizer) -> None:
    model = load_model(resolve_model("smollm2-135m-instruct"))
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2] and cfg.rope_theta == 1e5

    chat = [{"role": "user", "content": "Name three primary colors."}]
    prompt = list(
        smollm2_tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    )
    aux_ids = (2, cfg.num_layers // 2, cfg.num_layers - 3)
    driver = PagedDriver(model, num_blocks=32)
    [(logits, aux)] = driver.step([(0, prompt)], aux_ids)
    tokens = list(prompt)
    step_logits = [logits]
    for _ in range(3):  # greedy decode on our own logits
        tokens.append(int(step_logits[-1][-1].argmax()))
        [(lg, _)] = driver.step([(0, tokens[-1:])])
        step_logits.append(lg)

    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([tokens]), output_hidden_states=True)
    torch.testing.assert_close(torch.cat(step_logits), ref.logits[0], atol=TOL, rtol=0)
    # The residual stream reaches ~2.5e4 in places and float32 rounding at that size spills
    # into the whole row through the norms: compare each layer relative to its largest value.
    for j, i in enumerate(aux_ids):
        expected = ref.hidden_states[i][0, : len(prompt)]
        scale = expected.abs().max()
        got = aux[:, j * cfg.hidden_size : (j + 1) * cfg.hidden_size]
        torch.testing.assert_close(got / scale, expected / scale, atol=1e-6, rtol=0)
