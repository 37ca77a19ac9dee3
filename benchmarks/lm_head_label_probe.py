"""Which label should a head learn for greedy decoding: the target's distribution over the
draft vocabulary (EAGLE-3's soft labels), its argmax, or a mix (``ttt.argmax_weight``)?
Measured on the CPU by retraining only the head's lm_head.

Why the lm_head alone answers part of the question. On greedy answers the drafts a chain
accepts are the answer's own tokens, and the unroll feeds each step the answer's token
and the previous step's hidden state, so the hidden states of steps 0..K-1 do not depend
on the lm_head. They are computed once per position; every label variant then retrains
the last layer from the head's own rows on the same features (AdamW, the trainer's step
weights ``decay**i``), and each retrained lm_head is judged exactly as ``specdec
eval-draft`` judges a head: chain replay over the eval sets' greedy answers
(``train/head_eval.py``). The body stays fixed, so the figures say how the label moves
the decision layer, not what full training reaches; a variant that does not move it
here is unlikely to be worth a GPU run. Before training it prints where the head's first
draft misses on each eval set (``step0_misses``): the share of positions and the head's
accuracy per bin of the target's own confidence, and where the head ranks the target's
token when it misses.

    specdec data-gen regenerate -i train_prompts.jsonl -o greedy/train --temperature 0 \\
        --max-tokens 256 --device cpu --dtype float32
    python benchmarks/lm_head_label_probe.py --train greedy/train \\
        --eval humaneval=greedy/humaneval --eval gsm_symbolic=greedy/gsm_symbolic \\
        --eval writingbench=greedy/writingbench --weights 0,0.5,1 --json probe.json

The train records must not be the eval sets' (regenerate bench prompts with ``specdec
bench --export-prompts`` for the eval sets, anything else for training).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.train.head_eval import EvalConfig, HeadJudge, SetFigures
from specdec.train.ttt import PackedBatch, draft_labels, mix_argmax, unroll, usable_labels


@dataclass
class StepRows:
    """One draft step's training rows: the head's normalized hidden state (the lm_head's
    input) and the target's final hidden state its label comes from."""

    features: torch.Tensor  # [m, hidden]
    label_hidden: torch.Tensor  # [m, hidden]


def step_rows(judge: HeadJudge, batch: PackedBatch, steps: int) -> list[StepRows]:
    """Each step's valid positions in ``batch`` (the trainer's rule, ``ttt.py``)."""
    head = judge.head
    captured: list[torch.Tensor] = []
    hook = head.lm_head.register_forward_hook(lambda _m, args, _out: captured.append(args[0]))
    try:
        with torch.inference_mode():
            _, _, usable = usable_labels(head, batch, judge.lm_head)  # [n]
            rows = []
            for step in unroll(head, batch, steps):
                valid = step.inside & usable[step.source]  # [n]
                rows.append(StepRows(captured[-1][valid].clone(),
                                     batch.target_hidden[step.source][valid].clone()))  # fmt: skip
    finally:
        hook.remove()
    return rows


def gather_rows(judge: HeadJudge, sets, steps: int) -> list[StepRows]:
    """Every step's rows over the record sets ((name, records) pairs), in order."""
    per_batch = [
        step_rows(judge, batch, steps)
        for name, records in sets
        for batch, _ in judge.forward_batches(name, records)
    ]
    features = [torch.cat([r[i].features for r in per_batch]) for i in range(steps)]
    labels = [torch.cat([r[i].label_hidden for r in per_batch]) for i in range(steps)]
    return [StepRows(f, h) for f, h in zip(features, labels, strict=True)]


def train_lm_head(
    start: torch.Tensor,  # [draft_vocab, hidden]: the head's rows
    rows: list[StepRows],
    label_weight: torch.Tensor,  # [draft_vocab, hidden]: the target's kept-id rows
    argmax_weight: float,
    *,
    lr: float,
    epochs: int,
    batch_rows: int,
    decay: float,
    seed: int,
    on_epoch,
) -> torch.Tensor:
    """AdamW over the rows, each micro-batch taking the same share of every step's rows and
    weighting step ``i``'s mean loss by ``decay**i``; ``on_epoch(epoch, weight)`` judges."""
    weight = torch.nn.Parameter(start.clone().float())
    optim = torch.optim.AdamW([weight], lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    total = sum(r.features.shape[0] for r in rows)
    chunks = max(1, -(-total // batch_rows))
    for epoch in range(1, epochs + 1):
        orders = [torch.randperm(r.features.shape[0], generator=gen) for r in rows]
        for c in range(chunks):
            optim.zero_grad(set_to_none=True)
            loss = torch.zeros(())
            for i, (r, order) in enumerate(zip(rows, orders, strict=True)):
                size = -(-order.shape[0] // chunks)
                idx = order[c * size : (c + 1) * size]
                if not idx.numel():
                    continue
                with torch.no_grad():
                    labels = draft_labels(r.label_hidden[idx], label_weight)
                    labels = mix_argmax(labels, labels.argmax(-1), argmax_weight)
                log_q = F.log_softmax(r.features[idx] @ weight.T, dim=-1)
                loss = loss + decay**i * -(labels * log_q).sum(-1).mean()
            loss.backward()
            optim.step()
        on_epoch(epoch, weight.detach())
    return weight.detach()


P1_BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)


def step0_misses(judge: HeadJudge, batches) -> dict:
    """Where the head's first draft misses on one set's forwarded batches: per bin of the
    target's confidence p1 (its argmax's probability over the draft vocabulary), the share
    of positions and the head's step-0 accuracy; and, over the misses, where the head ranks
    the target's token (2nd, 3rd-5th, lower)."""
    p1s, hits, ranks = [], [], []
    with torch.inference_mode():
        for batch, _ in batches:
            (rows,) = step_rows(judge, batch, 1)  # step 0's valid positions
            label = draft_labels(rows.label_hidden, judge.label_weight)  # [m, V_d]
            logits = judge.head.lm_head(rows.features).float()  # [m, V_d]
            want = label.argmax(-1)  # [m]
            p1s.append(label.max(-1).values)
            hits.append(logits.argmax(-1) == want)
            ranks.append((logits > logits.gather(1, want[:, None])).sum(-1))  # 0: drafted
    p1, hit, rank = torch.cat(p1s), torch.cat(hits), torch.cat(ranks)
    bins = []
    for lo, hi in itertools.pairwise(P1_BINS):
        inside = (p1 >= lo) & (p1 < hi)
        share = float(inside.float().mean())
        acc = float(hit[inside].float().mean()) if inside.any() else float("nan")
        bins.append({"p1": [lo, min(hi, 1.0)], "share": share, "acc_0": acc})
    missed = rank[~hit]  # 1: the target's token was the head's second choice
    miss_rank = {
        "2": float((missed == 1).float().mean()),
        "3-5": float(((missed >= 2) & (missed <= 4)).float().mean()),
        ">5": float((missed >= 5).float().mean()),
    }
    return {
        "positions": int(p1.numel()),
        "acc_0": float(hit.float().mean()),
        "by_p1": bins,
        "miss_rank": miss_rank,
    }


def figures_row(label: str, epoch: int, figures: list[SetFigures], chain: int) -> dict:
    return {
        "variant": label,
        "epoch": epoch,
        "sets": {
            f.name: {"tau": f.chains[chain].tau, "acc": f.acc, "simulated_tau": f.simulated_tau}
            for f in figures
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--train",
        action="append",
        required=True,
        help="regenerate directory of greedy answers (repeatable)",
    )
    parser.add_argument("--eval", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--head", default=None, help="head directory (default: the shipped)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--weights", default="0,0.5,1", help="argmax_weight values to train")
    parser.add_argument("--chain", type=int, default=3, help="K: draft steps judged")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch-rows", type=int, default=2048)
    parser.add_argument(
        "--max-rows",
        type=int,
        default=None,
        help="train on at most this many rows per step (a seeded sample)",
    )
    parser.add_argument("--decay", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    evals = tuple(tuple(e.split("=", 1)) for e in args.eval)
    trains = tuple((f"train{i}", path) for i, path in enumerate(args.train))
    config = EvalConfig(records=(*trains, *evals), head=args.head,
                        model=args.model, steps=args.chain, chains=(args.chain,),
                        max_tokens=args.max_tokens)  # fmt: skip
    judge = HeadJudge.load(config)
    train_sets, eval_sets = judge.sets[: len(trains)], judge.sets[len(trains) :]
    started = time.perf_counter()
    named = [(name, records) for (name, _), (_, records) in zip(trains, train_sets, strict=True)]
    rows = gather_rows(judge, named, args.chain)
    if args.max_rows is not None:
        gen = torch.Generator().manual_seed(args.seed)
        picks = [torch.randperm(r.features.shape[0], generator=gen)[: args.max_rows] for r in rows]
        rows = [StepRows(r.features[i], r.label_hidden[i])
                for r, i in zip(rows, picks, strict=True)]  # fmt: skip
    print(f"train rows per step: {[r.features.shape[0] for r in rows]} "
          f"({time.perf_counter() - started:.0f} s)")  # fmt: skip
    forwarded = [
        (name, root, manifest, list(judge.forward_batches(name, records)))
        for (name, root), (manifest, records) in zip(evals, eval_sets, strict=True)
    ]
    misses = {name: step0_misses(judge, batches) for name, _, _, batches in forwarded}
    for name, m in misses.items():
        cells = ", ".join(f"p1<{b['p1'][1]:g}: {b['share']:.3f} at {b['acc_0']:.2f}"
                          for b in m["by_p1"])  # fmt: skip
        print(f"{name}: step-0 acc {m['acc_0']:.3f}; {cells}; misses rank the target's "
              f"token {m['miss_rank']}")  # fmt: skip
    lm_head = judge.head.lm_head.weight
    start = lm_head.detach().clone()

    def judge_all(weight: torch.Tensor) -> list[SetFigures]:
        with torch.no_grad():
            lm_head.copy_(weight)
        return [judge.judge(name, root, manifest, batches)
                for name, root, manifest, batches in forwarded]  # fmt: skip

    results = [figures_row("head", 0, judge_all(start), args.chain)]
    for w in (float(x) for x in args.weights.split(",")):
        label = f"argmax_weight={w:g}"

        def on_epoch(epoch: int, weight: torch.Tensor, label: str = label) -> None:
            results.append(figures_row(label, epoch, judge_all(weight), args.chain))
            print(format_row(results[-1]), flush=True)

        train_lm_head(start, rows, judge.label_weight, w, lr=args.lr, epochs=args.epochs,
                      batch_rows=args.batch_rows, decay=args.decay, seed=args.seed,
                      on_epoch=on_epoch)  # fmt: skip
    with torch.no_grad():
        lm_head.copy_(start)
    names = [name for name, _ in evals]
    print(f"\nchain K={args.chain}: tau (acc_0) per set")
    print("| variant | epoch | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for r in results:
        print(format_row(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "step0_misses": misses, "results": results}, f,
                      indent=1)  # fmt: skip


def format_row(r: dict) -> str:
    cells = [f"{s['tau']:.3f} ({s['acc'][0]:.3f})" for s in r["sets"].values()]
    return f"| {r['variant']} | {r['epoch']} | " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
