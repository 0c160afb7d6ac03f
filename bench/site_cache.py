"""Time a deployed site's data load as a fresh ClientApp process does it, with and without the site cache.

    python -m bench.site_cache --images 2000 --side 64 --out /tmp/site-cache-bench

Writes a PNG site folder (random grey images, '|'-joined labels over 6 classes), then runs `load_site` in
three fresh Python processes: cache off, first message (decodes and writes the cache), next message (reads
the cache). Prints the seconds load_site took in each and the cache's size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedskew.data.site_folder import write_labelled_folder

TIMED = """
import json, sys, time
from fedskew.client_tasks import load_site
from fedskew.config import RunConfig
cfg = RunConfig.from_run_config({"dataset": "npz:own.npz", "mosaic-grid": 0})
start = time.perf_counter()
site = load_site(cfg, json.loads(sys.argv[1]))
print(json.dumps({"seconds": time.perf_counter() - start, "images": len(site.train_labels) + len(site.val_labels)}))
"""


def timed_load(node_config: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", TIMED, json.dumps(node_config)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    site = args.out / "site"
    if not site.exists():
        images = rng.random((args.images, 1, args.side, args.side), dtype=np.float32)
        labels = (rng.random((args.images, 6)) < 0.3).astype(np.float32)
        write_labelled_folder(site, images, labels, tuple(f"class-{k}" for k in range(6)))
    shutil.rmtree(args.out / "cache", ignore_errors=True)  # the first message must find no cache
    results = {
        "no cache": timed_load({"data-dir": str(site), "cache-dir": "off"}),
        "first message (writes the cache)": timed_load({"data-dir": str(site), "cache-dir": str(args.out / "cache")}),
        "next message (reads the cache)": timed_load({"data-dir": str(site), "cache-dir": str(args.out / "cache")}),
    }
    cache_bytes = sum(p.stat().st_size for p in (args.out / "cache").rglob("*") if p.is_file())
    for what, result in results.items():
        print(f"{what}: load_site {result['seconds']:.3f} s for {result['images']} images")
    print(f"cache size: {cache_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
