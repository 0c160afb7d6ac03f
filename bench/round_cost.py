"""Local training cost of one round per method, measured side by side in one process.

    python -m bench.round_cost --methods fedavg,fednca --run-config "num-server-rounds=30 local-epochs=3"

Every method trains the same site from the same initial weights; the methods take turns
(A B A B ...) for --repeats rounds so machine load hits them alike, on one torch thread (what
each Ray worker gets). Reports the median seconds per method and its ratio to the first method.
Flower's own per-round wall time in bench.compare runs includes messaging and evaluation and
varies with whatever else the machine runs; this isolates what the method itself costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.compare import parse_run_config
from fedskew.client_tasks import train_site
from fedskew.config import RunConfig
from fedskew.data.sites import simulated_site
from fedskew.methods import method_of
from fedskew.models.build import build_model, server_etf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="fedavg,fednca")
    parser.add_argument("--run-config", default="")
    parser.add_argument("--num-sites", type=int, default=10)
    parser.add_argument("--site", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    shared = parse_run_config(args.run_config)
    jobs = {}
    for method in args.methods.split(","):
        cfg = RunConfig.from_run_config({**shared, "method": method})
        site = simulated_site(cfg, args.site, args.num_sites)
        shape = site.train_images.shape[1:]
        etf = server_etf(cfg, site.num_classes, shape) if method_of(cfg).server_etf else None
        torch.manual_seed(cfg.seed)
        state = build_model(cfg, site.num_classes, shape, etf=etf).state_dict()
        jobs[method] = (cfg, site, state, None if etf is None else etf.numpy())

    seconds: dict[str, list[float]] = {m: [] for m in jobs}
    for repeat in range(args.repeats):
        for method, (cfg, site, state, etf) in jobs.items():
            start = time.perf_counter()
            train_site(cfg, site, state, server_round=2, proximal_mu=cfg.proximal_mu if method_of(cfg).proximal else 0.0, etf=etf)
            seconds[method].append(time.perf_counter() - start)
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{m} {s[-1]:.2f}s" for m, s in seconds.items()), flush=True)

    base = statistics.median(seconds[next(iter(jobs))])
    print(f"\nmedian local round on site {args.site} ({args.repeats} interleaved repeats, 1 thread):")
    for method, values in seconds.items():
        print(f"  {method}: {statistics.median(values):.2f} s  ({statistics.median(values) / base:.2f}x)")


if __name__ == "__main__":
    main()
