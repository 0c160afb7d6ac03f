"""Side-by-side comparison of methods through real Flower simulations on identical partitions.

    python -m bench.compare --methods fedavg,fedprox,centralized \
        --run-config "mosaic-grid=2 partition='multilabel-skew' alpha=0.1" \
        --seeds 0,1,2 --num-sites 10 --out bench/results/NAME

Writes NAME/results.json ({method: {metric: [one value per seed]}}), NAME/results.md (mean ±
sd per metric), NAME/per_class.png, and every run's own results under NAME/runs/. Also times
one federated round against the same local training in a plain PyTorch loop (the framework's
overhead), measured in the same process and machine, back to back.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
import tomllib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedskew.config import RunConfig  # noqa: E402
from fedskew.data.sites import simulated_site  # noqa: E402
from fedskew.launch import SimulationSuperLink  # noqa: E402
from fedskew.client_tasks import train_site  # noqa: E402
from fedskew.models.build import build_model  # noqa: E402

SCALARS = {
    True: ("f1_macro", "f1_micro", "auc_macro", "auc_micro", "map"),
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


def run_dir(results_dir: Path) -> Path:
    dirs = sorted(p for p in results_dir.iterdir() if p.is_dir())
    if not dirs:
        raise RuntimeError(f"the run wrote no results under {results_dir}")
    return dirs[-1]


def plain_pytorch_round_seconds(cfg: RunConfig, num_sites: int) -> float:
    """The local training of one round, every site in turn, in a plain loop without Flower."""
    site0 = simulated_site(cfg, 0, num_sites)
    torch.manual_seed(cfg.seed)
    state = build_model(cfg, site0.num_classes, site0.train_images.shape[1:]).state_dict()
    start = time.perf_counter()
    for k in range(num_sites):
        train_site(cfg, simulated_site(cfg, k, num_sites), state, server_round=1)
    return time.perf_counter() - start


def summarise(values: list[float]) -> str:
    finite = [v for v in values if v is not None and np.isfinite(v)]
    if not finite:
        return "n/a"
    sd = statistics.stdev(finite) if len(finite) > 1 else 0.0
    return f"{statistics.mean(finite):.4f} ± {sd:.4f}"


def plot_per_class(per_class: dict[str, list[list[float]]], class_names: list[str], key: str, path: Path) -> None:
    methods = list(per_class)
    width = 0.8 / max(len(methods), 1)
    x = np.arange(len(class_names))
    fig, ax = plt.subplots(figsize=(max(6, len(class_names) * 0.9), 3.8))
    for i, method in enumerate(methods):
        values = np.nanmean(np.array(per_class[method], dtype=float), axis=0)
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=method)
    ax.set_xticks(x, class_names)
    ax.set(ylabel=f"{key} (mean over seeds)", ylim=(0, 1), title=key.replace("_", " "))
    ax.legend(ncol=len(methods), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", required=True, help="comma-separated, e.g. fedavg,fedprox,centralized")
    parser.add_argument("--run-config", default="", help="run-config overrides shared by every method")
    parser.add_argument("--method-config", action="append", default=[], metavar="NAME:METHOD:OVERRIDES",
                        help="an extra row: a named variant of a method, e.g. 'no-ladm:fednca:fednca.ladm=false'")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--num-sites", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed per run")
    args = parser.parse_args(argv)

    shared = parse_run_config(args.run_config)
    rows = {m: (m, {}) for m in args.methods.split(",") if m}
    for spec in args.method_config:
        name, method, overrides = spec.split(":", 2)
        rows[name] = (method, parse_run_config(overrides))
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)

    results: dict[str, dict[str, list]] = {}
    per_class: dict[str, list[list[float]]] = {}
    class_names: list[str] = []
    multilabel = False
    with SimulationSuperLink(args.out / "runs" / "flwr-home") as superlink:
        for name, (method, overrides) in rows.items():
            for seed in seeds:
                run_config = {**shared, **overrides, "method": method, "seed": seed,
                              "results-dir": str((args.out / "runs" / f"{name}-seed{seed}").resolve())}
                RunConfig.from_run_config(run_config)  # fail fast, before any simulation starts
                print(f"== {name} seed {seed}", flush=True)
                outcome = superlink.run_app(run_config, args.num_sites, timeout=args.timeout)
                if not outcome.completed:
                    raise SystemExit(f"{name} seed {seed} ended {outcome.status}:\n{outcome.output[-3000:]}")
                path = run_dir(Path(run_config["results-dir"]))
                summary = json.loads((path / "summary.json").read_text())
                rounds = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
                multilabel = "f1_macro" in summary["final"]
                class_names = json.loads((path / "partition.json").read_text())["class-names"]
                record = results.setdefault(name, {})
                for key in SCALARS[multilabel]:
                    record.setdefault(key, []).append(summary["final"][key])
                    record.setdefault(f"best_{key}", []).append(summary["best"][key])
                record.setdefault("wall_seconds", []).append(summary["wall_seconds"])
                record.setdefault("round_seconds", []).append(
                    statistics.mean(r["round_seconds"] for r in rounds if r["round"] > 0)
                )
                record.setdefault("bytes_total", []).append(
                    summary["bytes"]["sent_total"] + summary["bytes"]["received_total"]
                )
                per_class.setdefault(name, []).append(summary["final"][PER_CLASS[multilabel]])

    overhead = {}
    if "fedavg" in results:
        cfg = RunConfig.from_run_config({**shared, "method": "fedavg", "seed": seeds[0]})
        plain = plain_pytorch_round_seconds(cfg, args.num_sites)
        flower = results["fedavg"]["round_seconds"][0]
        overhead = {"flower_round_seconds": flower, "plain_pytorch_round_seconds": plain, "ratio": flower / plain}

    (args.out / "results.json").write_text(json.dumps({"methods": results, "overhead": overhead}, indent=2))
    keys = [k for k in SCALARS[multilabel]] + ["wall_seconds", "round_seconds", "bytes_total"]
    lines = [
        f"Command: `python -m bench.compare --methods {args.methods} --run-config \"{args.run_config}\" "
        + "".join(f"--method-config '{s}' " for s in args.method_config)
        + f"--seeds {args.seeds} --num-sites {args.num_sites} --out {args.out}`",
        "",
        f"Final-round test metrics, mean ± sd over seeds {args.seeds}:",
        "",
        "| method | " + " | ".join(keys) + " |",
        "|---" * (len(keys) + 1) + "|",
    ]
    for name, record in results.items():
        lines.append(f"| {name} | " + " | ".join(summarise(record[k]) for k in keys) + " |")
    if overhead:
        lines += ["", f"Framework overhead: one FedAvg round took {overhead['flower_round_seconds']:.2f} s in Flower "
                      f"vs {overhead['plain_pytorch_round_seconds']:.2f} s for the same local training in a plain "
                      f"PyTorch loop (ratio {overhead['ratio']:.2f}x)."]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    plot_per_class(per_class, class_names, PER_CLASS[multilabel], args.out / "per_class.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
