"""Per-round time of a real deployed run, with and without the sites' data cache.

    python -m bench.deployed_round --images 2000 --side 64 --rounds 3 --repeats 2 --out /tmp/deployed-round

Starts real processes on this host (fedskew.testing.deploy): a SuperLink with TLS and SuperNode authentication,
and three SuperNodes, each reading its own folder of `--images` PNG images with labels.csv (random grey
images, '|'-joined labels over 6 classes). Every message runs in a fresh ClientApp process, so without
the cache a site decodes its whole folder for the survey and for every train and evaluate message. The
same FedAvg run (`--rounds` rounds, one local epoch, federated evaluation on the sites' validation
splits) is run with `cache-dir = 'off'` and with a cache, alternating `--repeats` times so machine load
hits both alike; prints the ServerApp's round_seconds (metrics.jsonl) of every run and the median per
setting. One compute thread per process, as in the tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
from pathlib import Path

import numpy as np

from fedskew.data.site_folder import write_labelled_folder
from fedskew.testing.deploy import SuperLink, SuperNode, TlsFiles, connected

DOCKER = Path(__file__).resolve().parent.parent / "docker"
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SITES = 3


def site_folders(out: Path, images: int, side: int) -> list[Path]:
    """The sites' folders, then the server's test folder (a tenth of a site's size)."""
    folders = []
    for k, name in enumerate([*(f"site-{k}" for k in range(SITES)), "server-test"]):
        folder = out / "data" / name
        if not folder.exists():
            rng = np.random.default_rng(k)
            count = images if name != "server-test" else max(images // 10, 10)
            pixels = rng.random((count, 1, side, side), dtype=np.float32)
            labels = (rng.random((count, 6)) < 0.3).astype(np.float32)
            write_labelled_folder(folder, pixels, labels, tuple(f"class-{c}" for c in range(6)))
        folders.append(folder)
    return folders


def timed_run(out: Path, pki: Path, folders: list[Path], test: Path, cache: bool, rounds: int, tag: str) -> list[float]:
    """round_seconds of one FedAvg run on the three sites (cache on: each site's own cache folder, emptied first)."""
    home = out / tag
    shutil.rmtree(home, ignore_errors=True)
    with SuperLink(home / "superlink", TlsFiles.in_folder(pki / "certs"), env=THREADS) as link:
        for k in range(SITES):
            link.register(pki / "keys" / f"site-{k}.pub")
        nodes = [
            SuperNode(link, home / f"node-{k}", {"data-dir": str(d), "site-id": k, "num-sites": SITES,
                                                "cache-dir": str(home / f"cache-{k}") if cache else "off"},
                      pki / "keys" / f"site-{k}", env=THREADS)
            for k, d in enumerate(folders)
        ]  # fmt: skip
        with connected(nodes):
            run_id = link.submit({"method": "fedavg", "dataset": "npz:unused.npz", "mosaic-grid": 0, "labels": "auto",
                                  "partition": "iid", "num-server-rounds": rounds, "local-epochs": 1,
                                  "min-available-sites": SITES, "test-data": str(test),
                                  "results-dir": str(home / "results")})  # fmt: skip
            outcome = link.wait(run_id, timeout=1800)
    if not outcome.completed:
        raise RuntimeError(f"run {run_id} ({tag}) did not complete: {outcome.status}\n{outcome.output[-3000:]}")
    metrics = next((home / "results").rglob("metrics.jsonl"))
    return [entry["round_seconds"] for entry in map(json.loads, metrics.read_text().splitlines()) if entry["round"] > 0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--side", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    pki = args.out / "pki"
    if not (pki / "certs" / "ca.crt").exists():
        subprocess.run([str(DOCKER / "certs.sh"), str(pki / "certs")], check=True, capture_output=True)
        subprocess.run([str(DOCKER / "keys.sh"), str(pki / "keys"), *(f"site-{k}" for k in range(SITES))],
                       check=True, capture_output=True)  # fmt: skip
    *folders, test = site_folders(args.out, args.images, args.side)
    seconds: dict[str, list[float]] = {"no cache": [], "cache": []}
    for repeat in range(args.repeats):
        for setting in seconds:
            rounds = timed_run(args.out, pki, folders, test, setting == "cache", args.rounds, f"{setting.replace(' ', '-')}-{repeat}")
            seconds[setting] += rounds
            print(f"{setting}, repeat {repeat}: round seconds {', '.join(f'{s:.1f}' for s in rounds)}", flush=True)
    medians = {setting: statistics.median(values) for setting, values in seconds.items()}
    print(f"median round: no cache {medians['no cache']:.1f} s, cache {medians['cache']:.1f} s "
          f"(cache / no cache = {medians['cache'] / medians['no cache']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
