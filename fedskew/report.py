"""`report.html`: one self-contained page per results directory, for a browser and nothing else.

A run's page shows its config, the partition (label counts per site, and per-site co-occurrence for
multi-label data), learning curves (training loss, the sites' validation metrics, test metrics), the
per-class test metrics at the selected round, bytes per site, and for FederatedFactory runs the
class sample grids and each generator's memorisation score. A `python -m bench.compare` output
folder gets one page with every method side by side. Everything is read from the files the run
wrote, so a page can be rebuilt at any time (`fedskew report DIR`); figures are PNGs embedded as
base64 and the page has no script, so it opens from disk, offline, anywhere.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from fedskew.data.plots import plot_cooccurrence, plot_label_counts
from fedskew.results import HEADLINE, scalar_metrics

REPORT = "report.html"
PER_CLASS = {True: ("per_class_f1", "per_class_auc"), False: ("per_class_recall",)}
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; background: #fff; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; }
img { max-width: 100%; display: block; margin: 0.5em 0; }
.status-completed { color: #176b2c; } .status-failed { color: #a11; } .status-running { color: #a60; }
details { margin: 0.5em 0; }
"""


class ReportError(ValueError):
    """The folder is neither a run directory nor a bench.compare output; the message says what it needs."""


# --- reading -----------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _read_rounds(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _is_multilabel(rounds: list[dict]) -> bool:
    return any("f1_macro" in r["test"] for r in rounds)


# --- figures -----------------------------------------------------------------------------------------


def _png(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode()


def _img(data: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _file_img(path: Path, alt: str) -> str:
    return _img(base64.b64encode(path.read_bytes()).decode(), alt) if path.is_file() else ""


def _curves(series: dict[str, dict[str, list[tuple[int, float]]]]) -> str:
    """One panel per group (train / validation / test), one line per metric."""
    groups = {name: lines for name, lines in series.items() if lines}
    if not groups:
        return ""
    figure = Figure(figsize=(4.2 * len(groups), 3.4), layout="constrained")
    for axes, (name, lines) in zip(figure.subplots(1, len(groups), squeeze=False)[0], groups.items()):
        for label, points in lines.items():
            axes.plot(*zip(*points), marker="o", markersize=3, label=label)
        axes.set(title=name, xlabel="round")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    return _img(_png(figure), "learning curves")


def _bars(values: dict[str, list[float]], labels: list[str], title: str, ylabel: str) -> str:
    """Grouped bars: one group per label, one bar per series."""
    if not values or not labels:
        return ""
    figure = Figure(figsize=(max(6.0, 0.7 * len(labels) + 2), 3.6), layout="constrained")
    axes = figure.add_subplot()
    width = 0.8 / len(values)
    x = np.arange(len(labels))
    for i, (name, series) in enumerate(values.items()):
        axes.bar(x + (i + 0.5) * width - 0.4, [np.nan if v is None else v for v in series], width, label=name)
    axes.set_xticks(x, labels, rotation=45 if max(len(s) for s in labels) > 3 else 0, fontsize=8)
    axes.set(title=title, ylabel=ylabel)
    axes.grid(axis="y", alpha=0.3)
    axes.margins(y=0.15)  # room for the legend above the tallest bar
    axes.legend(fontsize=7, ncols=min(len(values), 4), loc="upper center")
    return _img(_png(figure), title)


def _partition_figures(partition: dict) -> str:
    """The label-count heatmap and, for multi-label data, per-site co-occurrence, drawn from partition.json."""
    sites, names = partition.get("sites", []), [str(n) for n in partition.get("class-names", [])]
    if not sites or not names:
        return "<p>No partition recorded.</p>"
    counts = np.array([s["label-counts"] for s in sites])
    with tempfile.TemporaryDirectory() as tmp:
        parts = [_file_img(plot_label_counts(counts, names, Path(tmp) / "counts.png", "training labels per site"),
                           "training labels per site")]  # fmt: skip
        if all("cooccurrence" in s for s in sites):
            matrices = [np.array(s["cooccurrence"]) for s in sites]
            parts.append(_file_img(plot_cooccurrence(matrices, names, Path(tmp) / "co.png"), "label co-occurrence per site"))
    return "".join(parts)


# --- html --------------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.4g}"
    if value is None:
        return "n/a"
    return html.escape(str(value))


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n")  # fmt: skip


# --- one run -----------------------------------------------------------------------------------------


def run_report(run_dir: Path) -> str:
    summary = _read_json(run_dir / "summary.json") or {}
    config = _read_json(run_dir / "config.json") or {}
    partition = _read_json(run_dir / "partition.json") or {}
    rounds = _read_rounds(run_dir)
    multilabel = _is_multilabel(rounds)
    names = [str(n) for n in partition.get("class-names", [])]
    status = str(summary.get("status", "unknown"))
    body = [f'<p>Status: <b class="status-{html.escape(status)}">{html.escape(status)}</b>'
            + (f" ({html.escape(str(summary['reason']))})" if summary.get("reason") else "")
            + f"; method <b>{_fmt(config.get('method', summary.get('method')))}</b> on <b>{_fmt(summary.get('data', config.get('dataset')))}</b>; "
            f"{_fmt(summary.get('rounds_completed'))} rounds; {_fmt(summary.get('wall_seconds'))} s.</p>"]  # fmt: skip

    selected = summary.get("best_round") or (rounds[-1]["round"] if rounds else None)
    selected_round = next((r for r in rounds if r["round"] == selected), None)
    final = summary.get("final") or {}
    headline = [k for k in HEADLINE[multilabel] if k in final]
    if headline:
        rows = [["final round"] + [final.get(k) for k in headline]]
        if summary.get("best"):
            rows.append([f"selected round {selected}"] + [summary["best"].get(k) for k in headline])
        body.append("<h2>Test metrics</h2>" + _table(["", *headline], rows))

    series: dict[str, dict[str, list[tuple[int, float]]]] = {"training": {}, "validation (sites)": {}, "test": {}}
    for r in rounds:
        for group, split in (("training", "train"), ("validation (sites)", "val"), ("test", "test")):
            for key, value in scalar_metrics(r.get(split, {})).items():
                if key.endswith("seconds") or (split == "test" and key not in HEADLINE[multilabel]):
                    continue  # timings and the long tail of test metrics are in the tables, not the curves
                series[group].setdefault(key, []).append((r["round"], value))
    body.append("<h2>Learning curves</h2>" + (_curves(series) or "<p>No rounds recorded.</p>"))

    if selected_round:
        per_class = {k: selected_round["test"][k] for k in PER_CLASS[multilabel] if k in selected_round["test"]}
        labels = names or [str(i) for i in range(len(next(iter(per_class.values()), [])))]
        body.append(f"<h2>Per-class test metrics at round {selected}</h2>"
                    + _bars(per_class, labels, f"per-class test metrics, round {selected}", "score"))  # fmt: skip

    body.append("<h2>Partition</h2>" + _partition_figures(partition))

    traffic = summary.get("bytes") or {}
    site_ids = summary.get("site_ids") or {}  # node id -> the site id it declared in the survey
    sites = sorted(set(traffic.get("sent_per_site", {})) | set(traffic.get("received_per_site", {})), key=_site_order)
    if sites:
        megabytes = {direction: [traffic.get(f"{direction}_per_site", {}).get(s, 0) / 1e6 for s in sites]
                     for direction in ("sent", "received")}  # fmt: skip
        body.append("<h2>Bytes per site</h2>"
                    + f"<p>Sent to the sites {traffic.get('sent_total', 0) / 1e6:.2f} MB, received "
                    f"{traffic.get('received_total', 0) / 1e6:.2f} MB (serialised message contents).</p>"
                    + _bars(megabytes, [_site_label(s, site_ids) for s in sites], "MB per site (server's view)", "MB"))  # fmt: skip
    if summary.get("dropped"):
        body.append("<h2>Dropped sites</h2>" + _table(["round", "site", "reason"], [
            [d.get("round"), _site_label(str(d.get("site")), site_ids), d.get("reason")] for d in summary["dropped"]]))  # fmt: skip

    body.append(_factory_section(run_dir, summary))
    config_rows = [[key, json.dumps(value)] for key, value in sorted(config.items())]
    body.append("<h2>Run config</h2><details open><summary>every key</summary>" + _table(["key", "value"], config_rows) + "</details>")
    return _page(f"fedskew run {run_dir.name}", "\n".join(body))


def _site_label(site: str, site_ids: dict) -> str:
    # Simulation and deployment key the byte counts and dropouts by Flower's node id, a long number; the
    # site id the node declared in its survey goes beside it.
    node = f"node …{site[-6:]}" if len(site) > 8 else f"node {site}"
    if site in site_ids:
        return f"site {site_ids[site]} ({node})"
    return node if len(site) > 8 else f"site {site}"


def _site_order(site: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", site)
    return (int(digits) if digits else 0, site)


def _factory_section(run_dir: Path, summary: dict) -> str:
    factory = summary.get("factory")
    if not factory:
        return ""
    parts = ["<h2>FederatedFactory</h2>"]
    modules = factory.get("modules", [])
    if modules:
        parts.append("<p>Memorisation score: share of audit samples whose nearest training image is closer than 1/3 of "
                     "their distance to the nearest held-out image (n/a: not audited).</p>")
        parts.append(_table(["module", "site", "classes", "training images", "memorisation"],
                            [[m.get("module-id"), m.get("site-id"), m.get("classes"), m.get("image-counts"),
                              m.get("memorization")] for m in modules]))  # fmt: skip
    if factory.get("rejected"):
        parts.append("<p>Rejected uploads:</p><pre>" + html.escape(json.dumps(factory["rejected"], indent=1)) + "</pre>")
    if factory.get("missing_class_names"):
        parts.append(f"<p>Classes without a generator: {_fmt(factory['missing_class_names'])}</p>")
    samples = run_dir / "samples"
    grid = samples / "all-classes.png"
    if grid.is_file():
        parts.append("<h3>Synthetic samples, one row per class</h3>" + _file_img(grid, "synthetic samples"))
    else:
        parts += [_file_img(p, p.stem) for p in sorted(samples.glob("class-*.png"))]
    return "".join(parts)


# --- a bench.compare output folder -------------------------------------------------------------------


def comparison_runs(folder: Path) -> dict[str, list[Path]]:
    """Completed or not, every run under `folder/runs/<name>-seed<k>/`, grouped by method row name."""
    rows: dict[str, list[Path]] = {}
    for summary in sorted((folder / "runs").glob("*/*/summary.json")):
        match = re.fullmatch(r"(.+)-seed(\d+)", summary.parent.parent.name)
        if match:
            rows.setdefault(match.group(1), []).append(summary.parent)
    return rows


def comparison_report(folder: Path) -> str:
    rows = comparison_runs(folder)
    all_rounds = {name: [_read_rounds(run) for run in runs] for name, runs in rows.items()}
    multilabel = any(_is_multilabel(r) for runs in all_rounds.values() for r in runs)
    key = HEADLINE[multilabel][0]
    body = []
    table = (folder / "results.md").read_text() if (folder / "results.md").is_file() else ""
    if table:
        body.append("<h2>Results</h2>" + _markdown_tables(table))
    finals = []
    for name, runs in rows.items():
        summaries = [_read_json(run / "summary.json") or {} for run in runs]
        values = [s["final"][key] for s in summaries if s.get("final") and isinstance(s["final"].get(key), float)]
        finals.append([name, len(runs), sum(s.get("status") == "completed" for s in summaries),
                       statistics.mean(values) if values else None, statistics.stdev(values) if len(values) > 1 else None])  # fmt: skip
    body.append(f"<h2>Final {key} per method</h2>" + _table(["method", "runs", "completed", f"mean {key}", "sd"], finals))
    curves = {}
    for name, runs in all_rounds.items():
        by_round: dict[int, list[float]] = {}
        for run in runs:
            for r in run:
                if isinstance(r["test"].get(key), float):
                    by_round.setdefault(r["round"], []).append(r["test"][key])
        curves[f"{name}"] = [(rnd, statistics.mean(v)) for rnd, v in sorted(by_round.items())]
    body.append(f"<h2>Test {key} per round (mean over seeds)</h2>" + _curves({f"test {key}": curves}))
    per_class_key = PER_CLASS[multilabel][0]
    per_class = {}
    for name, runs in all_rounds.items():
        finals_per_class = [run[-1]["test"][per_class_key] for run in runs if run and per_class_key in run[-1]["test"]]
        if finals_per_class:
            per_class[name] = list(np.nanmean(np.array(finals_per_class, dtype=float), axis=0))
    if per_class:
        some_run = next(iter(rows.values()))[0]
        names = [str(n) for n in (_read_json(some_run / "partition.json") or {}).get("class-names", [])]
        labels = names or [str(i) for i in range(len(next(iter(per_class.values()))))]
        body.append(f"<h2>Per-class {per_class_key} at the final round (mean over seeds)</h2>"
                    + _bars(per_class, labels, per_class_key, "score"))  # fmt: skip
    links = [f'<li><a href="{html.escape(run.relative_to(folder).as_posix())}/{REPORT}">{html.escape(name)}: '
             f"{html.escape(run.name)}</a></li>" for name, runs in rows.items() for run in runs]  # fmt: skip
    body.append("<h2>Every run</h2><ul>" + "".join(links) + "</ul>")
    return _page(f"fedskew comparison {folder.name}", "\n".join(body))


def _markdown_tables(text: str) -> str:
    """results.md's paragraphs and pipe tables as HTML."""
    parts, table = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                table.append(cells)
            continue
        if table:
            parts.append(_table(table[0], table[1:]))
            table = []
        if line.strip():
            parts.append(f"<p>{html.escape(line)}</p>")
    return "".join(parts)


# --- entry points ------------------------------------------------------------------------------------


def write_report(folder: Path) -> Path:
    """Write `folder/report.html` for a run directory or a bench.compare output folder."""
    folder = Path(folder)
    if (folder / "summary.json").is_file():
        page = run_report(folder)
    elif comparison_runs(folder):
        page = comparison_report(folder)
        for runs in comparison_runs(folder).values():
            for run in runs:
                write_report(run)
    else:
        raise ReportError(
            f"{folder} is not a results directory: expected a run directory (with summary.json) or the --out "
            "folder of python -m bench.compare (with runs/<method>-seed<k>/<run>/summary.json)"
        )
    path = folder / REPORT
    path.write_text(page)
    return path


def try_write_report(folder: Path) -> Path | None:
    """write_report for the end of a run: a report that cannot be drawn never costs the run its results."""
    try:
        return write_report(folder)
    except Exception as exc:  # noqa: BLE001 - reported, and the run's own files are already written
        print(f"fedskew: could not write {Path(folder) / REPORT}: {type(exc).__name__}: {exc}", flush=True)
        return None
