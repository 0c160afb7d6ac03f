"""A site's generators trained, or images drawn from them, one after another vs side by side in worker
processes, measured side by side.

    python -m bench.parallel_generators --classes 4,10 --steps 40 --audit-samples 64 --threads 2 --repeats 2
    python -m bench.parallel_generators --work synthesis --classes 10 --steps 40 --images-per-class 60 --threads 2 --repeats 3

A site holding the first K classes of `--dataset` (8 px digits by default; the CPU preset of that image
size, `--steps` steps per generator) trains its K
generators with `train_site_generators` (training and memorisation audit) three ways: one after another on
one torch thread (a site given one core), one after another on `--threads` threads (factory.parallel-generators
= 1 on a site given `--threads` cores), and in `--threads` worker processes of one thread each; the three
alternate (`--repeats` times) so machine load hits them alike. Reports per side the median wall seconds, the
CPU seconds of the generators' own work (summed over the generators, worker processes included; process
start-up is in the wall time only) and the speed-up over the `--threads`-thread sequential side, and checks
that the workers trained the same generators as the one-thread sequential side (same threads per generator).

`--work synthesis` trains the K generators once (one thread) and times instead the draw of
`--images-per-class` images of each class (`synthesise`, the server's and a P2P site's path, at the
configured sampler steps) the same three ways; it reports wall seconds only (the workers are the fork
server's children, whose CPU time this process cannot read) and checks that the workers drew the same
images as one thread.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np
import torch

from fedskew.config import RunConfig
from fedskew.data.sites import simulated_site
from fedskew.factory.library import Library, sampling_plan, synthesise
from fedskew.factory.site import classes_only, train_site_generators


def site_with_classes(classes: int, args: argparse.Namespace):
    cfg = RunConfig.from_run_config({"method": "factory", "dataset": args.dataset, "mosaic-grid": 0, "partition": "iid",
                                     "image-size": args.image_size, "seed": args.seed})  # fmt: skip
    return classes_only(simulated_site(cfg, 0, 1), tuple(range(classes)))


def factory_config(args: argparse.Namespace, workers: int) -> RunConfig:
    return RunConfig.from_run_config({
        "method": "factory", "dataset": args.dataset, "mosaic-grid": 0, "partition": "iid", "image-size": args.image_size, "seed": args.seed,
        "factory.generator-steps": args.steps, "factory.audit-samples": args.audit_samples, "factory.parallel-generators": workers,
    })  # fmt: skip


def timed_training(site, args: argparse.Namespace, workers: int, threads: int) -> tuple[float, float | None, list[str]]:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    modules, metrics = train_site_generators(factory_config(args, workers), site, torch.device("cpu"))
    wall = time.perf_counter() - start
    return wall, metrics["generator_cpu_seconds"] + metrics["audit_cpu_seconds"], [m.checksum for m in modules]


def timed_synthesis(library: Library, args: argparse.Namespace, workers: int, threads: int) -> tuple[float, None, np.ndarray]:
    factory = factory_config(args, workers).factory
    torch.set_num_threads(threads)
    start = time.perf_counter()
    synthetic = synthesise(
        library, sampling_plan(library, args.images_per_class, args.seed), steps=factory.sampler_steps,
        batch_size=factory.sample_batch_size, device=torch.device("cpu"), parallel=workers, progress=False,
    )  # fmt: skip
    return time.perf_counter() - start, None, synthetic.images


def trained_library(site, args: argparse.Namespace) -> Library:
    torch.set_num_threads(1)
    modules, _ = train_site_generators(factory_config(args, 1), site, torch.device("cpu"))
    return Library(tuple(modules), site.num_classes, tuple(site.train_images.shape[1:]), site.class_names)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", default="4,10", help="comma-separated class counts of the site (at most 10)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per generator")
    parser.add_argument("--audit-samples", type=int, default=64, help="memorisation-audit samples per generator")
    parser.add_argument("--threads", type=int, default=2, help="the site's torch threads (= workers on the parallel side)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="digits", help="a bundled single-label dataset (digits, deformed-digits, shapes)")
    parser.add_argument("--image-size", type=int, default=8, help="image side in pixels (the CPU preset scales with it)")
    parser.add_argument("--work", choices=("training", "synthesis"), default="training",
                        help="time the generators' training and audit, or the draw of images from them")
    parser.add_argument("--images-per-class", type=int, default=60, help="with --work synthesis: images drawn per class")
    args = parser.parse_args(argv)
    baseline = f"one after another, {args.threads} threads"
    sides = {"one after another, 1 thread": (1, 1), baseline: (1, args.threads), f"{args.threads} workers, 1 thread each": (args.threads, 1)}
    for classes in (int(k) for k in args.classes.split(",")):
        site = site_with_classes(classes, args)
        if args.work == "synthesis":
            timed = functools.partial(timed_synthesis, trained_library(site, args))
        else:
            timed = functools.partial(timed_training, site)
        walls: dict[str, list[float]] = {side: [] for side in sides}
        cpus: dict[str, list[float]] = {side: [] for side in sides}
        outputs = {}  # per side: the generators' checksums, or the images drawn
        for repeat in range(args.repeats):
            for side, (workers, threads) in sides.items():
                wall, cpu, outputs[side] = timed(args, workers, threads * workers)
                walls[side].append(wall)
                cpus[side].append(cpu)
                print(f"{classes} classes, repeat {repeat + 1}: {side}: {wall:.1f} s wall" + (f", {cpu:.1f} CPU s" if cpu is not None else ""), flush=True)
        same = np.array_equal(outputs["one after another, 1 thread"], outputs[f"{args.threads} workers, 1 thread each"])
        base = statistics.median(walls[baseline])
        what = f"{args.images_per_class} images per class drawn" if args.work == "synthesis" else "trained"
        print(f"\n{classes} classes, {args.steps} steps per generator, {what}, {args.threads} threads, median of {args.repeats}:")
        for side in sides:
            wall = statistics.median(walls[side])
            cpu = "" if args.work == "synthesis" else f", {statistics.median(cpus[side]):.1f} CPU s"
            print(f"  {side}: {wall:.1f} s wall{cpu}, speed-up {base / wall:.2f}x")
        made = "drew the same images" if args.work == "synthesis" else "trained the same generators"
        print(f"  workers {made} as one thread one after another: {same}\n", flush=True)


if __name__ == "__main__":
    main()
