"""A decode step's projections on CPU: ``F.linear`` against the engine's weight-major form.

A step of SmolLM2-135M multiplies the step's rows by every weight of the model once (30
layers of qkv, o_proj, the fused gate/up and down, then the tied lm_head: 540 MB in
float32), so on CPU its time is the time to stream those weights. The script times that
sequence of products, per row count, as ``F.linear(x, W)`` (MKL's matrix-vector kernel
for one row, its few-rows kernel for a handful) and as ``models.linear``'s
``weight_major_linear`` (``(W @ x.T).T``, MKL's general GEMM; one row goes in twice):
milliseconds for the whole sequence, the median of ``--repeats`` after one warm-up, and
the weight bandwidth each reaches. The largest difference between the two outputs is
printed too (float rounding).

    python benchmarks/cpu_linear.py --rows 1,2,4,8,16,32,64,128,256 --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from common import env_info, measure, parse_int_list, print_env

from specdec.models.linear import CPU_WEIGHT_MAJOR_MAX_ROWS, weight_major_linear

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1,536, 30 layers, vocab 49,152.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv o gate/up down
NUM_LAYERS, VOCAB, HIDDEN = 30, 49152, 576

FORMS = {
    "F.linear": lambda x, w: F.linear(x, w),
    "weight-major": lambda x, w: weight_major_linear(x, w, None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=parse_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    env = env_info(cpu, torch.float32) | {"threads": str(torch.get_num_threads())}
    print_env(env)

    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * NUM_LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.randn(shape, generator=gen) * shape[1] ** -0.5 for shape in shapes]
    gigabytes = sum(w.numel() * w.element_size() for w in weights) / 1e9
    results = []
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, generator=gen) for k in {s[1] for s in shapes}}
            row: dict[str, float] = {"rows": rows}
            for name, form in FORMS.items():

                def step(form=form, inputs=inputs) -> None:
                    for w in weights:
                        form(inputs[w.shape[1]], w)

                row[name] = measure(step, cpu, warmup=1, repeats=args.repeats) * 1e3
            w = weights[-1]
            x = inputs[w.shape[1]]
            row["max_diff"] = float(
                (FORMS["F.linear"](x, w) - FORMS["weight-major"](x, w)).abs().max()
            )
            results.append(row)
            print(json.dumps(row), flush=True)

    print(
        f"\n{len(weights)} products, {gigabytes:.2f} GB of float32 weights a step; the engine "
        f"takes the weight-major form up to {CPU_WEIGHT_MAJOR_MAX_ROWS} rows\n"
    )
    print("| rows | F.linear ms (GB/s) | weight-major ms (GB/s) | speedup | max abs diff |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        a, b = r["F.linear"], r["weight-major"]
        print(
            f"| {r['rows']} | {a:.1f} ({gigabytes / a * 1e3:.1f}) | {b:.1f} "
            f"({gigabytes / b * 1e3:.1f}) | {a / b:.2f}x | {r['max_diff']:.1e} |"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"env": env, "rows": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
