"""Scaling curve: wall time, CPU time and bytes of one FedNCA-ML round and of one FederatedFactory run for
a growing number of simulated sites, through real Flower simulations on this machine.

    python -m bench.scaling --sites 5,10,20,50 --out bench/results/scaling

Every point is one `flwr run` of the app (fedskew.testing.launch.SimulationSuperLink) with `num-supernodes` = the
number of sites and `client-resources-num-cpus` = --cpus-per-client, so the machine runs cores /
cpus-per-client ClientApps at a time and Ray queues the rest. The data set is the same at every size: more
sites means smaller sites (strong scaling), so the curve shows what each extra site adds on top of the same
total work. Per point: the wall time of the `flwr run` command (submission to the end of the run, the
simulation's start-up included), the ServerApp's own wall time and round time (summary.json,
metrics.jsonl), the CPU seconds of every process of the run (SuperLink, simulation, Ray, ClientApps;
sampled from /proc) and the bytes the server sent to and received from the sites (serialised message
contents, summary.json -> bytes). The methods' run configs are --fednca-config and --factory-config.

Writes OUT/results.json (the machine, and one record per method and size), OUT/results.md (the table and
the cost of one more site, a least-squares slope over the sizes) and OUT/scaling.png (wall time, CPU time
and MB moved against the number of sites), rewritten after every run. A point already in OUT/results.json
with the same run config is reused, so re-running the command resumes it; every run's own results are
under OUT/runs/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.compare import completed_run, parse_run_config  # noqa: E402
from fedskew.config import RunConfig  # noqa: E402
from fedskew.testing.launch import ProcessTreeCPU, SimulationSuperLink  # noqa: E402

FEDNCA_CONFIG = "method='fednca' num-server-rounds=1 local-epochs=3"
# Two classes per site cover the 10 digit classes from 5 sites on (single-class sites would need 10), and at
# 50 sites every class is still split into shares above factory.min-class-images. Short generators, a small
# synthetic set and classifier, and no fidelity metrics (Inception features) keep a 50-site run to minutes;
# the server's synthesis and classifier are a fixed cost per run whatever the number of sites.
FACTORY_CONFIG = ("method='factory' mosaic-grid=0 partition='classes-per-site' classes-per-site=2 "
                  "factory.generator-steps=50 factory.samples-per-class=100 factory.classifier-epochs=2 factory.fidelity=false")
# (column, header, format) of the table; the last three only for a method whose points have them.
COLUMNS = (
    ("run_wall_seconds", "flwr run wall s", ".1f"),
    ("round_seconds", "round s", ".1f"),
    ("cpu_seconds", "CPU s", ".1f"),
    ("mb_sent", "MB sent", ".3g"),  # FederatedFactory sends a few hundred bytes, FedNCA-ML megabytes
    ("mb_received", "MB received", ".3g"),
    ("generators_cpu_seconds", "sites' generators CPU s", ".1f"),
    ("synthesis_cpu_seconds", "synthesis CPU s", ".1f"),
    ("classifier_cpu_seconds", "classifier CPU s", ".1f"),
)


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def point_key(method: str, sites: int) -> str:
    return f"{method}/{sites}"


def run_point(superlink: SimulationSuperLink, run_config: dict, sites: int, cpus_per_client: int, out: Path,
              timeout: float) -> dict:
    """One real simulation, its results under OUT/runs/: its wall time from outside, the CPU seconds of its
    processes, and what its ServerApp recorded (summary.json, metrics.jsonl)."""
    results_dir = out / "runs" / f"{run_config['method']}-{sites}sites"
    shutil.rmtree(results_dir, ignore_errors=True)  # a run interrupted earlier left a partial directory
    load_before = os.getloadavg()[0]
    with ProcessTreeCPU(superlink.process.pid) as cpu:
        cpu_start, wall_start = cpu.sample(), time.perf_counter()
        outcome = superlink.run_app({**run_config, "results-dir": str(results_dir.resolve())}, sites, timeout=timeout,
                                    cpus_per_client=cpus_per_client, echo=True)
        wall, cpu_seconds = time.perf_counter() - wall_start, cpu.sample() - cpu_start
    run_dir = completed_run(results_dir, {**run_config, "results-dir": str(results_dir.resolve())})
    if not outcome.completed or run_dir is None:
        raise SystemExit(f"{run_config['method']} with {sites} sites ended {outcome.status}:\n{outcome.output[-3000:]}")
    return {"run_config": run_config, "sites": sites, "cpus_per_client": cpus_per_client,
            "run_wall_seconds": wall, "cpu_seconds": cpu_seconds, "load_average": [load_before, os.getloadavg()[0]],
            "run_dir": run_dir.resolve().relative_to(out.resolve()).as_posix(), **recorded(run_dir)}


def recorded(run_dir: Path) -> dict:
    """What the ServerApp recorded: its wall time, the first trained round's time (for FederatedFactory, the
    whole method: generators, synthesis and the classifier) and the bytes moved."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rounds if r["round"] == 1)
    traffic = summary["bytes"]
    record = {"server_wall_seconds": summary["wall_seconds"], "round_seconds": first["round_seconds"],
              "mb_sent": traffic["sent_total"] / 1e6, "mb_received": traffic["received_total"] / 1e6,
              "sites_replied": len(traffic["received_per_site"])}
    if "factory" in summary:  # where a FederatedFactory run's CPU went: the sites' generators, then the server
        sites = summary["factory"]["site_metrics"]
        record.update(generators=len(summary["factory"]["modules"]),
                      generators_cpu_seconds=sum(s["generator_cpu_seconds"] + s["audit_cpu_seconds"] for s in sites),
                      synthesis_cpu_seconds=first["train"]["synthesis_cpu_seconds"],
                      classifier_cpu_seconds=first["train"]["classifier_cpu_seconds"])
    return record


def per_site_cost(points: list[dict], key: str) -> float:
    """The cost of one more site: the least-squares slope of `key` against the number of sites."""
    sites = np.array([p["sites"] for p in points], dtype=float)
    return float(np.polyfit(sites, [p[key] for p in points], 1)[0])


def by_method(results: dict) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for point in results["points"].values():
        grouped.setdefault(point["run_config"]["method"], []).append(point)
    return {method: sorted(points, key=lambda p: p["sites"]) for method, points in grouped.items()}


def table(results: dict, command: str) -> str:
    host = results["machine"]
    lines = [f"Command: `{command}`", "",
             f"Machine: {host['cpu_count']} cores ({host['platform']}), client-resources-num-cpus = "
             f"{results['cpus_per_client']}: {host['cpu_count'] // results['cpus_per_client']} ClientApps at a time, "
             "Ray queues the others. Wall times include whatever else ran on the machine (load average at the start "
             "and end of each run in results.json); CPU seconds are every process of the run; bytes are exact.", ""]
    for method, points in by_method(results).items():
        columns = [column for column in COLUMNS if all(column[0] in point for point in points)]
        lines += [f"**{method}** (`{results['configs'][method]}`):", "",
                  "| sites | " + " | ".join(header for _, header, _ in columns) + " | load average |",
                  "|---" * (len(columns) + 2) + "|"]
        for point in points:
            cells = [f"{point[key]:{spec}}" for key, _, spec in columns]
            load = "–".join(f"{value:.1f}" for value in point["load_average"])
            lines.append(f"| {point['sites']} | " + " | ".join(cells) + f" | {load} |")
        if len(points) >= 2:
            slopes = ", ".join(f"{header} {per_site_cost(points, key):+{'.2f' if spec.endswith('f') else spec}}"
                               for key, header, spec in columns)  # a second decimal for a cost per site
            lines += ["", f"One more site (least-squares slope over {len(points)} sizes): {slopes}."]
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    panels = (("run_wall_seconds", "flwr run wall time (s)"), ("cpu_seconds", "CPU time, all processes (s)"),
              ("mb_moved", "MB sent + received"))
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 4))
    for method, points in by_method(results).items():
        sites = [p["sites"] for p in points]
        for ax, (key, label) in zip(axes, panels):
            values = [p["mb_sent"] + p["mb_received"] if key == "mb_moved" else p[key] for p in points]
            ax.plot(sites, values, marker="o", label=method)
            ax.set(xlabel="simulated sites", ylabel=label)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted({p["sites"] for p in results["points"].values()}))
    axes[0].legend()
    fig.suptitle(f"one FedNCA-ML round, one FederatedFactory run vs number of sites ({results['machine']['cpu_count']} cores, "
                 f"{results['cpus_per_client']} CPU per ClientApp)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(results: dict, out: Path, command: str) -> str:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    text = table(results, command)
    (out / "results.md").write_text(text)
    if results["points"]:
        plot(results, out / "scaling.png")
    return text


def stored_point(results: dict, method: str, sites: int, run_config: dict, cpus_per_client: int) -> dict | None:
    """The point measured earlier with this run config and CPUs per ClientApp, if any (reused on re-run)."""
    point = results["points"].get(point_key(method, sites))
    if point and point["run_config"] == run_config and point["cpus_per_client"] == cpus_per_client:
        return point
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", default="5,10,20,50", help="comma-separated numbers of simulated sites")
    parser.add_argument("--methods", default="fednca,factory", help="comma-separated: fednca and/or factory")
    parser.add_argument("--fednca-config", default=FEDNCA_CONFIG, help="FedNCA-ML's run config (one round)")
    parser.add_argument("--factory-config", default=FACTORY_CONFIG, help="FederatedFactory's run config")
    parser.add_argument("--cpus-per-client", type=int, default=1, help="client-resources-num-cpus of every run")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per run")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    configs = {"fednca": args.fednca_config, "factory": args.factory_config}
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in configs]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; expected fednca and/or factory")
    run_configs = {m: parse_run_config(configs[m]) for m in methods}
    for method, run_config in run_configs.items():
        if run_config.get("method") != method:
            raise SystemExit(f"--{method}-config must set method='{method}', got {run_config.get('method')!r}")
        RunConfig.from_run_config(run_config)  # fail fast, before any simulation starts
    sizes = sorted({int(s) for s in args.sites.split(",")})
    command = (f"python -m bench.scaling --sites {args.sites} --methods {args.methods} "
               + "".join(f"--{m}-config \"{configs[m]}\" " for m in methods if configs[m] != parser.get_default(f"{m}_config"))
               + (f"--cpus-per-client {args.cpus_per_client} " if args.cpus_per_client != 1 else "") + f"--out {args.out}")

    args.out.mkdir(parents=True, exist_ok=True)
    stored = args.out / "results.json"
    results = json.loads(stored.read_text()) if stored.is_file() else {"points": {}}
    results.update(machine=machine(), cpus_per_client=args.cpus_per_client,
                   configs={**results.get("configs", {}), **{m: configs[m] for m in methods}})
    # sizes outermost: an interrupted run still has both methods at the smaller sizes
    pending = [(sites, method) for sites in sizes for method in methods
               if not stored_point(results, method, sites, run_configs[method], args.cpus_per_client)]
    print(f"== {len(sizes) * len(methods) - len(pending)} point(s) stored, {len(pending)} to run", flush=True)
    if pending:
        with SimulationSuperLink() as superlink:
            for sites, method in pending:
                print(f"== {method}, {sites} sites", flush=True)
                results["points"][point_key(method, sites)] = run_point(
                    superlink, run_configs[method], sites, args.cpus_per_client, args.out, args.timeout)
                write(results, args.out, command)
    print(write(results, args.out, command))


if __name__ == "__main__":
    main()
