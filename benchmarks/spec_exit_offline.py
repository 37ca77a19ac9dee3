"""SpecExit settings judged offline: the exit policy replayed over labelled traces.

For every labelled record of a ``data-gen exit-labels`` output (the target's own traces,
with an answer forced and judged at each step boundary), the target reads the trace once
(aux states, CPU or GPU), the head's exit channels give the signals at every token, and
``specdec.spec.spec_exit_replay.replay_exit`` runs the serving policy for each setting:

    python benchmarks/spec_exit_offline.py --model smollm2-135m-reasoning --head HEAD \\
        --labels data/spec-exit/labels --held-out 256 \\
        --settings '{}' '{"confidence_above": 0.9}' '{"confidence_above": null}'

Per setting: how many traces exit, the thinking kept (mean tokens, and the reduction
against the whole spans), and how many exits land on a boundary whose forced answer was
*not* settled (``changed``: the reply's answer would differ; an upper bound on accuracy
lost when the labels are ``--target final``). ``--judge final`` re-judges stored probe
answers against each trace's own final answer, so labels made with ``--target correct``
serve too. Last, a table; ``--json`` keeps the per-setting numbers, and ``--choose FILE``
writes the setting that cuts the most thinking with at most ``--max-changed`` (2%) of the
answers changed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from specdec.data_gen.dump_plan import CONFIDENCE_KEY
from specdec.data_gen.reasoning.confidence import agrees_with, final_answer, read_input
from specdec.data_gen.records import SkipCounts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the target (alias, directory, adapter)")
    p.add_argument("--head", required=True, help="EAGLE-3 head directory with exit channels")
    p.add_argument("--labels", required=True, help="exit-labels directory or JSONL")
    p.add_argument("--held-out", type=int, default=None, metavar="N",
                   help="only the records train-draft held out with data.eval_records=N "
                   "(online mode; it skipped none of the records)")  # fmt: skip
    p.add_argument("--skip", type=int, default=0, help="labelled records to skip first")
    p.add_argument("--records", type=int, default=None, help="labelled records to replay")
    p.add_argument("--settings", nargs="+", default=["{}"],
                   help="SpecExitParams fields as JSON objects over the head's recorded "
                   "setting, as serving layers them ('{}': the head's, else the "
                   "defaults)")  # fmt: skip
    p.add_argument("--step-tokens", type=int, default=4, help="tokens per replayed step (~τ)")
    p.add_argument("--judge", choices=["stored", "final"], default="stored",
                   help="stored labels, or stored answers vs each trace's own answer")  # fmt: skip
    p.add_argument("--answer-prefix", default="\n\n", help="as given to exit-labels")
    p.add_argument("--choose", default=None, metavar="FILE",
                   help="write the setting that cuts the most thinking while changing at "
                   "most --max-changed of the answers (JSON), for the evals to use")  # fmt: skip
    p.add_argument("--max-changed", type=float, default=0.02)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def choose(rows: list[dict], max_changed: float) -> dict | None:
    """The row with the largest reduction among those changing at most ``max_changed`` of
    the answers (ties: the earlier setting); None when none qualifies or none exits."""
    ok = [r for r in rows if r["changed"] <= max_changed and r["exits"] > 0]
    return max(ok, key=lambda r: r["reduction"], default=None)


def load_records(args) -> list[dict]:
    from specdec.train.data import evenly_spaced

    records = read_input(args.labels, SkipCounts())
    if args.held_out is not None:  # the trainer's online split (train.data.OnlineRecords)
        records = [records[i] for i in evenly_spaced(len(records), args.held_out)]
    records = [r for r in records if r.get(CONFIDENCE_KEY)]
    end = None if args.records is None else args.skip + args.records
    records = records[args.skip : end]
    if not records:
        raise SystemExit(f"{args.labels} has no labelled records in the range asked for")
    return records


def probe_labels(rec: dict, judge: str, tokenizer, span, end_len: int, prefix: str) -> dict:
    """position -> 1.0 | 0.0 at each probe of the record."""
    conf = rec[CONFIDENCE_KEY]
    labels = conf["labels"]
    if judge == "final":
        agrees = agrees_with(final_answer(tokenizer, rec["input_ids"], span.end + end_len, prefix))
        labels = [agrees(a) for a in conf["answers"]]
    return dict(zip(conf["positions"], labels, strict=True))


def main(argv: list[str] | None = None) -> int:
    from specdec.data_gen.target import TargetForward
    from specdec.models import load_config
    from specdec.models.eagle3_formats import load_eagle3, read_eagle3_config
    from specdec.models.loader import load_tokenizer
    from specdec.spec.spec_exit_replay import replay_exit
    from specdec.spec.spec_exit_runtime import SpecExitRuntime
    from specdec.spec_exit_params import spec_exit_params
    from specdec.think_markers import find_think_span, resolve_marker

    args = parse_args(argv)
    head_config = read_eagle3_config(args.head, load_config(args.model))
    base = head_config.spec_exit_defaults  # each setting overrides it, as in serving
    settings = [spec_exit_params(base, json.loads(s)) for s in args.settings]
    records = load_records(args)
    target = TargetForward(args.model, device=args.device or "auto",
                           aux_layer_ids=head_config.aux_layer_ids)  # fmt: skip
    head = load_eagle3(args.head, target_config=target.model.config, device=target.device)
    if head.spec_exit is None:
        raise SystemExit(f"{args.head} has no SpecExit channels")
    tokenizer = load_tokenizer(target.resolved)
    runtime = SpecExitRuntime(tokenizer, head.config.exit_signals)
    # Spans are found with the first setting's markers (settings differ in thresholds).
    start = resolve_marker(tokenizer, settings[0].think_start, "think_start")
    end = resolve_marker(tokenizer, settings[0].think_end, "think_end")
    traces = []  # (ids, prompt_len, span, signals, labels)
    for rec in tqdm(records, desc="signals", unit="trace"):
        ids = np.asarray(rec["input_ids"])
        mask = np.asarray(rec["loss_mask"])
        with torch.inference_mode():
            _, aux = target(ids, np.array([len(ids)]))
            signals = head.exit_signals(aux.to(head.fc.weight.dtype)).cpu().numpy()
        span = find_think_span(ids, start, end)
        if span is None:
            continue
        labels = probe_labels(rec, args.judge, tokenizer, span, len(end), args.answer_prefix)
        traces.append((ids, int(mask.argmax()), span, signals, labels))
    rows = []
    for text, params in zip(args.settings, settings, strict=True):
        kept, full, exits, changed, unjudged = [], [], 0, 0, 0
        for ids, prompt_len, span, signals, labels in traces:
            cut = replay_exit(runtime, params, ids, prompt_len, signals, args.step_tokens)
            full.append(span.num_thinking)
            if cut is None or cut >= span.end:
                kept.append(span.num_thinking)
                continue
            exits += 1
            kept.append(cut - span.start)
            label = labels.get(cut)
            unjudged += label is None
            changed += label == 0.0
        rows.append({
            "setting": json.loads(text), "traces": len(traces), "exits": exits,
            "think_tokens": statistics.fmean(kept), "full_think_tokens": statistics.fmean(full),
            "reduction": 1 - sum(kept) / sum(full), "changed": changed / len(traces),
            "unjudged": unjudged,
        })  # fmt: skip
    print(f"\n{len(traces)} traces, {args.step_tokens} tokens per step, judge {args.judge}\n")
    print("| setting | exits | think tokens | reduction | answer changed |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        think = f"{r['think_tokens']:.1f} / {r['full_think_tokens']:.1f}"
        print(f"| `{json.dumps(r['setting'])}` | {r['exits']} | {think} | "
              f"{r['reduction']:.1%} | {r['changed']:.1%} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    if args.choose:
        best = choose(rows, args.max_changed)
        if best is None:
            print(f"no setting exits with at most {args.max_changed:.1%} of answers changed")
            Path(args.choose).unlink(missing_ok=True)
        else:
            print(f"chosen: {json.dumps(best['setting'])}")
            Path(args.choose).write_text(json.dumps(best["setting"]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
