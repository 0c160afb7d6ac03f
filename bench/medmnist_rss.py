"""Peak memory (RSS) of loading 5,000 RGB images at 224 px: a MedMNIST file, and a deployed site's folder.

    python -m bench.medmnist_rss --images 5000 --out /tmp/medmnist-rss

Writes a synthetic pathmnist_224.npz (official layout, uint8 RGB; its MD5 stands in for the published one)
and a site folder holding the same number of images as site.npz, then measures in fresh processes:
`load_source` of the MedMNIST file, and `load_site` of the site folder as a deployed ClientApp runs it
(first message: reads the npz and writes the site cache; next message: reads the cache). Prints each
process's peak RSS (VmHWM); a bare Python with the same imports is printed as the floor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

IMPORTS = """
import json, sys
from medmnist import INFO
from fedskew.client_tasks import load_site
from fedskew.config import RunConfig
from fedskew.data.sources import load_source
"""
MEASURE = {
    "imports only (the floor)": "",
    "load_source('medmnist:pathmnist', image_size=224)": """
INFO["pathmnist"]["MD5_224"] = sys.argv[2]
dataset = load_source("medmnist:pathmnist", data_root=sys.argv[1], image_size=224)
images = (dataset.train_images, dataset.test_images)
""",
    "deployed site, first message (decode + write cache)": """
cfg = RunConfig.from_run_config({"dataset": "medmnist:pathmnist", "mosaic-grid": 0, "method": "fedavg", "partition": "iid"})
site = load_site(cfg, {"data-dir": sys.argv[1] + "/site", "cache-dir": sys.argv[1] + "/cache"})
images = (site.train_images, site.val_images)
""",
}
MEASURE["deployed site, next message (cache)"] = MEASURE["deployed site, first message (decode + write cache)"]
REPORT = """
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so it would report this benchmark's own peak.
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024**2
arrays = sum(a.nbytes for a in images) / 1024**3 if "images" in globals() else 0.0
print(json.dumps({"peak_gib": peak, "arrays_gib": arrays}))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "pathmnist_224.npz"
    rng = np.random.default_rng(0)
    n_test = args.images // 10
    splits = {"train": args.images - 2 * n_test, "val": n_test, "test": n_test}
    arrays = {}
    for split, n in splits.items():
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 9, (n, 1), dtype=np.uint8)
    np.savez(path, **arrays)
    site = args.out / "site"
    site.mkdir(exist_ok=True)
    np.savez(site / "site.npz", train_images=np.concatenate([arrays["train_images"], arrays["val_images"],
             arrays["test_images"]]), train_labels=np.concatenate([arrays[f"{s}_labels"] for s in splits]),
             class_names=np.array([f"class-{k}" for k in range(9)]))  # fmt: skip
    del arrays
    shutil.rmtree(args.out / "cache", ignore_errors=True)
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    print(f"{args.images} uint8 RGB images of 224 x 224 ({args.images * 224 * 224 * 3 / 1024**3:.2f} GiB of pixels)")
    for what, code in MEASURE.items():
        out = subprocess.run([sys.executable, "-c", IMPORTS + code + REPORT, str(args.out), md5],
                             check=True, capture_output=True, text=True)  # fmt: skip
        result = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{what}: peak RSS {result['peak_gib']:.2f} GiB, image arrays held {result['arrays_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
