"""Does an EAGLE-3 head draft worse after long prompts because it attends over them?

WritingBench's prompts paste a 2,000–4,000-token paper; the shipped head's τ on those
prompts trails the short ones' (session 31, batch 1: 4.29 against 4.98). Content differs
between the two groups, so this probe holds the content fixed: per prompt, the target runs
once over prompt + answer (its hidden states and argmax labels see the whole prompt), and
the head's TTT forward (the trainer's objective, ``ttt_forward``) runs over the same
positions with its own view of the prompt cut to the last ``keep`` tokens. If the head
drafts better with less of the prompt, its attention over far tokens hurts (a window or
longer training documents would help); if it drafts worse, it uses them.

    python benchmarks/head_context_probe.py --bench results/2026-12-04_h200_s31_headline_b1.json \
        --set writingbench --keep 0,256,1024,2048 --min-prompt 2048

Answers are the bench report's plain greedy outputs; the labels are this run's target
argmax (CPU fp32 by default). Prints, per ``keep``: acc_0..acc_{steps-1} over the answer
positions (step i: the draft i tokens past the last target hidden state) and the simulated
τ (``ttt.py``: the leading run of correct steps + 1, averaged over positions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from specdec.data_gen.target import DTYPES, TargetForward
from specdec.models.eagle3_formats import load_eagle3
from specdec.models.loader import load_tokenizer
from specdec.models.packaged_heads import packaged_head
from specdec.train.data import assemble
from specdec.train.model import TargetIO, attention_backend, draft_rows
from specdec.train.ttt import ttt_forward


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="a specdec bench JSON (plain outputs kept)")
    p.add_argument("--set", default="writingbench")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--head", default=None, help="head dir (default: the model's shipped one)")
    p.add_argument("--keep", default="0,256,1024,2048",
                   help="prompt tokens the head sees (0: all of them)")  # fmt: skip
    p.add_argument("--min-prompt", type=int, default=2048, help="only prompts at least this long")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    keeps = [int(x) for x in a.keep.split(",")]
    if any(k < 0 for k in keeps):
        sys.exit(f"--keep {a.keep}: counts must be >= 0 (0: the whole prompt)")
    report = json.loads(Path(a.bench).read_text())
    if a.set not in report["sets"]:
        sys.exit(f"--set {a.set!r} is not in {a.bench}; it has {sorted(report['sets'])}")
    dtype = DTYPES[a.dtype]
    tokenizer = load_tokenizer(a.model)
    records = []
    for prompt in report["sets"][a.set]["prompts"]:
        text = tokenizer.apply_chat_template(
            prompt["messages"], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= a.min_prompt and prompt["output_ids"]:
            records.append((prompt["id"], ids, prompt["output_ids"]))
    if not records:
        sys.exit(f"no {a.set} prompt has >= {a.min_prompt} tokens and a kept output")
    head_dir = Path(a.head) if a.head else packaged_head(a.model)
    io = TargetIO.load(a.model).to("cpu", dtype)
    head = load_eagle3(head_dir, target_config=io.config, dtype=dtype, device="cpu",
                       attention=attention_backend("reference", torch.device("cpu")))  # fmt: skip
    head.bind_embedding(lambda ids: torch.nn.functional.embedding(ids, io.embed))
    head.eval()
    longest = max(len(ids) + len(out) for _, ids, out in records)
    aux_ids = head.config.aux_layer_ids
    forward = TargetForward(a.model, device="cpu", dtype=dtype, aux_layer_ids=aux_ids,
                            max_seq_len=longest)  # fmt: skip
    label_weight = draft_rows(head, io.lm_head)
    totals = {k: np.zeros((2, a.steps + 1)) for k in keeps}  # correct, valid per step; τ sums
    rows = []
    for rid, prompt_ids, out_ids in records:
        ids = np.array(prompt_ids + out_ids, dtype=np.int64)
        mask = np.array([0] * len(prompt_ids) + [1] * len(out_ids), dtype=bool)
        with torch.inference_mode():
            hidden, aux = forward(ids, np.array([len(ids)]))
            for keep in keeps:
                start = max(0, len(prompt_ids) - keep) if keep else 0
                batch = assemble([(ids[start:], mask[start:], aux[start:], hidden[start:])])
                out = ttt_forward(head, batch, io.lm_head, steps=a.steps,
                                  label_weight=label_weight)  # fmt: skip
                t = totals[keep]
                t[0, : a.steps] += out.step_correct.numpy()
                t[1, : a.steps] += out.step_valid.numpy()
                t[0, a.steps] += int(out.leading_correct[out.valid0].sum())
                t[1, a.steps] += int(out.valid0.sum())
                acc = (out.step_correct / out.step_valid.clamp(min=1)).tolist()
                rows.append({"id": rid, "prompt_tokens": len(prompt_ids), "keep": keep,
                             "acc": acc})  # fmt: skip
                print(f"{rid} ({len(prompt_ids)} prompt tokens) keep {keep or 'all'}: "
                      + "/".join(f"{x:.3f}" for x in acc), flush=True)  # fmt: skip
    print(f"\n{a.set}: {len(records)} prompts of >= {a.min_prompt} tokens, {a.dtype}")
    print("| head sees | " + " | ".join(f"acc_{i}" for i in range(a.steps)) + " | simulated τ |")
    print("|---|" + "---:|" * (a.steps + 1))
    summary = {}
    for keep in keeps:
        t = totals[keep]
        acc = t[0, : a.steps] / np.maximum(t[1, : a.steps], 1)
        tau = 1 + t[0, a.steps] / max(t[1, a.steps], 1)
        summary[keep] = {"acc": acc.tolist(), "simulated_tau": tau}
        label = "the whole prompt" if keep == 0 else f"its last {keep} tokens"
        print(f"| {label} | " + " | ".join(f"{x:.3f}" for x in acc) + f" | {tau:.3f} |")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
