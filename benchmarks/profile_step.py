"""Where an engine step's time goes: host wall time per phase of ``LLMEngine.step``.

Each phase (propose, prepare, execute, verify/sample, observe) is wrapped with a timer that
synchronises the device before and after, so a phase's figure is its own host work plus
the device work it launched. Synchronising changes the overlap the real loop has, so the
sum is an upper bound of a step; the split is what matters. Greedy decoding of
``--batch`` chat prompts, ``--max-tokens`` each, after one warm-up generation; medians per
step over the timed generation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from prompts import varied_conversations

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig


def random_head(model: str) -> str:
    from specdec.attention import get_attention_backend
    from specdec.models import load_config, resolve_model
    from specdec.models.eagle3_formats import save_eagle3
    from specdec.models.eagle3_head import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    config = Eagle3Config.for_target(load_config(resolve_model(model)), 4096)
    head = Eagle3Head(config, get_attention_backend("torch"))
    out = tempfile.mkdtemp(prefix="random_head_")
    save_eagle3(head, out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--spec", default="none", help="none | eagle3-k3 | eagle3-tree | ngram-k3")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args()
    specs = {
        "none": None,
        "ngram-k3": {"method": "ngram", "num_speculative_tokens": 3},
        "eagle3-k3": {"method": "eagle3", "num_speculative_tokens": 3},
        "eagle3-tree": {
            "method": "eagle3",
            "tree": "dynamic",
            "num_speculative_tokens": 5,
            "top_k": 8,
            "total_tokens": 64,
        },
    }
    spec = specs[a.spec]
    if spec is not None and spec["method"] == "eagle3":
        spec = {**spec, "model": random_head(a.model)}
    llm = LLM(
        a.model,
        speculative=SpeculativeConfig(**spec) if spec else None,
        max_model_len=2048,
        max_num_seqs=max(a.batch, 1),
        cuda_graph_max_batch_size=max(a.batch, 1),
        kv_cache_memory=2 << 30,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    tok = engine.tokenizer
    prompts = [
        list(tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"])
        for c in varied_conversations(a.batch)
    ]
    times: dict[str, list[float]] = defaultdict(list)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            times[name].append(time.perf_counter() - t0)
            return out

        return wrapper

    for obj, name in [
        (engine, "_propose"),
        (engine.runner, "prepare"),
        (engine.runner, "execute"),
        (engine, "_verify"),
        (engine, "_sample"),
        (engine, "_observe"),
        (engine.runner, "move_kv"),
        (engine.scheduler, "schedule"),
    ]:
        setattr(obj, name, timed(name, getattr(obj, name)))
    engine.step = timed("step (total)", engine.step)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    times.clear()
    llm.generate(prompts, params, use_tqdm=False)
    steps = len(times["step (total)"])
    print(f"spec={a.spec} batch={a.batch} steps={steps} tau={engine.spec_stats.tau:.2f}")
    print("| phase | calls | median ms | total ms |")
    print("|---|---:|---:|---:|")
    for name, values in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"| {name} | {len(values)} | {statistics.median(values) * 1e3:.3f} | "
            f"{sum(values) * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
