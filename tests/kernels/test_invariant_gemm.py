"""Deterministic mode's kernels outside attention: each equals its PyTorch reference, and
a row's output bits do not depend on the rows around it (``torch.equal``), from one row
to hundreds, at any position in the batch. Then a tiny model: a token's final hidden
state and logits are the same bits whether it is computed alone as a decode token, as
part of a chunked prompt in a crowded step, or as a verified draft token.

Runs on CUDA when present, else on CPU under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported). The interpreter runs each tile through
numpy, so there these check the kernels' tiling and reduction structure, and the compiled
kernels' bits where the same tests run on a GPU. The interpreter's bf16 ``tl.dot`` returns
garbage (as for the attention kernels, whose bf16 tests are GPU-only): the bf16 GEMM cases
run on the GPU only; the bf16 norms run everywhere."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from itertools import accumulate

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from specdec.attention.base import AttentionBackend
from specdec.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from specdec.kernels.skinny_gemm import (
    DECODE_ROWS,
    MEASURED_TILES,
    SMALL_ROWS,
    TILES_ENV,
    GemmConfig,
    GemmTiles,
    add_rmsnorm_gate_up_silu,
    add_rmsnorm_gate_up_silu_ref,
    add_rmsnorm_linear,
    add_rmsnorm_linear_ref,
    choose_gemm_config,
    gate_up_silu,
    gate_up_silu_ref,
    gemm_tiles,
    skinny_linear,
    skinny_linear_ref,
)
from specdec.models.config import ModelConfig
from specdec.models.invariant import use_invariant_kernels
from specdec.models.linear import Linear
from specdec.models.llama import CausalLM
from specdec.ops.attention_metadata import AttentionMetadata
from specdec.ops.paged_attention import gather_context, store_kvcache_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
# Batches the probe row is placed in: a few rows, a row tile and one past it, four tiles,
# a prefill's worth (19 tiles).
ROW_COUNTS = (3, 17, 64, 300)
N, K = 40, 200  # off the tile sizes: a partial column tile and a partial K tile
EPS = 1e-5

Op = Callable[..., tuple[torch.Tensor, ...]]  # row-aligned inputs -> row-aligned outputs


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def batch_variance(
    op: Op,
    widths: tuple[int, ...],
    dtype: torch.dtype,
    counts: tuple[int, ...] = ROW_COUNTS,
    positions: tuple[int, ...] | None = None,
) -> list[tuple[int, int]]:
    """The ``(rows, position)`` batches in which a probe row's outputs differ from its
    outputs computed alone. ``widths``: the last dim of each of ``op``'s row-aligned
    inputs; other rows are random, different for every batch. ``positions``: where the
    probe sits (default: first, middle and last)."""
    probe = [_randn(1, w, seed=100 + i, dtype=dtype) for i, w in enumerate(widths)]
    alone = op(*probe)
    differing = []
    for m in counts:
        for pos in positions or sorted({0, m // 2, m - 1}):
            fill = [_randn(m, w, seed=m * 7 + pos + i, dtype=dtype) for i, w in enumerate(widths)]
            batch = [
                torch.cat([f[:pos], p, f[pos + 1 :]]) for f, p in zip(fill, probe, strict=True)
            ]
            outs = op(*batch)
            if not all(torch.equal(o[pos : pos + 1], a) for o, a in zip(outs, alone, strict=True)):
                differing.append((m, pos))
    return differing


def _weights(dtype: torch.dtype, rows: int = N) -> dict[str, torch.Tensor]:
    return {
        "w": (_randn(rows, K, seed=1) / K**0.5).to(dtype),
        "bias": _randn(rows, seed=2, dtype=dtype),
        "norm": (torch.rand(K, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE, dtype),
    }


def _ops(dtype: torch.dtype) -> dict[str, tuple[Op, tuple[int, ...]]]:
    """Each kernel the mode runs, as a row-aligned op, and its inputs' widths."""
    p = _weights(dtype)
    gu = _weights(dtype, 2 * N)["w"]
    return {
        "linear": (lambda x: (skinny_linear(x, p["w"], p["bias"]),), (K,)),
        "gate_up_silu": (lambda x: (gate_up_silu(x, gu),), (K,)),
        "add_rmsnorm_linear": (
            lambda x, r: add_rmsnorm_linear(x, r, p["norm"], EPS, p["w"], p["bias"]),
            (K, K),
        ),
        "add_rmsnorm_gate_up_silu": (
            lambda x, r: add_rmsnorm_gate_up_silu(x, r, p["norm"], EPS, gu),
            (K, K),
        ),
        "rmsnorm": (lambda x: (rmsnorm(x, p["norm"], EPS),), (K,)),
        "add_rmsnorm": (lambda x, r: add_rmsnorm(x, r, p["norm"], EPS), (K, K)),
    }


def _refs(dtype: torch.dtype) -> dict[str, Op]:
    p = _weights(dtype)
    gu = _weights(dtype, 2 * N)["w"]
    return {
        "linear": lambda x: (skinny_linear_ref(x, p["w"], p["bias"]),),
        "gate_up_silu": lambda x: (gate_up_silu_ref(x, gu),),
        "add_rmsnorm_linear": lambda x, r: add_rmsnorm_linear_ref(
            x, r, p["norm"], EPS, p["w"], p["bias"]
        ),
        "add_rmsnorm_gate_up_silu": lambda x, r: add_rmsnorm_gate_up_silu_ref(
            x, r, p["norm"], EPS, gu
        ),
        "rmsnorm": lambda x: (rmsnorm_ref(x, p["norm"], EPS),),
        "add_rmsnorm": lambda x, r: add_rmsnorm_ref(x, r, p["norm"], EPS),
    }


KERNELS = list(_refs(torch.float32))
_DOT_FREE = {"rmsnorm", "add_rmsnorm"}


def _skip_interpreted_bf16_dot(name: str, dtype: torch.dtype) -> None:
    if DEVICE.type == "cpu" and dtype == torch.bfloat16 and name not in _DOT_FREE:
        pytest.skip("the Triton interpreter's bf16 tl.dot is wrong; bf16 GEMMs run on the GPU")


# ------------------------------------------------------------------ values


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", KERNELS)
def test_kernel_equals_its_reference_at_prefill_row_counts(name: str, dtype: torch.dtype) -> None:
    """300 rows (19 row tiles), past the few rows the skinny GEMM was written for. bf16:
    within bf16's rounding (the kernels sum in float32 in their own order)."""
    _skip_interpreted_bf16_dot(name, dtype)
    op, widths = _ops(dtype)[name]
    inputs = [_randn(300, w, seed=10 + i, dtype=dtype) for i, w in enumerate(widths)]
    got, want = op(*inputs), _refs(dtype)[name](*inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)


def test_rmsnorm_takes_any_leading_dims_and_strided_rows() -> None:
    """Qwen3's per-head norms: [tokens, heads, head_dim] views into the qkv projection
    (rows not evenly strided: copied, bit-exact)."""
    qkv = _randn(5, 3 * 24, seed=4)
    q = qkv[:, : 2 * 24].view(5, 2, 24)
    w = torch.rand(24, generator=torch.Generator().manual_seed(5)).to(DEVICE) + 0.5
    torch.testing.assert_close(rmsnorm(q, w, EPS), rmsnorm_ref(q, w, EPS), atol=1e-6, rtol=1e-5)
    assert rmsnorm(q, w, EPS).shape == (5, 2, 24)
    out, stream = add_rmsnorm(q, q, w, EPS)
    assert torch.equal(stream, q + q) and out.shape == q.shape


# ------------------------------------------------------------------ invariance


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", KERNELS)
def test_a_rows_bits_do_not_depend_on_the_batch(name: str, dtype: torch.dtype) -> None:
    _skip_interpreted_bf16_dot(name, dtype)
    op, widths = _ops(dtype)[name]
    assert batch_variance(op, widths, dtype) == []


MEASURED = sorted(
    {t for ts in MEASURED_TILES.values() for t in (ts.decode, ts.batch, ts.prefill) if t},
    key=repr,
)


@pytest.mark.parametrize("tile", MEASURED, ids=repr)
def test_every_measured_tile_keeps_rows_batch_invariant(tile) -> None:
    """The measured tiles (64-row tiles among them, where a probe row shares its tile with
    up to 63 others) on a small weight, with and without the norm prologue."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    p = _weights(dtype)
    ops = [
        (lambda x: (skinny_linear(x, p["w"], p["bias"], tile),), (K,)),
        (lambda x, r: add_rmsnorm_linear(x, r, p["norm"], EPS, p["w"], None, tile), (K, K)),
    ]
    for op, widths in ops:
        assert batch_variance(op, widths, dtype, counts=(3, 70)) == []


def test_a_rows_bits_survive_the_switch_between_tiers(tmp_path, monkeypatch) -> None:
    """Launches above SMALL_ROWS rows run the batch tile, above DECODE_ROWS the prefill
    tile, each another row and column tile with the same BLOCK_K: a probe row's bits in a
    40-, 70- or 300-row launch equal its bits alone."""
    from specdec.kernels import skinny_gemm as sg

    decode = GemmConfig(block_m=16, block_n=16, block_k=64, num_warps=2)
    batch = GemmConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=1)
    prefill = GemmConfig(block_m=64, block_n=32, block_k=64, num_warps=4)
    path = tmp_path / "tiles.json"
    tiers = {"decode": vars(decode), "batch": vars(batch), "prefill": vars(prefill)}
    path.write_text(json.dumps({f"{N},{K}": tiers}))
    monkeypatch.setenv(TILES_ENV, str(path))
    sg._measured_tiles.cache_clear()
    assert gemm_tiles(N, K) == GemmTiles(decode, prefill, batch)
    assert [choose_gemm_config(m, N, K) for m in (1, SMALL_ROWS, SMALL_ROWS + 1)] == [
        decode,
        decode,
        batch,
    ]
    assert choose_gemm_config(DECODE_ROWS, N, K) == batch
    assert choose_gemm_config(DECODE_ROWS + 1, N, K) == prefill
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    p = _weights(dtype)
    ops = [
        (lambda x: (skinny_linear(x, p["w"], p["bias"]),), (K,)),
        (lambda x, r: add_rmsnorm_linear(x, r, p["norm"], EPS, p["w"]), (K, K)),
    ]
    for op, widths in ops:
        assert batch_variance(op, widths, dtype, counts=(3, 40, 70, 300)) == []
    sg._measured_tiles.cache_clear()


def test_a_tiles_file_naming_some_tiers_keeps_the_others(tmp_path, monkeypatch) -> None:
    """A tuning file that gives a measured shape only a batch tile keeps its measured
    decode and prefill tiles; a shape without a batch tile runs its decode tile there."""
    from specdec.kernels import skinny_gemm as sg

    (n, k), measured = next((nk, t) for nk, t in MEASURED_TILES.items() if t.batch is None)
    assert choose_gemm_config(DECODE_ROWS, n, k) == measured.decode
    batch = GemmConfig(block_m=64, block_n=128, block_k=measured.decode.block_k, num_warps=8)
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({f"{n},{k}": {"batch": vars(batch)}}))
    monkeypatch.setenv(TILES_ENV, str(path))
    sg._measured_tiles.cache_clear()
    assert gemm_tiles(n, k) == GemmTiles(measured.decode, measured.prefill, batch)
    bad = GemmConfig(block_m=64, block_k=measured.decode.block_k // 2)
    path.write_text(json.dumps({f"{n},{k}": {"batch": vars(bad)}}))
    sg._measured_tiles.cache_clear()
    with pytest.raises(ValueError, match="and batch tile block_k="):
        gemm_tiles(n, k)
    sg._measured_tiles.cache_clear()


def test_tiles_of_one_shape_share_block_k() -> None:
    """A decode and a prefill tile with different BLOCK_K would sum a row's products in
    another grouping above DECODE_ROWS rows: refused, naming both."""
    with pytest.raises(ValueError, match="block_k=128 and prefill tile block_k=64"):
        GemmTiles(GemmConfig(block_k=128), GemmConfig(block_k=64))
    for (n, k), tiles in MEASURED_TILES.items():
        rows = (1, SMALL_ROWS + 1, 64, 65, 8192)
        assert {choose_gemm_config(m, n, k).block_k for m in rows} == {tiles.decode.block_k}


def test_lm_head_sized_outputs_are_batch_invariant() -> None:
    """SmolLM2's 49,152-column LM head takes the wide column tile; the tile's BLOCK_K is
    chosen from the weight's shape alone, whatever the rows."""
    n, k = 49152, 64
    assert len({choose_gemm_config(m, n, k).block_k for m in (1, 17, 300, 8192)}) == 1
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    w = (_randn(n, k, seed=6) / k**0.5).to(dtype)
    op = lambda x: (skinny_linear(x, w),)  # noqa: E731
    # 768 column tiles a row tile: one batch (the probe mid-tile among 16 other rows).
    assert batch_variance(op, (k,), dtype, counts=(17,), positions=(9,)) == []


def test_the_check_catches_torch_matmul_where_it_varies() -> None:
    """Negative control: torch's float32 ``F.linear`` picks its kernel (and summation
    order) by the number of rows on common CPU BLAS builds and on cuBLAS, so the same
    check finds rows that differ."""
    w = _randn(N, K, seed=1) / K**0.5
    found = batch_variance(lambda x: (F.linear(x, w),), (K,), torch.float32)
    if not found:
        pytest.skip(f"torch's float32 matmul on this {DEVICE.type} build is row-invariant here")
    assert len(found) >= 2


def test_the_check_catches_a_reduction_split_by_the_row_count() -> None:
    """Negative control that holds on every build: a product whose K reduction is split
    into more partial sums when more rows share the launch (split-K picked from M)."""
    w = _randn(N, K, seed=1) / K**0.5

    def split_by_rows(x: torch.Tensor) -> tuple[torch.Tensor]:
        splits = 1 if x.shape[0] < 16 else 4
        parts = [
            F.linear(xc, wc) for xc, wc in zip(x.chunk(splits, 1), w.chunk(splits, 1), strict=True)
        ]
        return (torch.stack(parts).sum(0),)

    assert batch_variance(split_by_rows, (K,), torch.float32) != []


# ------------------------------------------------------------------ a model


class RowByRowAttention(AttentionBackend):
    """The attention rule computed one query row at a time, each over exactly its
    context (the cache's keys up to its position): the same shapes and the same inputs
    for a token whatever the step around it, so invariant by construction. It stands in
    for the batch-invariant attention backend, so that the model test covers everything
    else on the path. Causal only (no trees)."""

    name = ""  # a test fixture, not registered

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        group = q.shape[1] // k_cache.shape[2]
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for s, seq_len in enumerate(meta.seq_lens.tolist()):
            n = starts[s + 1] - starts[s]
            keys = gather_context(k_cache, meta.block_tables[s], seq_len).float()
            vals = gather_context(v_cache, meta.block_tables[s], seq_len).float()
            for i in range(n):
                ctx = seq_len - n + i + 1
                kk = keys[:ctx].repeat_interleave(group, 1).transpose(0, 1)  # [H, ctx, d]
                vv = vals[:ctx].repeat_interleave(group, 1).transpose(0, 1)
                row = q[starts[s] + i].float()[:, None, :]  # [H, 1, d]
                att = torch.softmax((row @ kk.transpose(1, 2)) * scale, dim=-1)  # [H, 1, ctx]
                out[starts[s] + i] = (att @ vv)[:, 0].to(q.dtype)
        return out


BLOCK = 4


class Driver:
    """Steps of ``(sequence, new tokens)`` chunks over a paged cache (scattered blocks)."""

    def __init__(self, model: CausalLM, dtype: torch.dtype) -> None:
        c = model.config
        shape = (64, BLOCK, c.num_kv_heads, c.head_dim)
        self.model = model
        self.kv = [
            (
                torch.zeros(shape, dtype=dtype, device=DEVICE),
                torch.zeros(shape, dtype=dtype, device=DEVICE),
            )
            for _ in range(c.num_layers)
        ]
        self.free = list(range(63, 0, -1))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> dict[tuple[int, int], torch.Tensor]:
        """-> (sequence, position) -> that token's [hidden + vocab] row (hidden, logits)."""
        ids, positions, slots, q_lens, seq_lens, keys = [], [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK < start + len(tokens):
                table.append(self.free.pop())
            for pos in range(start, start + len(tokens)):
                slots.append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
                keys.append((seq, pos))
            ids += tokens
            positions += range(start, start + len(tokens))
            q_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            self.lens[seq] = start + len(tokens)
        width = max(len(self.tables[s]) for s, _ in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _ in chunks]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=DEVICE),
            query_start_loc=torch.tensor(
                [0, *accumulate(q_lens)], dtype=torch.int32, device=DEVICE
            ),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )
        with torch.inference_mode():
            hidden, _ = self.model(
                torch.tensor(ids, device=DEVICE),
                torch.tensor(positions, device=DEVICE),
                self.kv,
                meta,
            )
            logits = self.model.compute_logits(hidden)
        rows = torch.cat([hidden.float(), logits], dim=1)
        return dict(zip(keys, rows, strict=True))


def _tiny(arch: str, dtype: torch.dtype, invariant: bool) -> CausalLM:
    config = ModelConfig.from_hf(
        {
            "architectures": [arch],
            "vocab_size": 200,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 64,
            "rms_norm_eps": EPS,
            "tie_word_embeddings": arch == "LlamaForCausalLM",
            "attention_bias": True,
        }
    )
    torch.manual_seed(0)
    model = CausalLM(config, RowByRowAttention())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif p.ndim == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model = model.to(DEVICE, dtype).eval().requires_grad_(False)
    model.rotary.build_cache()  # the float32 table, rebuilt after the dtype cast
    if invariant:
        linears = 4 * config.num_layers + 1  # qkv, o, gate_up, down; the LM head
        norms = (4 if config.qk_norm else 2) * config.num_layers + 1  # (q, k,) in, post; final
        assert use_invariant_kernels(model) == linears + norms
    return model


TOKENS = [5, 17, 42, 8, 99, 23, 61, 3, 77, 150, 12, 64]  # the sequence under test (seq 0)
OTHERS = {1: [9, 31, 7, 120, 55, 2, 88, 14, 6], 2: [190, 4, 47, 33, 71, 26, 11, 58]}


def _schedules() -> dict[str, list[list[tuple[int, list[int]]]]]:
    """Three ways of computing seq 0's tokens: the same token in different steps."""
    t, o1, o2 = TOKENS, OTHERS[1], OTHERS[2]
    return {
        # The prompt in one step, then each later token decoded alone (1-row steps).
        "decode alone": [[(0, t[:9])], [(0, t[9:10])], [(0, t[10:11])], [(0, t[11:12])]],
        # The prompt in two chunks next to other prompts and decodes.
        "chunked in a crowd": [
            [(1, o1[:6]), (0, t[:5]), (2, o2[:7])],
            [(1, o1[6:9]), (2, o2[7:8]), (0, t[5:12])],
        ],
        # A short prompt, then the rest as verified drafts: chains of 4 and 3 rows in
        # steps with other sequences' prompts and drafts.
        "verified drafts": [
            [(0, t[:5]), (1, o1[:4])],
            [(2, o2[:6]), (0, t[5:9]), (1, o1[4:7])],
            [(1, o1[7:9]), (0, t[9:12]), (2, o2[6:8])],
        ],
    }


def _run(model: CausalLM, dtype: torch.dtype, schedule) -> dict[int, torch.Tensor]:
    driver, rows = Driver(model, dtype), {}
    for chunks in schedule:
        rows.update(driver.step(chunks))
    return {pos: row for (seq, pos), row in rows.items() if seq == 0}


# The interpreter's bf16 tl.dot is wrong (module docstring): bf16 models on the GPU only.
MODEL_DTYPES = [torch.bfloat16, torch.float32] if DEVICE.type == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", MODEL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"], ids=["llama", "qwen3"])
def test_a_tokens_logits_do_not_depend_on_its_step(arch: str, dtype: torch.dtype) -> None:
    """Every projection and norm on the invariant kernels (Qwen3: q/k norms and biases
    too), attention through ``RowByRowAttention``: each of seq 0's tokens has the same
    final hidden state and logits, bit for bit, under all three schedules."""
    model = _tiny(arch, dtype, invariant=True)
    runs = {name: _run(model, dtype, s) for name, s in _schedules().items()}
    first = runs.pop("decode alone")
    assert sorted(first) == list(range(len(TOKENS)))
    for name, rows in runs.items():
        differing = [p for p in first if not torch.equal(rows[p], first[p])]
        assert differing == [], f"{name}: positions {differing} differ from decoding alone"


def test_the_model_check_catches_torch_kernels_where_they_vary() -> None:
    """Negative control: the same model and schedules on torch's float32 kernels (cuBLAS
    or CPU BLAS F.linear, torch's RMSNorm) give some token different bits, where the
    build's matmul varies with the row count (``test_the_check_catches_torch_matmul``)."""
    model = _tiny("LlamaForCausalLM", torch.float32, invariant=False)
    runs = [_run(model, torch.float32, s) for s in _schedules().values()]
    differing = [p for p in runs[0] for r in runs[1:] if not torch.equal(r[p], runs[0][p])]
    if not differing:
        pytest.skip(f"torch's float32 kernels on this {DEVICE.type} build are row-invariant here")
    assert differing


# ------------------------------------------------------------------ refusals


def test_invariant_linear_refuses_what_it_cannot_take_instead_of_falling_back() -> None:
    lin = Linear(8, 4).to(DEVICE)
    lin.invariant = True
    x = _randn(3, 8, seed=7)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=1e-5)
    with pytest.raises(
        ValueError, match=r"takes \[rows, 8\] torch.float32 inputs.*got \(2, 3, 8\)"
    ):
        lin(_randn(2, 3, 8, seed=8))
    with pytest.raises(ValueError, match=r"got \(3, 8\) torch.bfloat16"):
        lin(x.bfloat16())


def test_switching_refuses_modules_without_an_invariant_kernel() -> None:
    model = torch.nn.Sequential(Linear(8, 8), torch.nn.LayerNorm(8))
    with pytest.raises(
        ValueError, match=r"'1' \(LayerNorm\) holds weights but has no batch-invariant"
    ):
        use_invariant_kernels(model)
    assert not model[0].invariant  # nothing switched
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"\(Linear\) holds weights"):
        use_invariant_kernels(plain)
    half = torch.nn.Sequential(Linear(8, 8)).to(torch.float64)
    with pytest.raises(ValueError, match=r"0.weight is torch.float64.*dtype=bfloat16"):
        use_invariant_kernels(half)


def test_an_invariant_model_refuses_compiled_regions() -> None:
    model = _tiny("LlamaForCausalLM", torch.float32, invariant=True)
    with pytest.raises(ValueError, match=r"uncompiled \(EngineConfig.compile unset or False\)"):
        model.compile_regions(backend="eager")


def test_the_runtime_refuses_deterministic_mode_where_it_cannot_hold(monkeypatch) -> None:
    """Resolved with the device: the invariant attention backend must be registered (no
    substitute), and the Triton kernels need CUDA or the interpreter. Where both hold,
    the target's layers stay uncompiled and the draft side may compile, on the attention
    backend the mode would take without invariance."""
    from specdec.config import INVARIANT_ATTENTION, EngineConfig
    from specdec.engine import runtime

    config = EngineConfig(deterministic=True, device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels can run on this device
    monkeypatch.setattr(runtime, "available_backends", lambda: ["torch", "triton"])
    with pytest.raises(ValueError, match=r"'triton_invariant', which is not registered"):
        runtime.choose_runtime(config)
    monkeypatch.setattr(runtime, "available_backends", lambda: ["torch", INVARIANT_ATTENTION])
    choice = runtime.choose_runtime(config)
    assert (choice.attention_backend, choice.deterministic) == (INVARIANT_ATTENTION, True)
    assert not choice.compile_target
    assert choice.draft_attention_backend == "torch"  # the draft keeps the fast backend
    assert runtime.choose_runtime(EngineConfig(device="cpu")).draft_attention_backend == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"need a CUDA device; device='cpu': use device='cuda'"):
        runtime.choose_runtime(config)


def test_the_drafts_fast_attention_is_warmed_up_where_the_target_runs_invariant_kernels():
    """The warm-up compiles the fast Triton backend's variants before serving for whichever
    side launches them: the target in the default mode, and in deterministic mode the draft
    model alone (its drafts decide no token, so it keeps that backend), only when a
    proposer's drafts attend. Without it a deterministic engine compiled them inside its
    first speculative steps."""
    from types import SimpleNamespace

    from specdec.config import INVARIANT_ATTENTION
    from specdec.engine.model_runner import ModelRunner
    from specdec.engine.runtime import RuntimeChoice
    from specdec.spec.block_proposer import BlockProposer
    from specdec.spec.draft_model import DraftModelProposer
    from specdec.spec.eagle3 import Eagle3Proposer
    from specdec.spec.ngram_proposer import NgramProposer

    cuda = torch.device("cuda")  # the check reads the device type only; nothing launches

    def runner(device: torch.device, backend: str, draft: str | None) -> SimpleNamespace:
        runtime = RuntimeChoice(device, torch.bfloat16, backend, True, draft_attention=draft)
        return SimpleNamespace(device=device, runtime=runtime)

    warms = ModelRunner.warms_up_kernels
    default = runner(cuda, "triton", None)
    deterministic = runner(cuda, INVARIANT_ATTENTION, "triton")
    assert warms(default) and warms(default, draft=True)
    assert not warms(deterministic) and warms(deterministic, draft=True)
    assert not warms(runner(torch.device("cpu"), "torch", None), draft=True)
    assert Eagle3Proposer.uses_draft_attention and DraftModelProposer.uses_draft_attention
    # n-gram drafts attend nowhere; a block drafter launches its own block kernel.
    assert not NgramProposer.uses_draft_attention and not BlockProposer.uses_draft_attention


# ------------------------------------------------------------------ the engine


@pytest.mark.parametrize("attention", ["row_by_row", "triton_invariant"])
def test_deterministic_engine_runs_the_target_on_invariant_kernels(
    smollm2_dir, tmp_path, monkeypatch, attention: str
) -> None:
    """The mode switch, config -> runner -> modules, with the batch-invariant attention
    backend and with ``RowByRowAttention`` standing in for it (registered under its name
    for this test only): every target projection and norm is switched, the target is not
    compiled, and n-gram speculation (verify steps of 4 rows) and an EAGLE-3 head (a
    dynamic tree) give plain decoding's tokens. The head drafts on the backend the mode
    would take without invariance, since only the target's logits decide the output. What
    the mode guarantees bit for bit is checked per token above; the engine-level check
    that speculative bf16 output equals plain needs the GPU."""
    from tiny_models import make_tiny_model_dir

    from specdec.attention import base, get_attention_backend
    from specdec.config import INVARIANT_ATTENTION, SpeculativeConfig
    from specdec.engine.llm import LLM
    from specdec.models import load_config
    from specdec.models.eagle3_formats import save_eagle3
    from specdec.models.eagle3_head import Eagle3Config, Eagle3Head
    from specdec.models.llama import RMSNorm
    from specdec.sampling_params import SamplingParams

    base.available_backends()  # registers the real backend first, so the stand-in replaces it
    if attention == "row_by_row":
        monkeypatch.setitem(base._BACKENDS, INVARIANT_ATTENTION, RowByRowAttention)
    model_dir = make_tiny_model_dir(tmp_path, smollm2_dir, seed=3, vocab_size=256)
    kwargs = dict(device=DEVICE.type, dtype="float32", kv_cache_memory=16 << 20)
    kwargs.update(max_model_len=128, deterministic=True, enforce_eager=True)
    torch.manual_seed(0)
    head = Eagle3Head(
        Eagle3Config.for_target(load_config(str(model_dir)), 128, aux_layer_ids=(0, 1, 1)),
        get_attention_backend("torch"),
    )
    save_eagle3(head, tmp_path / "head")
    plain = LLM(str(model_dir), **kwargs)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1)
    tree = {"tree": "dynamic", "num_speculative_tokens": 3, "top_k": 2, "total_tokens": 6}
    eagle3 = SpeculativeConfig(method="eagle3", model=str(tmp_path / "head"), **tree)
    specs = [LLM(str(model_dir), speculative=s, **kwargs) for s in (ngram, eagle3)]
    for llm in (plain, *specs):
        runner = llm.engine.runner
        assert runner.runtime.attention_backend == INVARIANT_ATTENTION
        assert type(runner.attention) is base._BACKENDS[INVARIANT_ATTENTION]
        assert type(runner.draft_attention) is base._BACKENDS["torch"]  # the draft's
        assert not runner.use_compile
        switched = [m for m in runner.model.modules() if isinstance(m, Linear | RMSNorm)]
        assert len(switched) == 6 * runner.model_config.num_layers + 2  # 4 Linear, 2 norms a layer
        assert all(m.invariant for m in switched)
    assert specs[1].engine.proposer.head.attention is specs[1].engine.runner.draft_attention
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [40, 41, 40, 41, 40, 41, 40, 2, 3, 4]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for spec in specs:
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert spec.engine.spec_stats.steps > 0  # verify steps really ran
    assert specs[0].engine.spec_stats.accepted_tokens > 0


def test_kernel_norms_run_the_kernel_uncompiled_and_torch_ops_where_traced(monkeypatch) -> None:
    """``use_kernel_norms`` (the engine's prefill steps on the Triton path): every RMSNorm
    of the model runs the one-launch kernel when called eagerly, norm and residual add
    alike, and the torch ops when ``torch.compile`` traces it (which fuses them itself)."""
    from specdec.models.llama import RMSNorm, use_kernel_norms

    model = _tiny("LlamaForCausalLM", torch.float32, invariant=False)
    assert use_kernel_norms(model) == 2 * model.config.num_layers + 1
    norm = model.layers[0].post_attention_layernorm
    assert isinstance(norm, RMSNorm) and norm.eager_kernel
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(7, norm.weight.shape[0], generator=g).to(DEVICE) * 3 for _ in range(2))
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
        eager, eager_stream = norm.add_forward(x, r)
        kernel, kernel_stream = add_rmsnorm(x, r, norm.weight, norm.eps)
        assert torch.equal(eager, kernel) and torch.equal(eager_stream, kernel_stream)
        assert torch.equal(norm(x), rmsnorm(x, norm.weight, norm.eps))
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        traced, traced_stream = norm.add_forward(x, r)
        ref, ref_stream = add_rmsnorm_ref(x, r, norm.weight, norm.eps)
        assert torch.equal(traced, ref) and torch.equal(traced_stream, ref_stream)
        assert torch.equal(norm(x), rmsnorm_ref(x, norm.weight, norm.eps))
