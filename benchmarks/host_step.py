"""Host time per decode step at large batch, the way ``data-gen regenerate`` samples.

``--batch`` requests (chat prompts) under regenerate's SamplingParams (temperature 0.7, a
seed per request, FINAL_ONLY, ``--max-tokens`` each with ignore_eos, so every request
runs to the end) on a tiny random model with SmolLM2's tokenizer (2 layers, 64 wide,
``--vocab`` rows of logits), on the CPU. Steps that compute prompt tokens are left out.

Per decode step it reports the step's wall time and its *host* time: the step's CPU time
minus the model forward (``runner.execute``) and the sampling kernels (``Sampler.__call__``
less its host-side draw of the seeded rows' keys), the two parts that on a GPU are
launches (a graph replay and a few kernels) whose device time runs behind the host. One
torch thread, so CPU time is this thread's and another process's load does not count.
That host share is device-independent: it is what bounds a large batch on the H200
(18.6k tok/s at batch 256 ≈ 13.7 ms a step, ~2 ms of it device).

``--async`` runs the engine's async-scheduling path (the H200's default for plain
decoding); ``--profile N`` prints the N costliest functions of the decode steps
(cProfile). ``--vocab 1024 --prompt-len 64`` is a quick run (same host work per step).

``--head DIR`` attaches an EAGLE-3 head with its default bands while the batch stays
above them: every timed step is plain, and its host time against a run without
``--head`` is what the attached proposer costs a plain step (nothing, by design). A head
needs its own target: ``--real`` runs SmolLM2 itself (the ``--smollm2`` directory's
weights, full vocabulary) instead of the tiny model, for the shipped SmolLM2 head.

    OMP_NUM_THREADS=1 python benchmarks/host_step.py --smollm2 /tmp/smk/m --async
    OMP_NUM_THREADS=1 python benchmarks/host_step.py --smollm2 DIR --real --async \
        --batch 64 --max-tokens 128 --prompt-len 64 [--head specdec/heads/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import time_step
from prompts import varied_conversations
from tiny_models import make_tiny_model_dir

from specdec import LLM, SamplingParams
from specdec.engine import sampler as sampler_module
from specdec.models.packaged_heads import head_speculative
from specdec.sampling_params import RequestOutputKind


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smollm2", default="/tmp/smk/m", help="a SmolLM2 dir (config+tokenizer)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--vocab", type=int, default=49152, help="logits width (SmolLM2: 49,152)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (then wall time is the bar)")
    p.add_argument("--prompt-len", type=int, default=0, help="truncate prompts (0: keep)")
    p.add_argument("--async", dest="async_", action="store_true", help="async scheduling")
    p.add_argument("--repeats", type=int, default=1, help="timed generations (medians pool)")
    p.add_argument("--profile", type=int, default=0, help="print the N costliest functions")
    p.add_argument("--real", action="store_true", help="SmolLM2 itself, not the tiny model")
    p.add_argument("--head", default=None, help="attach this EAGLE-3 head (plain steps)")
    p.add_argument("--sort", default="tottime", help="cProfile order: tottime, cumulative")
    a = p.parse_args()
    # One thread: the whole step then runs on this thread, and its CPU time (thread_time)
    # does not count time another process held the core.
    torch.set_num_threads(1)
    spec = None
    if a.head is not None:
        spec = head_speculative(a.head)
        if spec.disable_by_batch_size is None or spec.disable_by_batch_size >= a.batch:
            p.error(f"--batch {a.batch} must exceed the head's bands (plain steps)")
    with tempfile.TemporaryDirectory() as tmp:
        if a.real:
            model = Path(a.smollm2)
        else:
            # A narrowed vocabulary shrinks the logits only; prompt ids are taken modulo it.
            model = make_tiny_model_dir(Path(tmp), Path(a.smollm2), seed=0, vocab_size=a.vocab)
        llm = LLM(
            str(model),
            device=a.device,
            max_model_len=2048,
            max_num_seqs=a.batch,
            max_num_batched_tokens=16384,
            async_scheduling=a.async_,
            speculative=spec,
        )
        run(llm, a)


def run(llm: LLM, a: argparse.Namespace) -> None:
    engine = llm.engine
    tok = engine.tokenizer
    chats = [
        list(tok.apply_chat_template(c, add_generation_prompt=True)["input_ids"])
        for c in varied_conversations(16)
    ]
    # A narrowed vocabulary keeps the prompts' lengths, not their ids.
    vocab = engine.model_config.vocab_size
    prompts = [[t % vocab for t in chats[i % len(chats)]] for i in range(a.batch)]
    if a.prompt_len:
        prompts = [ids[: a.prompt_len] for ids in prompts]
    device_s = [0.0]  # forward + sampling kernels within the current step
    prefill = [False]

    def timed(fn, sign=1.0):
        def wrapper(*args, **kwargs):
            t0 = time.thread_time()
            out = fn(*args, **kwargs)
            device_s[0] += sign * (time.thread_time() - t0)
            return out

        return wrapper

    def schedule(*args, **kwargs):
        out = original_schedule(*args, **kwargs)
        prefill[0] |= any(s.num_new_tokens > 1 for s in out.scheduled)
        return out

    original_schedule = engine.scheduler.schedule
    engine.runner.execute = timed(engine.runner.execute)
    cls = type(engine.sampler)
    engine.sampler.__class__ = type("Timed", (cls,), {"__call__": timed(cls.__call__)})
    engine.scheduler.schedule = schedule
    # The seeded rows' keys are drawn on the host inside the sampler: count them back in.
    sampler_module.keys_tensor = timed(sampler_module.keys_tensor, sign=-1.0)

    walls: list[float] = []
    hosts: list[float] = []
    profiler = cProfile.Profile() if a.profile else None
    for repeat in range(a.repeats + 1):  # the first generation warms up
        for i, ids in enumerate(prompts):
            params = SamplingParams(
                temperature=0.7,
                max_tokens=a.max_tokens,
                ignore_eos=True,
                seed=1000 * repeat + i,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            engine.add_request(ids, params)
        while engine.has_unfinished_requests():
            device_s[0], prefill[0] = 0.0, False
            wall, cpu = time_step(engine, profiler if repeat else None)
            # Under async scheduling a step also finishes the previous one: count steps
            # whose schedule had no prompt tokens and that had a full batch running.
            if repeat and not prefill[0] and engine.scheduler.num_running == a.batch:
                walls.append(wall)
                hosts.append(cpu - device_s[0])
    print(
        f"batch={a.batch} vocab={engine.model_config.vocab_size} async={a.async_} "
        f"head={a.head} decode steps={len(walls)}: "
        f"median wall {statistics.median(walls) * 1e3:.2f} ms, "
        f"median host {statistics.median(hosts) * 1e3:.2f} ms "
        f"(forward + sampling kernels excluded)"
    )
    if profiler is not None:
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats(a.sort).print_stats(a.profile)
        print(s.getvalue())


if __name__ == "__main__":
    main()
