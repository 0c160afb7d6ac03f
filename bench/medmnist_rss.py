"""Peak memory (RSS) of loading a 224 px MedMNIST-layout site of RGB images.

    python -m bench.medmnist_rss --images 5000 --out /tmp/medmnist-rss

Writes a synthetic pathmnist_224.npz (official layout, uint8 RGB; its MD5 stands in for the published one),
then loads it with `load_source` in a fresh process and prints the peak RSS and the size of the arrays.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np

MEASURE = """
import hashlib, resource, sys
from medmnist import INFO
from fedskew.data.sources import load_source
INFO["pathmnist"]["MD5_224"] = sys.argv[2]
dataset = load_source("medmnist:pathmnist", data_root=sys.argv[1], image_size=224)
peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
arrays_gb = (dataset.train_images.nbytes + dataset.test_images.nbytes) / 1024**3
print(f"{len(dataset.train_labels) + len(dataset.test_labels)} images of {dataset.image_shape}: "
      f"peak RSS {peak_gb:.2f} GiB, image arrays {arrays_gb:.2f} GiB ({dataset.train_images.dtype})")
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
    del arrays
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    print(subprocess.run([sys.executable, "-c", MEASURE, str(args.out), md5], check=True, capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()
