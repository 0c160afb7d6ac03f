"""Side-by-side comparison of methods through real Flower simulations on identical partitions.

    python -m bench.compare --methods fedavg,fedprox,centralized \
        --run-config "mosaic-grid=2 partition='multilabel-skew' alpha=0.1" \
        --seeds 0,1,2 --num-sites 10 --out bench/results/NAME

Writes NAME/results.json ({method: {metric: [one value per seed]}, at the round each run's validation
selected, and final_METRIC at its last round}), NAME/results.md (mean ± sd per metric, the final round's
beside it where it differs), NAME/per_class.png, NAME/overhead.json, and every run's own results under
NAME/runs/. With fedavg among the methods it also measures the framework's overhead: one more FedAvg
run in Flower with --workers ClientApps at a time, its steady-state round clocked in wall and CPU
seconds (every process of the run), then the same round's work in a plain PyTorch loop with --workers
worker processes, back to back on the same machine; --overhead-repeats such pairs (0: none), and the median
ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shlex
import shutil
import statistics
import subprocess
import time
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedskew.config import RunConfig, current_run_config  # noqa: E402
from fedskew.methods import method_named  # noqa: E402
from fedskew.client_tasks import evaluate_site, train_site  # noqa: E402
from fedskew.data.sites import load_task_dataset, simulated_site  # noqa: E402
from fedskew.testing.launch import ProcessTreeCPU, SimulationSuperLink  # noqa: E402
from fedskew.models.build import build_model  # noqa: E402
from fedskew.report import write_report as write_html_report  # noqa: E402
from fedskew.training import evaluate, pick_device  # noqa: E402

SCALARS = {
    # f1_* at the round's decision threshold (chosen on validation unless run-config threshold fixes it);
    # f1_macro_at_0.5 at the fixed 0.5 of runs before it was chosen (n/a for runs that predate it).
    True: ("f1_macro", "f1_macro_at_0.5", "f1_micro", "auc_macro", "auc_micro", "map"),
    False: ("accuracy", "balanced_accuracy", "auroc_macro"),
}
PER_CLASS = {True: "per_class_f1", False: "per_class_recall"}


def parse_run_config(text: str) -> dict:
    """`k=v k2='s'` (TOML values, as `flwr run --run-config` takes them) -> dict."""
    pairs = re.findall(r"""([\w.-]+)=('[^']*'|"[^"]*"|\S+)""", text)
    leftover = re.sub(r"""([\w.-]+)=('[^']*'|"[^"]*"|\S+)""", "", text).strip()
    if leftover:
        raise SystemExit(f"--run-config: cannot parse {leftover!r}; expected key=value pairs, strings quoted")
    return {key: tomllib.loads(f"v = {value}")["v"] for key, value in pairs}


def _cpu_timed(function, *args):
    """function(*args) and the CPU seconds this process spent in it (a worker's share of a round)."""
    start = time.process_time()
    result = function(*args)
    return result, time.process_time() - start


def _one_thread() -> None:
    torch.set_num_threads(1)


def plain_pytorch_round(cfg: RunConfig, num_sites: int, workers: int, rounds: int) -> dict[str, float]:
    """FedAvg rounds' work without Flower, at the parallelism the Flower run had: the sites train and
    validate in `workers` processes of one torch thread each (as Ray runs `workers` ClientApps with
    client-resources-num-cpus=1), the weights are averaged and the global model is evaluated on the test
    split here. The worker processes are started and warm before the clock starts, as Ray's ClientApp
    actors are after the first round. Returns the mean over `rounds` rounds of wall and CPU seconds (this
    process and the workers)."""
    _one_thread()
    sites = [simulated_site(cfg, k, num_sites) for k in range(num_sites)]
    test = load_task_dataset(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, sites[0].num_classes, sites[0].train_images.shape[1:])
    state = model.state_dict()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "fedskew.client_tasks"])
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread) as pool:
        list(pool.map(time.sleep, [0.5] * workers))  # every worker started (each sleeps long enough to take one)
        wall, cpu, worker_cpu = time.perf_counter(), time.process_time(), 0.0
        for server_round in range(1, rounds + 1):
            trained = [f.result() for f in [pool.submit(_cpu_timed, _train_site, cfg, site, state, server_round)
                                            for site in sites]]
            updates = [result for result, _ in trained]
            weights = np.array([m["num-examples"] for _, m in updates], dtype=np.float64)
            state = {k: sum(w * u[k].double() for w, (u, _) in zip(weights / weights.sum(), updates)).to(state[k].dtype)
                     for k in state}
            evaluated = [f.result() for f in [pool.submit(_cpu_timed, evaluate_site, cfg, site, state) for site in sites]]
            model.load_state_dict(state)
            evaluate(model, test.test_images, test.test_labels, device=pick_device(cfg.device))
            worker_cpu += sum(seconds for _, seconds in trained + evaluated)
        wall = time.perf_counter() - wall
        server_cpu = time.process_time() - cpu
    return {"wall_seconds": wall / rounds, "cpu_seconds": (server_cpu + worker_cpu) / rounds, "workers": workers,
            "rounds": rounds, "cpu_seconds_server": server_cpu / rounds, "cpu_seconds_sites": worker_cpu / rounds}


def _train_site(cfg: RunConfig, site, state: dict, server_round: int) -> tuple[dict, dict]:
    return train_site(cfg, site, state, server_round=server_round, proximal_mu=0.0)


ROUND_LINE = re.compile(r"^\[\w[\w-]*\] round\s+(\d+) \|")


class RoundClock:
    """Wall and CPU time (every process of the Flower run) at each `[method] round k |` line of the run's
    stream; the steady-state round is the mean from round 1's line to the last round's, so the ClientApps'
    start-up (in round 1) is left out, as on the plain side."""

    def __init__(self, cpu: ProcessTreeCPU):
        self.cpu, self.marks = cpu, {}

    def __call__(self, line: str) -> None:
        match = ROUND_LINE.match(line)
        if match:
            self.marks[int(match.group(1))] = (time.perf_counter(), self.cpu.sample(), self.cpu.by_process())

    def steady_round(self) -> dict[str, float]:
        last = max(self.marks, default=0)
        if 1 not in self.marks or last < 2:
            raise SystemExit("the overhead figure needs a fedavg run of at least 2 rounds (num-server-rounds >= 2)")
        (wall1, cpu1, by_process1), (wall, cpu, by_process) = self.marks[1], self.marks[last]
        rounds = last - 1
        shares = {name: (seconds - by_process1.get(name, 0.0)) / rounds for name, seconds in by_process.items()}
        return {"wall_seconds": (wall - wall1) / rounds, "cpu_seconds": (cpu - cpu1) / rounds, "rounds": rounds,
                "cpu_seconds_by_process": dict(sorted(shares.items(), key=lambda item: -item[1]))}


# How a column is shown: (header, scale, decimals); metrics keep 4 decimals.
DISPLAY = {
    "wall_seconds": ("wall_seconds", 1, 1),
    "round_seconds": ("round_seconds", 1, 2),
    "bytes_total": ("MB_moved", 1e-6, 1),
    "round_time_vs_fedavg": ("round_time_vs_fedavg", 1, 2),
    "epsilon": ("epsilon", 1, 2),
    "memorized_share": ("memorized_share", 1, 3),
    "threshold": ("threshold", 1, 2),
}


def run_epsilon(summary: dict) -> float | None:
    """The run's epsilon: the privacy record's (dp.*, or DP generators), else the largest of the factory
    generators' own (each image is in one generator); None without DP."""
    if "privacy" in summary:
        return summary["privacy"]["epsilon"]
    declared = [m["privacy"]["epsilon"] for m in summary.get("factory", {}).get("modules", []) if "privacy" in m]
    return max(declared) if declared else None


def memorized_share(summary: dict) -> float | None:
    """FederatedFactory: the mean over the uploaded generators of their audit's memorised share; None otherwise."""
    shares = [m["memorization"] for m in summary.get("factory", {}).get("modules", [])]
    return float(np.nanmean(shares)) if shares else None


def summarise(values: list[float], scale: float = 1.0, decimals: int = 4) -> str:
    """mean ± sd over seeds; a single seed is shown as its value (an sd of 0 would claim a spread)."""
    finite = [v * scale for v in values if v is not None and np.isfinite(v)]
    if not finite:
        return "n/a"
    if len(finite) == 1:
        return f"{finite[0]:.{decimals}f}"
    return f"{statistics.mean(finite):.{decimals}f} ± {statistics.stdev(finite):.{decimals}f}"


def metric_cell(record: dict[str, list], key: str) -> str:
    """A results.md cell: the value at the selected round, with the final round's in brackets where it differs;
    the selected rounds themselves one per seed (a mean round would be a round no run chose)."""
    if key == "selected_round":
        return ", ".join(map(str, record[key]))
    cell = summarise(record[key], *DISPLAY.get(key, (key, 1.0, 4))[1:])
    final = record.get(f"final_{key}")
    if final is not None and final != record[key]:
        cell += f" (final {summarise(final, *DISPLAY.get(key, (key, 1.0, 4))[1:])})"
    return cell


def plot_per_class(per_class: dict[str, list[list[float]]], class_names: list[str], key: str, path: Path) -> None:
    methods = list(per_class)
    width = 0.8 / max(len(methods), 1)
    x = np.arange(len(class_names))
    fig, ax = plt.subplots(figsize=(max(6, len(class_names) * 0.9), 4.4))
    for i, method in enumerate(methods):
        values = np.nanmean(np.array(per_class[method], dtype=float), axis=0)
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=method)
    ax.set_xticks(x, class_names)
    ax.set(xlabel="class", ylabel=f"{key} (mean over seeds)", ylim=(0, 1), title=key.replace("_", " "))
    ax.legend(ncol=min(len(methods), 4), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


OVERHEAD_REPEATS = 3  # pairs behind the overhead figure unless --overhead-repeats says otherwise


def reads_key(method: str, key: str) -> bool:
    """Whether a run of `method` depends on `key`: only FederatedFactory's methods read `factory.*`, so a
    baseline run stays reusable when a factory default changes."""
    return not key.startswith("factory.") or method_named(method).family == "factory"


def completed_run(results_dir: Path, run_config: dict) -> Path | None:
    """The run directory under `results_dir` if it holds a completed run of `run_config` (reused on a
    re-invocation). A completed run made with other settings stops the comparison: reusing it would put
    another experiment's numbers in this table."""
    if not results_dir.is_dir():
        return None
    wanted = RunConfig.from_run_config(run_config).to_run_config()
    for path in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        summary = path / "summary.json"
        if not (summary.is_file() and json.loads(summary.read_text())["status"] == "completed"):
            continue
        try:
            saved = current_run_config(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path} holds a completed run whose config.json cannot be read ({type(exc).__name__}: "
                             f"{exc}); delete that run to redo it, or give this comparison another --out") from None
        differing = [f"{key}: {saved.get(key)!r} there, {value!r} now" for key, value in wanted.items()
                     if key != "results-dir" and saved.get(key) != value and reads_key(wanted["method"], key)]
        if differing:
            raise SystemExit(f"{path} holds a completed run with other settings ({'; '.join(differing)}); "
                             "give this comparison another --out, or delete that run to redo it")
        return path
    return None


def collect(runs: dict[tuple[str, int], Path]):
    """Per-row metric lists (one value per seed) and per-class values from completed runs."""
    results: dict[str, dict[str, list]] = {}
    per_class: dict[str, list[list[float]]] = {}
    class_names, multilabel = [], False
    for (name, _seed), path in runs.items():
        summary = json.loads((path / "summary.json").read_text())
        rounds = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        multilabel = "f1_macro" in summary["final"]
        class_names = json.loads((path / "partition.json").read_text())["class-names"]
        record = results.setdefault(name, {})
        # Each method at the round its validation chose (test metrics only reported there), the final round beside it.
        selected = summary["best"] or summary["final"]
        record.setdefault("selected_round", []).append(summary["best_round"] or summary["rounds_completed"])
        for key in SCALARS[multilabel]:
            record.setdefault(key, []).append(selected.get(key))
            record.setdefault(f"final_{key}", []).append(summary["final"].get(key))
        if multilabel:  # the selected round's decision threshold (chosen on validation for that round)
            record.setdefault("threshold", []).append(summary.get("threshold", rounds[-1].get("threshold")))
        record.setdefault("wall_seconds", []).append(summary["wall_seconds"])
        record.setdefault("round_seconds", []).append(statistics.mean(r["round_seconds"] for r in rounds if r["round"] > 0))
        record.setdefault("bytes_total", []).append(summary["bytes"]["sent_total"] + summary["bytes"]["received_total"])
        # differential privacy: the epsilon spent (a row without DP has none: n/a)
        record.setdefault("epsilon", []).append(run_epsilon(summary))
        record.setdefault("memorized_share", []).append(memorized_share(summary))
        per_class.setdefault(name, []).append(selected[PER_CLASS[multilabel]])
    return results, per_class, class_names, multilabel


def shell_quote(argument: str) -> str:
    """`argument` as one shell word a reader can paste: in double quotes where nothing inside is special to
    them (run-config strings hold single-quoted values), else POSIX single-quote escaping."""
    return f'"{argument}"' if not set(argument) & set('"$`\\!') else shlex.quote(argument)


def write_report(args, runs: dict[tuple[str, int], Path], overhead: dict) -> str:
    """results.json / results.md / per_class.png from every completed run so far."""
    results, per_class, class_names, multilabel = collect(runs)
    keys = (list(SCALARS[multilabel]) + (["threshold"] if multilabel else [])
            + ["selected_round", "wall_seconds", "round_seconds", "bytes_total"])
    for key in ("epsilon", "memorized_share"):
        if any(v is not None for record in results.values() for v in record[key]):
            keys.append(key)
    if "fedavg" in results:
        keys.append("round_time_vs_fedavg")
        fedavg_round = statistics.mean(results["fedavg"]["round_seconds"])
        for record in results.values():
            record["round_time_vs_fedavg"] = [statistics.mean(record["round_seconds"]) / fedavg_round]
    seeds_done = sorted({seed for _, seed in runs})
    lines = [
        f"Command: `python -m bench.compare --methods {args.methods} --run-config {shell_quote(args.run_config)} "
        + "".join(f"--method-config {shell_quote(s)} " for s in args.method_config)
        + f"--seeds {args.seeds} "
        + (f"--variant-seeds {args.variant_seeds} " if args.variant_seeds else "")
        + (f"--overhead-repeats {args.overhead_repeats} " if args.overhead_repeats != OVERHEAD_REPEATS else "")
        + f"--num-sites {args.num_sites} --out {args.out}`",
        "",
        f"Test metrics at the round each run's validation selected (selected_round; the test split never chooses), "
        f"with the final round's in brackets where it differs; mean ± sd over the seeds completed "
        f"({', '.join(map(str, seeds_done))}; n per row in the last column; a single value where n = 1). MB_moved: "
        "bytes sent + received by the server, all sites, whole run.",
        "",
        "| method | " + " | ".join(DISPLAY.get(k, (k,))[0] for k in keys) + " | n |",
        "|---" * (len(keys) + 2) + "|",
    ]
    for name, record in results.items():
        cells = [metric_cell(record, k) for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {len(record['wall_seconds'])} |")
    if overhead:
        pairs = overhead["pairs"]
        plain, flower = pairs[0]["plain_pytorch"], pairs[0]["flower"]
        lines += ["", f"Framework overhead at equal parallelism ({plain['workers']} sites at a time, one torch thread "
                      f"each), {len(pairs)} pair(s) of runs back to back: a steady-state FedAvg round (mean of rounds "
                      f"2-{flower['rounds'] + 1}, every process of the run) in Flower vs the same work (every site trains "
                      "and validates, weights averaged, test evaluation) in a plain PyTorch loop with "
                      f"{plain['workers']} worker processes.", "",
                      "| pair | Flower wall s | plain wall s | wall ratio | Flower CPU s | plain CPU s | CPU ratio |",
                      "|---|---|---|---|---|---|---|"]
        lines += [f"| {i} | {p['flower']['wall_seconds']:.2f} | {p['plain_pytorch']['wall_seconds']:.2f} | "
                  f"{p['wall_ratio']:.2f} | {p['flower']['cpu_seconds']:.2f} | {p['plain_pytorch']['cpu_seconds']:.2f} | "
                  f"{p['cpu_ratio']:.2f} |" for i, p in enumerate(pairs, 1)]
        lines += ["", f"Median ratio: {overhead['wall_ratio']:.2f}x wall, **{overhead['cpu_ratio']:.2f}x CPU**."]
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    plot_per_class(per_class, class_names, PER_CLASS[multilabel], args.out / "per_class.png")
    return "\n".join(lines)


def _wait_for_exit(pids, timeout: float = 60.0) -> None:
    """Until every process of the Flower run (Ray's included) has gone, so that its teardown does not run
    beside the plain loop's clock."""
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)


def flower_rounds(args, run_config: dict) -> dict:
    """A fresh FedAvg run in Flower with its rounds clocked (wall and CPU of every process of the run)."""
    results_dir = args.out / "overhead-run"
    shutil.rmtree(results_dir, ignore_errors=True)
    with SimulationSuperLink() as superlink, ProcessTreeCPU(superlink.process.pid) as cpu:
        clock = RoundClock(cpu)
        outcome = superlink.run_app({**run_config, "results-dir": str(results_dir.resolve())}, args.num_sites,
                                    timeout=args.timeout, ray_cpus=args.workers, echo=True, on_line=clock)
        if not outcome.completed:
            raise SystemExit(f"overhead run ended {outcome.status}:\n{outcome.output[-3000:]}")
    _wait_for_exit(list(cpu.seen))
    return clock.steady_round()


def measure_overhead(args, run_config: dict) -> dict:
    """--overhead-repeats pairs, each a fresh FedAvg run in Flower and then the same rounds' work in a plain
    PyTorch loop at the same parallelism, back to back; the figure is the median of the pairs' ratios, since
    one pair's ratio moves by about 0.1 from run to run on a small machine."""
    cfg = RunConfig.from_run_config(run_config)
    pairs = []
    for repeat in range(1, args.overhead_repeats + 1):
        print(f"== overhead {repeat}/{args.overhead_repeats}: fedavg in Flower, {args.workers} ClientApps at a time",
              flush=True)
        flower = flower_rounds(args, run_config)
        print(f"== overhead {repeat}/{args.overhead_repeats}: the same rounds in a plain PyTorch loop, "
              f"{args.workers} worker processes", flush=True)
        plain = plain_pytorch_round(cfg, args.num_sites, min(args.workers, args.num_sites), flower["rounds"])
        pairs.append({"flower": flower, "plain_pytorch": plain, "wall_ratio": flower["wall_seconds"] / plain["wall_seconds"],
                      "cpu_ratio": flower["cpu_seconds"] / plain["cpu_seconds"]})
        print(f"   ratio {pairs[-1]['wall_ratio']:.2f}x wall, {pairs[-1]['cpu_ratio']:.2f}x CPU", flush=True)
    return {"pairs": pairs, "wall_ratio": statistics.median(p["wall_ratio"] for p in pairs),
            "cpu_ratio": statistics.median(p["cpu_ratio"] for p in pairs)}


def run_in_flower(superlink, label: str, run_config: dict, num_sites: int, timeout: float, out: Path) -> None:
    """One Flower run of the comparison; SystemExit naming the run and what to do when it fails or runs past
    `timeout` (the runs finished before it stay in OUT's table and are reused by a re-run)."""
    try:
        outcome = superlink.run_app(run_config, num_sites, timeout=timeout, echo=True)
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"{label} did not finish within --timeout {timeout:g} s and was stopped; what it wrote is in "
            f"{run_config['results-dir']}. The runs finished before it are in {out / 'results.md'} and are reused "
            "when the same command runs again with a larger --timeout (FederatedFactory with wider or longer-trained "
            "generators can need several hours on a CPU)."
        ) from None
    if not outcome.completed:
        raise SystemExit(f"{label} ended {outcome.status}:\n{outcome.output[-3000:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", required=True, help="comma-separated, e.g. fedavg,fedprox,centralized")
    parser.add_argument("--run-config", default="", help="run-config overrides shared by every method")
    parser.add_argument("--method-config", action="append", default=[], metavar="NAME:METHOD:OVERRIDES",
                        help="an extra row: a named variant of a method, e.g. 'no-ladm:fednca:fednca.ladm=false'")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variant-seeds", default=None,
                        help="seeds for the --method-config rows (default: --seeds); they run after every main row")
    parser.add_argument("--num-sites", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per run")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="the overhead figure's parallelism: ClientApps at a time in Flower (init-args-num-cpus, one "
                             "CPU per ClientApp) and worker processes in the plain loop (default: the machine's cores)")
    parser.add_argument("--overhead-repeats", type=int, default=OVERHEAD_REPEATS,
                        help="pairs of runs (Flower, then the plain loop) behind the overhead figure; it is their median "
                             "(0: no overhead figure)")
    args = parser.parse_args(argv)
    if args.overhead_repeats < 0:
        parser.error(f"--overhead-repeats must be 0 (no overhead figure) or more, got {args.overhead_repeats}")

    shared = parse_run_config(args.run_config)
    seeds = [int(s) for s in args.seeds.split(",")]
    variant_seeds = [int(s) for s in (args.variant_seeds or args.seeds).split(",")]
    rows = {m: (m, {}) for m in args.methods.split(",") if m}
    main_rows = list(rows)
    for spec in args.method_config:
        name, method, overrides = spec.split(":", 2)
        rows[name] = (method, parse_run_config(overrides))
    variant_rows = [name for name in rows if name not in main_rows]
    # Main rows first, seeds outermost, then the variants: an interrupted comparison still has
    # every main row for the seeds it finished.
    order = [(n, seed) for seed in seeds for n in main_rows] + [(n, seed) for seed in variant_seeds for n in variant_rows]
    args.out.mkdir(parents=True, exist_ok=True)
    configs = {
        (name, seed): {**shared, **rows[name][1], "method": rows[name][0], "seed": seed,
                       "results-dir": str((args.out / "runs" / f"{name}-seed{seed}").resolve())}
        for name, seed in order
    }
    for run_config in configs.values():
        RunConfig.from_run_config(run_config)  # fail fast, before any simulation starts

    # Completed runs found under --out are reused, so re-running the command resumes it.
    runs: dict[tuple[str, int], Path] = {}
    with SimulationSuperLink() as superlink:  # its FLWR_HOME in a temp dir: never inside the app (the FAB)
        for (name, seed), run_config in configs.items():
            done = completed_run(Path(run_config["results-dir"]), run_config)
            if done is None:
                print(f"== {name} seed {seed}", flush=True)
                run_in_flower(superlink, f"{name} seed {seed}", run_config, args.num_sites, args.timeout, args.out)
                done = completed_run(Path(run_config["results-dir"]), run_config)
            else:
                print(f"== {name} seed {seed}: reusing {done}", flush=True)
            runs[(name, seed)] = done
            write_report(args, runs, {})

    overhead = {}
    if "fedavg" in rows and args.overhead_repeats:
        overhead = measure_overhead(args, {**shared, "method": "fedavg", "seed": seeds[0]})
        (args.out / "overhead.json").write_text(json.dumps(overhead, indent=2))
    print(write_report(args, runs, overhead))
    print(f"side-by-side page: {write_html_report(args.out)}")


if __name__ == "__main__":
    main()
