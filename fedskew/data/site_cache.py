"""A deployed site's decoded data, cached between messages.

Flower starts a fresh ClientApp process for every message, so without a cache a PNG site folder is
decoded again for every survey, train and evaluate. The decoded arrays are stored once per site,
keyed by every data file's path, size and modification time plus the settings that shape the
decoding (label kind, class count, image size): a changed, added or removed file, or another
setting, reads the folder again. The cache lives with the site, never shared with another:

- node config `cache-dir` when given (`off` disables caching);
- else `<data-dir>/.fedskew-cache` when the data dir is writable;
- else a folder under the user's cache (`$XDG_CACHE_HOME` or ~/.cache) named by a hash of the data
  dir's absolute path (e.g. a read-only mount in a container).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

CACHE_DIR_KEY = "cache-dir"
CACHE_OFF = "off"
CACHE_VERSION = 1  # bump when the decoded form changes
IN_FOLDER = ".fedskew-cache"


def site_cache_dir(data_dir: Path, node_config: Mapping) -> Path | None:
    """Where this site keeps its cache (see the module docstring); None when caching is off."""
    configured = str(node_config.get(CACHE_DIR_KEY, "")).strip()
    if configured == CACHE_OFF:
        return None
    if configured:
        return Path(configured).expanduser()
    if os.access(data_dir, os.W_OK):
        return data_dir / IN_FOLDER
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return user_cache / "fedskew" / ("site-" + hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16])


def data_fingerprint(data_dir: Path, files: list[Path], settings: Mapping) -> str:
    """A hash of `files` (path under data_dir, size, mtime; absent ones count as absent) and `settings`."""
    digest = hashlib.sha256(json.dumps({"version": CACHE_VERSION, **settings}, sort_keys=True).encode())
    for path in sorted(files):
        stat = path.stat() if path.is_file() else None
        state = f"{stat.st_size}\0{stat.st_mtime_ns}" if stat else "absent"
        digest.update(f"{path.relative_to(data_dir).as_posix()}\0{state}\n".encode())
    return digest.hexdigest()[:32]


def cached_arrays(
    data_dir: Path,
    files: list[Path],
    cache_dir: Path | None,
    settings: Mapping,
    read: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """`read()`'s arrays, from the cache when `files` and `settings` are unchanged; else read and stored.
    A cache that cannot be written (full disk, permissions) only costs the speed-up."""
    if cache_dir is None:
        return read()
    key = data_fingerprint(data_dir, files, settings)
    entry = cache_dir / key
    if (entry / "done").is_file():
        try:
            # Memory-mapped copy-on-write: pages are read once, and the site may reorder its rows in place
            # (its train/validation split) without touching the cache or holding a second copy.
            return {p.stem: np.load(p, mmap_mode="c", allow_pickle=False) for p in entry.glob("*.npy")}
        except (OSError, ValueError):
            pass  # a damaged entry: read the data again and replace it
    arrays = read()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache_dir))
        for name, array in arrays.items():
            np.save(staging / f"{name}.npy", array, allow_pickle=False)
        (staging / "done").touch()
        for stale in cache_dir.iterdir():  # one entry per site: older fingerprints are dead weight
            if stale.is_dir() and not stale.name.startswith("."):
                shutil.rmtree(stale, ignore_errors=True)
        os.replace(staging, entry)  # atomic: a concurrent reader sees the old entry or the whole new one
    except OSError as err:
        print(f"fedskew: not caching the decoded data of {data_dir} in {cache_dir}: {err}", flush=True)
        shutil.rmtree(locals().get("staging", cache_dir / ".none"), ignore_errors=True)
    return arrays
