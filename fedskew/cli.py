"""The `fedskew` command line: one subcommand per job.

A subcommand is a function `run(args) -> exit code` plus a registration function that adds its
parser to the subparsers and sets `run` as its default; list the registration in SUBCOMMANDS.
Options that are run-config keys are generated from fedskew/config.py, so their names, defaults,
choices and help match the run config exactly.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedskew.config import ConfigError, RunConfig, _iter_fields
from fedskew.data.site_folder import FORMATS, SiteFolderError, prepare_sites
from fedskew.data.sites import load_partition
from fedskew.data.sources import DataSourceError

# The run-config keys that decide which images and labels each site holds.
PARTITION_KEYS = (
    "dataset", "data-root", "allow-download", "image-size", "mosaic-grid", "labels", "partition", "alpha",
    "classes-per-site", "missing-classes", "min-site-size", "seed",
)  # fmt: skip


def add_run_config_options(parser: argparse.ArgumentParser, keys: tuple[str, ...]) -> None:
    """`--<key>` for each run-config key, typed, defaulted and described as in RunConfig."""
    fields = {key: info for key, info, _ in _iter_fields(RunConfig)}
    for key in keys:
        info = fields[key]
        kwargs: dict = {"default": info.default, "help": f"{info.description} (default: {info.default!r})"}
        if info.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(info.annotation) is typing.Literal:
            kwargs["choices"] = typing.get_args(info.annotation)
        else:
            kwargs["type"] = info.annotation
        parser.add_argument(f"--{key}", dest=key.replace("-", "_"), **kwargs)


def run_config_from_args(args: argparse.Namespace, keys: tuple[str, ...], **fixed) -> RunConfig:
    return RunConfig.from_run_config({**fixed, **{key: getattr(args, key.replace("-", "_")) for key in keys}})


# --- prepare-sites -----------------------------------------------------------------------------------


def run_prepare_sites(args: argparse.Namespace) -> int:
    # The partition does not depend on the method; fedavg accepts single- and multi-label data alike.
    cfg = run_config_from_args(args, PARTITION_KEYS, method="fedavg")
    contents = prepare_sites(cfg, args.sites, args.out, args.format)
    unassigned = len(load_partition(cfg, args.sites).unassigned)
    out = Path(args.out).resolve()
    print(f"wrote {len(contents) - 1} site folder(s) and the server test set to {out} ({args.format} layout):")
    for name, data in contents.items():
        counts = data.labels.sum(axis=0) if data.labels.ndim == 2 else np.bincount(data.labels, minlength=len(data.class_names))
        present = int((counts > 0).sum())
        print(f"  {name}: {len(data.labels)} images, {present}/{len(data.class_names)} classes present")
    if unassigned:
        print(f"  ({unassigned} training images fit no site under this partition and were not written)")
    print("start one SuperNode per site with, e.g.:")
    for k in range(args.sites):
        print(f"  flower-supernode ... --node-config \"data-dir='{out / f'site-{k}'}' site-id={k} num-sites={args.sites}\"")
    print(f"and give the server its test set with --run-config \"test-data='{out / 'server-test'}'\"")
    # The same folders, simulated: each simulated SuperNode reads one of them (dataset sites:<dir>).
    labels = "" if cfg.labels == "auto" else f" labels='{cfg.labels}'"
    print("or simulate the federation on these folders first:")
    print(f"  flwr run . --run-config \"dataset='sites:{out}' test-data='{out / 'server-test'}' mosaic-grid=0{labels}\" "
          f"--federation-config \"num-supernodes={args.sites}\"")  # fmt: skip
    return 0


def register_prepare_sites(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prepare-sites",
        help="write one data folder per site (the simulated partition) plus the server's test set",
        description="Write OUT/site-0 .. site-(N-1), each site's share of the simulated partition in the "
        "site-folder layout, and OUT/server-test with the dataset's test split. The same settings give "
        "the same partition as a simulation with that many SuperNodes.",
    )
    parser.add_argument("--sites", type=int, required=True, help="number of sites N")
    parser.add_argument("--out", type=Path, required=True, help="folder to write site-K/ and server-test/ into")
    parser.add_argument("--format", choices=FORMATS, default="png", help="images/ + labels.csv (png) or site.npz")
    add_run_config_options(parser, PARTITION_KEYS)
    parser.set_defaults(run=run_prepare_sites)


# --- unlearn ------------------------------------------------------------------------------------------


def run_unlearn(args: argparse.Namespace) -> int:
    # Imported here: it pulls in torch and the Flower server side, which other subcommands do not need.
    from fedskew.unlearn import unlearn

    target = unlearn(args.run_dir, site=args.site, class_id=args.class_id, out=args.out)
    print((target / "unlearning.md").read_text())
    print(f"wrote {target} (the source run {Path(args.run_dir).resolve()} is unchanged)")
    return 0


def register_unlearn(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "unlearn",
        help="forget a site or a class of a finished factory / factory-p2p run, into a new run directory",
        description="Drop the generator modules of a site (or of a class) from RUN_DIR's library, drop the "
        "synthetic images they drew, retrain the classifier with the run's recipe and seed (factory-p2p: also "
        "drop those sites' experts), and write everything plus a before/after per-class recall table "
        "(unlearning.md, unlearning.json) to a new run directory. RUN_DIR is only read.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a factory or factory-p2p run directory")
    forget = parser.add_mutually_exclusive_group(required=True)
    forget.add_argument("--site", type=int, help="site id K whose modules to forget")
    forget.add_argument("--class", dest="class_id", type=int, metavar="C", help="class id C whose modules to forget")
    parser.add_argument("--out", type=Path, default=None, help="new run directory (default: RUN_DIR-forget-siteK|classC)")
    parser.set_defaults(run=run_unlearn)


# --- report -------------------------------------------------------------------------------------------


def run_report(args: argparse.Namespace) -> int:
    from fedskew.report import write_report

    print(f"wrote {write_report(args.folder).resolve()}")
    return 0


def register_report(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report",
        help="(re)build report.html for a run directory or a bench.compare output folder",
        description="Write DIR/report.html: one self-contained page (images embedded, no server needed) with the "
        "run's config, partition, learning curves, per-class metrics, bytes per site and, for FederatedFactory, "
        "sample grids and memorisation scores; for the --out folder of python -m bench.compare, every method side "
        "by side (and each run's own page).",
    )
    parser.add_argument("folder", type=Path, metavar="DIR", help="a run directory or a bench.compare --out folder")
    parser.set_defaults(run=run_report)


def run_sign_app(args: argparse.Namespace) -> int:
    from fedskew.app_signing import publish_app

    published = publish_app(args.app_dir, args.index, args.key, args.key_id)
    print(f"signed {published.fab} with key {args.key_id}; run it with: flwr run {published.spec} <connection>")
    return 0


def register_sign_app(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sign-app",
        help="build the app bundle (FAB) of APP_DIR, sign it with the federation's key and file it in the app index",
        description="Build the FAB of APP_DIR as `flwr run` would, sign its SHA-256 with an Ed25519 OpenSSH private "
        "key (docker/app-key.sh) and write INDEX/<publisher>/<name>/<version>.fab plus its signatures. SuperNodes "
        "started with --trusted-entities run it once `fedskew serve-apps` serves INDEX to the SuperLink.",
    )
    parser.add_argument("app_dir", type=Path, nargs="?", default=Path("."), metavar="APP_DIR", help="default: .")
    parser.add_argument("--key", type=Path, required=True, help="Ed25519 OpenSSH private key (docker/app-key.sh)")
    parser.add_argument("--key-id", default="fedskew-federation", help="the key's id in the sites' trusted-entities.yaml")
    parser.add_argument("--index", type=Path, required=True, help="app index folder")
    parser.set_defaults(run=run_sign_app)


def run_serve_apps(args: argparse.Namespace) -> int:
    from fedskew.app_signing import AppIndex

    index = AppIndex(args.index, args.host, args.port)
    print(f"serving {Path(args.index).resolve()} at {index.url}; start the SuperLink with "
          f"FLWR_SUPERGRID_API_URL={index.url}", flush=True)  # fmt: skip
    try:
        index.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def register_serve_apps(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve-apps",
        help="serve the app index to the SuperLink (the Flower Hub's fetch-fab protocol)",
        description="Serve the signed FABs of INDEX over HTTP the way the Flower Hub serves apps, so that a "
        "SuperLink started with FLWR_SUPERGRID_API_URL=http://HOST:PORT runs `flwr run @publisher/name==x.y.z` "
        "with the signatures attached. Serve it to the SuperLink only (loopback or a private network).",
    )
    parser.add_argument("--index", type=Path, required=True, help="app index folder (fedskew sign-app --index)")
    parser.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    parser.add_argument("--port", type=int, default=8090, help="default: 8090")
    parser.set_defaults(run=run_serve_apps)


# --- predict ------------------------------------------------------------------------------------------


def run_predict(args: argparse.Namespace) -> int:
    # Imported here: it pulls in torch and the model constructors, which prepare-sites does not need.
    from fedskew.predict import predict

    report = predict(args.model, args.input, args.out, device=args.device)
    print(f"wrote {report['rows']} prediction(s) to {Path(args.out).resolve()} with {report['model']}")
    for key, value in report.get("metrics", {}).items():
        print(f"  {key}: {value:.6f}")
    return 0


def register_predict(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "predict",
        help="apply a trained model (a run directory or model file) to images and write predictions.csv",
        description="Write one CSV row per image: its file name (or index), the predicted labels and every class "
        "probability. MODEL is a model file (model.safetensors, model-selected.safetensors, model-poe.safetensors) "
        "or a run directory (its best-validation model). With labelled input the metrics are printed too.",
    )
    parser.add_argument("model", type=Path, metavar="MODEL_OR_RUN_DIR")
    parser.add_argument("--input", type=Path, required=True,
                        help="a site folder (labels.csv or site.npz), a folder of PNG/JPEG images, or an npz (its test split)")
    parser.add_argument("--out", type=Path, default=Path("predictions.csv"), help="CSV to write (default: predictions.csv)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.set_defaults(run=run_predict)


# --- entry point ---------------------------------------------------------------------------------------

SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    register_prepare_sites, register_unlearn, register_predict, register_report, register_sign_app, register_serve_apps,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedskew", description="fedskew tools (runs themselves start with `flwr run`).")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, SiteFolderError, DataSourceError, ValueError, OSError) as err:
        # Bad input ends with its message, not a traceback.
        print(f"fedskew {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
