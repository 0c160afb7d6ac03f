"""A site's generators trained one after another vs side by side in worker processes, measured side by side.

    python -m bench.parallel_generators --classes 4,10 --steps 40 --audit-samples 64 --threads 2 --repeats 2

A site holding the first K digit classes (8 px, the CPU preset, `--steps` steps per generator) trains its K
generators with `train_site_generators` (training and memorisation audit) three ways: one after another on
one torch thread (a site given one core), one after another on `--threads` threads (factory.parallel-generators
= 1 on a site given `--threads` cores), and in `--threads` worker processes of one thread each; the three
alternate (`--repeats` times) so machine load hits them alike. Reports per side the median wall seconds, the
CPU seconds of the generators' own work (summed over the generators, worker processes included; process
start-up is in the wall time only) and the speed-up over the `--threads`-thread sequential side, and checks
that the workers trained the same generators as the one-thread sequential side (same threads per generator).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedskew.config import RunConfig
from fedskew.data.sites import simulated_site
from fedskew.factory.site import classes_only, train_site_generators


def site_with_classes(classes: int, seed: int):
    cfg = RunConfig.from_run_config({"method": "factory", "dataset": "digits", "mosaic-grid": 0, "partition": "iid",
                                     "image-size": 8, "seed": seed})  # fmt: skip
    return classes_only(simulated_site(cfg, 0, 1), tuple(range(classes)))


def timed_run(site, steps: int, audit_samples: int, workers: int, threads: int, seed: int) -> tuple[float, float, list[str]]:
    cfg = RunConfig.from_run_config({
        "method": "factory", "dataset": "digits", "mosaic-grid": 0, "partition": "iid", "image-size": 8, "seed": seed,
        "factory.generator-steps": steps, "factory.audit-samples": audit_samples, "factory.parallel-generators": workers,
    })  # fmt: skip
    torch.set_num_threads(threads)
    start = time.perf_counter()
    modules, metrics = train_site_generators(cfg, site, torch.device("cpu"))
    wall = time.perf_counter() - start
    return wall, metrics["generator_cpu_seconds"] + metrics["audit_cpu_seconds"], [m.checksum for m in modules]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", default="4,10", help="comma-separated class counts of the site (at most 10)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per generator")
    parser.add_argument("--audit-samples", type=int, default=64, help="memorisation-audit samples per generator")
    parser.add_argument("--threads", type=int, default=2, help="the site's torch threads (= workers on the parallel side)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    baseline = f"one after another, {args.threads} threads"
    sides = {"one after another, 1 thread": (1, 1), baseline: (1, args.threads), f"{args.threads} workers, 1 thread each": (args.threads, 1)}
    for classes in (int(k) for k in args.classes.split(",")):
        site = site_with_classes(classes, args.seed)
        walls: dict[str, list[float]] = {side: [] for side in sides}
        cpus: dict[str, list[float]] = {side: [] for side in sides}
        checksums = {}
        for repeat in range(args.repeats):
            for side, (workers, threads) in sides.items():
                wall, cpu, checksums[side] = timed_run(site, args.steps, args.audit_samples, workers, threads * workers, args.seed)
                walls[side].append(wall)
                cpus[side].append(cpu)
                print(f"{classes} classes, repeat {repeat + 1}: {side}: {wall:.1f} s wall, {cpu:.1f} CPU s", flush=True)
        same = checksums["one after another, 1 thread"] == checksums[f"{args.threads} workers, 1 thread each"]
        base = statistics.median(walls[baseline])
        print(f"\n{classes} classes, {args.steps} steps per generator, {args.threads} threads, median of {args.repeats}:")
        for side in sides:
            wall = statistics.median(walls[side])
            print(f"  {side}: {wall:.1f} s wall, {statistics.median(cpus[side]):.1f} CPU s, speed-up {base / wall:.2f}x")
        print(f"  workers trained the same generators as one thread one after another: {same}\n", flush=True)


if __name__ == "__main__":
    main()
