"""Accuracy against epsilon from two `bench.compare` outputs: FederatedFactory with DP generators
(accuracy and memorised share) and FedNCA-ML with central DP (macro-F1). Each row's epsilon is the
mean over its seeds; the rows without DP are drawn as dashed lines (epsilon infinite).

    python -m bench.privacy_tradeoff --factory bench/results/factory-dp --fednca bench/results/fednca-dp \
        --out bench/results/privacy-tradeoff.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def rows(results_dir: Path, metrics: tuple[str, ...]) -> list[dict]:
    """One entry per row of the comparison: its name, mean epsilon (None without DP), and each metric's
    mean and sd over the seeds that completed."""
    results = json.loads((results_dir / "results.json").read_text())
    out = []
    for name, record in results.items():
        epsilons = [e for e in record.get("epsilon", []) if e is not None]
        entry = {"name": name, "epsilon": float(np.mean(epsilons)) if epsilons else None, "n": len(record["wall_seconds"])}
        for metric in metrics:
            values = np.array([v for v in record.get(metric, []) if v is not None], dtype=float)
            entry[metric] = (float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0)
        out.append(entry)
    return out


def panel(ax, entries: list[dict], metric: str, label: str, colour: str) -> None:
    private = sorted((e for e in entries if e["epsilon"] is not None), key=lambda e: e["epsilon"])
    if private:
        ax.errorbar([e["epsilon"] for e in private], [e[metric][0] for e in private], yerr=[e[metric][1] for e in private],
                    marker="o", capsize=3, color=colour, label=f"{label} (DP)")  # fmt: skip
    for e in entries:
        if e["epsilon"] is None:
            ax.axhline(e[metric][0], ls="--", color=colour, alpha=0.6, label=f"{label}, no DP")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factory", type=Path, required=True, help="bench.compare output of the factory rows")
    parser.add_argument("--fednca", type=Path, required=True, help="bench.compare output of the fednca rows")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    factory = rows(args.factory, ("accuracy", "memorized_share"))
    fednca = rows(args.fednca, ("f1_macro",))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    panel(left, factory, "accuracy", "test accuracy", "tab:blue")
    panel(left, factory, "memorized_share", "memorised share", "tab:red")
    left.set(xscale="log", xlabel="epsilon (largest generator's)", ylim=(0, 1), title="factory, single-class digit silos")
    panel(right, fednca, "f1_macro", "macro-F1", "tab:green")
    right.set(xscale="log", xlabel="epsilon (one site's data)", ylim=(0, 1), title="fednca, digits mosaic")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    for entries, metrics in ((factory, ("accuracy", "memorized_share")), (fednca, ("f1_macro",))):
        for e in entries:
            eps = "no DP" if e["epsilon"] is None else f"epsilon {e['epsilon']:.2f}"
            shown = ", ".join(f"{m} {e[m][0]:.3f} ± {e[m][1]:.3f}" for m in metrics)
            print(f"{e['name']}: {eps}, {shown} (n={e['n']})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
