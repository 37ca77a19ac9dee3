"""GGUF -> HF directory, converted once and cached.

transformers dequantizes a GGUF file on every load (~15-25 s for SmolLM2-135M on these
CPUs). We do it once and keep the result as a plain HF directory (config.json, float32
safetensors, tokenizer files), which loads in about a second. Dequantized values are
exact in float32, so nothing is lost by caching at that precision.

Cache entries live in ``<cache_dir>/gguf/<stem>-<key>``; the key hashes the GGUF's resolved
path, size and mtime (and the cache format version), so replacing the file makes a new
entry, and the conversion then deletes the entries of the file's earlier versions. An
entry is written into a temporary directory and renamed into place: a killed conversion
never leaves a partial entry, and concurrent conversions of the same file both succeed
(the first rename wins, the loser discards its copy). An entry damaged afterwards (a
truncated or unreadable safetensors file, a missing shard or config) is found by reading
its headers on every use, which costs milliseconds, and converted again. The log says at
INFO which of the two happened.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when the layout of a cache entry changes, so stale entries are not reused.
CACHE_FORMAT_VERSION = 1
# Temporary directories older than this are leftovers of killed conversions.
_STALE_TMP_SECONDS = 3600

Converter = Callable[[Path, Path], None]


def default_cache_dir() -> Path:
    """``$SPECDEC_CACHE`` if set, else ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def cache_entry_dir(gguf_path: Path, cache_dir: Path | str | None = None) -> Path:
    """Where the HF directory converted from ``gguf_path`` lives (existing or not)."""
    path = gguf_path.resolve()
    stat = path.stat()
    ident = f"v{CACHE_FORMAT_VERSION}|{path}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "gguf" / f"{path.stem}-{key}"


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` with transformers and save it to ``out_dir`` as an HF dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    # A plain GGUF load keeps the model marked quantized and refuses save_pretrained;
    # dequantize=True yields ordinary float tensors.
    model = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    logger.info("saving float32 safetensors to %s", out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    del model
    AutoTokenizer.from_pretrained(src_dir, gguf_file=name).save_pretrained(out_dir)


def gguf_to_hf_dir(
    gguf_path: Path,
    cache_dir: Path | str | None = None,
    *,
    convert: Converter | None = None,
) -> Path:
    """The cached HF directory for ``gguf_path``, converting on first use with ``convert``
    (default ``convert_gguf``)."""
    convert = convert or convert_gguf
    final = cache_entry_dir(gguf_path, cache_dir)
    if final.exists():
        problem = entry_problem(final)
        if problem is None:
            logger.info("using the cached float32 conversion of %s: %s", gguf_path.name, final)
            return final
        logger.warning("cache entry %s is damaged (%s); converting again", final, problem)
        shutil.rmtree(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        logger.info(
            "converting %s to a float32 HF directory (one time; ~20 s for 135M params) -> %s",
            gguf_path,
            final,
        )
        start = time.perf_counter()
        convert(gguf_path, tmp)
        source = {"gguf": str(gguf_path.resolve()), "format_version": CACHE_FORMAT_VERSION}
        (tmp / "specdec_source.json").write_text(json.dumps(source, indent=2) + "\n")
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            logger.info("another process cached %s first; using its copy", final)
        logger.info("converted in %.1f s", time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_earlier_versions(final, gguf_path.resolve())
    return final


def entry_problem(entry: Path) -> str | None:
    """What makes cache entry ``entry`` unusable, or None: config.json missing or not JSON,
    no safetensors file, a shard the index names missing, or a safetensors file whose
    header does not parse or whose data the file does not hold in full (headers only are
    read)."""
    from safetensors import SafetensorError, safe_open

    try:
        json.loads((entry / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"config.json: {type(e).__name__}"
    shards = sorted(entry.glob("*.safetensors"))
    if not shards:
        return "no *.safetensors file"
    index = entry / "model.safetensors.index.json"
    if index.is_file():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            return f"{index.name}: {type(e).__name__}"
        if missing := sorted(named - {s.name for s in shards}):
            return f"missing shard {missing[0]}"
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt"):
                pass
        except (OSError, SafetensorError) as e:
            return f"{shard.name}: {e}"
    return None


def _remove_earlier_versions(entry: Path, gguf_path: Path) -> None:
    """Delete the other cache entries converted from the file at ``gguf_path``: they hold
    an earlier version of it (another size or mtime), which no key will find again."""
    for other in entry.parent.iterdir():
        if other == entry or not other.name.startswith(f"{gguf_path.stem}-"):
            continue
        try:
            source = json.loads((other / "specdec_source.json").read_text())
        except (OSError, ValueError):
            continue
        if source.get("gguf") == str(gguf_path):
            logger.info("removing %s, the conversion of an earlier %s", other, gguf_path.name)
            shutil.rmtree(other, ignore_errors=True)


def _remove_stale_tmp_dirs(root: Path) -> None:
    now = time.time()
    for tmp in root.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except FileNotFoundError:  # another process removed it meanwhile
            continue
