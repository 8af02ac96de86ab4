"""The built-in default corpus: this Python's own standard-library `.py` sources, byte-level.

Every machine with Python has it, so examples and tests train on real text with no download.
  * files: `*.py` under `sysconfig.get_paths()["stdlib"]`, walked in sorted relative-path order,
    skipping test suites, IDLE, installed packages and generated platform files (`SKIP_DIRS`,
    `_sysconfigdata*`); the sorted list is cut before the first file that would exceed `max_bytes`;
  * tokens: raw bytes (the `byte` tokenizer, vocab 256), each file one document followed by EOD 0;
  * split: a file goes to validation when a hash of its relative path falls below
    `val_fraction` (at least one file each way), so both splits sample the whole library;
  * cache: `<cache>/stdlib-<python version>-<key>/{train,val}.{bin,idx}` + `manifest.json`, where
    key hashes the file list (names, sizes), the options and `FORMAT_VERSION`; the cache root is
    `cache_dir`, else $LWM_JAX_CACHE, else $XDG_CACHE_HOME/lwm_jax, else ~/.cache/lwm_jax. A
    finished directory is reused as is (a second call costs only a directory walk).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np

from lwm_jax.data.binidx import BinIdxDataset, BinIdxWriter

FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 16_000_000
DEFAULT_VAL_FRACTION = 0.05
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages",
                       "__pycache__"})
MANIFEST = "manifest.json"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where lwm_jax caches data: `cache_dir` > $LWM_JAX_CACHE > $XDG_CACHE_HOME/lwm_jax > ~/.cache/lwm_jax."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("LWM_JAX_CACHE"):
        return Path(os.environ["LWM_JAX_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lwm_jax"


def _skipped(rel_dir: Path) -> bool:
    return any(part in SKIP_DIRS or part.startswith("config-") for part in rel_dir.parts)


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES, root: str | os.PathLike | None = None
                   ) -> list[tuple[str, int]]:
    """Sorted [(relative posix path, size in bytes)] of the corpus files under `root` (default: stdlib)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"standard library directory {base} not found")
    found: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        rel_dir = Path(dirpath).relative_to(base)
        dirnames[:] = [d for d in dirnames if not _skipped(rel_dir / d)]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = Path(dirpath) / name
                if path.is_file():
                    found.append(((rel_dir / name).as_posix(), path.stat().st_size))
    found.sort()
    out, total = [], 0
    for rel, size in found:
        if total + size > max_bytes:
            break
        out.append((rel, size))
        total += size
    if not out:
        raise ValueError(f"no .py files of at most max_bytes={max_bytes} bytes under {base}")
    return out


def is_held_out(identity: str, val_fraction: float) -> bool:
    """True when the document named by `identity` belongs to the validation split: the first
    8 bytes of the SHA-256 of its UTF-8 encoding, read as a little-endian integer, lie below
    `val_fraction * 2^64`. A pure function of the identity, so the split is the same in every
    run, on every host and after every resume, and about `val_fraction` of many documents are
    held out; `val_fraction = 0` holds out nothing."""
    digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).digest()
    h = int.from_bytes(digest[:8], "little")
    return h < val_fraction * 2.0**64


def _split(files: list[tuple[str, int]], val_fraction: float) -> tuple[list[str], list[str]]:
    rels = [rel for rel, _ in files]
    if len(rels) < 2:
        raise ValueError(f"the corpus needs at least 2 files for a train/val split, got {len(rels)}: raise max_bytes")
    val = [r for r in rels if is_held_out(r, val_fraction)]
    if not val:  # keep the split non-empty: the file with the smallest hash goes to validation
        val = [min(rels, key=lambda r: hashlib.sha256(r.encode("utf-8")).digest())]
    if len(val) == len(rels):
        val = val[:-1]
    chosen = set(val)
    return [r for r in rels if r not in chosen], val


def build_stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = DEFAULT_VAL_FRACTION,
                        cache_dir: str | os.PathLike | None = None,
                        root: str | os.PathLike | None = None) -> Path:
    """Builds (or finds in the cache) the corpus; returns its directory holding `train.*` and `val.*`."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = stdlib_sources(max_bytes, base)
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    key_src = json.dumps({"format": FORMAT_VERSION, "python": py, "max_bytes": max_bytes,
                          "val_fraction": val_fraction, "files": files}, sort_keys=True)
    key = hashlib.sha256(key_src.encode("utf-8")).hexdigest()[:16]
    out = cache_root(cache_dir) / f"stdlib-{py}-{key}"
    if (out / MANIFEST).is_file():
        return out
    train, val = _split(files, val_fraction)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {}
    for split, rels in (("train", train), ("val", val)):
        with BinIdxWriter(tmp / split, np.uint8, append_eod=True, eod_id=0) as w:
            for rel in rels:
                w.add_document(np.frombuffer((base / rel).read_bytes(), dtype=np.uint8))
        counts[split] = {"documents": w.num_documents, "tokens": w.num_tokens}
    manifest = {"format": FORMAT_VERSION, "python": py, "root": str(base), "tokenizer": "byte",
                "vocab_size": 256, "max_bytes": max_bytes, "val_fraction": val_fraction,
                "splits": counts, "val_files": val}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first (target exists): keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / MANIFEST).is_file():
            raise
    return out


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = DEFAULT_VAL_FRACTION,
                  cache_dir: str | os.PathLike | None = None,
                  root: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(train_tokens, val_tokens): flat uint8 memmaps of the byte-level stdlib corpus (EOD = 0)."""
    out = build_stdlib_corpus(max_bytes, val_fraction, cache_dir, root)
    return BinIdxDataset(out / "train").tokens, BinIdxDataset(out / "val").tokens
