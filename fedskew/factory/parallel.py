"""Independent pieces of work on generators (a site training its per-class generators, the server or a P2P
site drawing images from a library's generators) run side by side in worker processes.

A generator of the CPU preset is a small network: one training run keeps one or two cores busy, however
many torch may use. Worker processes, each with its share of the site's torch threads, keep them all busy.
Stacking the generators into one batched network (torch.func.vmap) is no option: a site's generators
differ in batch size and number of steps (both follow the class's image count), and EDM2's forced weight
normalisation rewrites every weight in place in each training forward pass. Each job draws only from its own seed (the generator's), so a job gives
the same result in a worker as in the site's own process at the same thread count.

Drawing images is split the same way rather than left to torch's threads: the sampler's convolutions on
small images are short, and each waits at a barrier for all of torch's threads. When another process holds
one of the cores, the barrier waits for the scheduler: on the 2-core machine beside a one-thread job, the
draw of 8 px digits on 2 torch threads was 7.2x slower than on one (bench.parallel_generators), and in a
Flower run 35x slower than the same draws in a one-thread process.

Workers are not forked from the site's process: a fork of a process whose torch thread pool has run (a
Ray worker, a SuperNode) can deadlock in the child. They are forked from a fresh fork server that has
imported the job's module once (torch and fedskew take seconds to import), or spawned where the platform
has no fork server.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

import torch

Result = TypeVar("Result")


def worker_count(setting: int, jobs: int, device: torch.device, threads: int | None = None) -> int:
    """How many processes train a site's generators: `setting` when > 0; 0 = automatic: on the CPU one per
    thread torch may use here (in a simulation, the ClientApp's share of the cores), on CUDA one (one process
    keeps a GPU's context and memory to itself). Never more than there are jobs."""
    if setting < 0:
        raise ValueError(f"factory.parallel-generators = {setting} is invalid; valid: 0 (automatic) or >= 1")
    automatic = 1 if device.type == "cuda" else (threads or torch.get_num_threads())
    return max(1, min(setting or automatic, jobs))


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def run_side_by_side(
    function: Callable[..., Result], jobs: Sequence[tuple[Any, ...]], workers: int, threads: int | None = None,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """[function(*job) for job in jobs], in order; with workers > 1 in that many worker processes that share
    this process's torch threads (`threads`, default torch's current count) between them, at least one each.
    `on_result` is called with each result as it arrives (for progress lines). `function` and the jobs must
    be picklable (a module-level function; arrays, dataclasses). An exception in a job is raised here, with
    its own type."""
    if workers <= 1 or len(jobs) <= 1:
        results = []
        for job in jobs:
            results.append(function(*job))
            if on_result is not None:
                on_result(results[-1])
        return results
    per_worker = max(1, (threads or torch.get_num_threads()) // workers)
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([function.__module__])
    else:
        context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(per_worker,)) as pool:
        futures = [pool.submit(function, *job) for job in jobs]
        if on_result is not None:
            for future in as_completed(futures):
                on_result(future.result())
        return [future.result() for future in futures]
