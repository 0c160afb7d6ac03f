"""Server-side work of a run, kept out of server_app.py so it reads as build-and-start:
waiting for sites, the site survey that records the partition, server-side evaluation,
and the centralised (pooled-data) upper bound."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from torch import nn

from fedskew.client_tasks import local_optimisation
from fedskew.config import RunConfig
from fedskew.data.plots import plot_cooccurrence, plot_label_counts
from fedskew.data.site_folder import load_test_set
from fedskew.data.sites import load_task_dataset, pooled_training_data
from fedskew.data.sources import ImageDataset
from fedskew.models.build import build_model, server_etf
from fedskew.results import RESUME_MUST_MATCH, RunRecorder, write_json
from fedskew.training import evaluate, make_loader, train_local

SURVEY = "query.site_survey"


def wait_for_sites(grid: Grid, minimum: int, timeout: float, poll: float = 1.0) -> list[int]:
    """Node ids once at least `minimum` sites are connected; a clear error after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        node_ids = sorted(grid.get_node_ids())
        if len(node_ids) >= minimum:
            return node_ids
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(node_ids)} site(s) connected after {timeout:.0f} s; "
                f"min-available-sites = {minimum}. Start more SuperNodes or lower min-available-sites."
            )
        time.sleep(poll)


def survey_sites(grid: Grid, node_ids: list[int], timeout: float) -> dict[int, dict]:
    """Ask every site for its label statistics (counts only: no data leaves a site)."""
    messages = [Message(RecordDict({"config": ConfigRecord()}), message_type=SURVEY, dst_node_id=n) for n in node_ids]
    survey = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            print(f"site {node} failed the survey: {reply.error.reason}", flush=True)
            continue
        survey[node] = dict(reply.content["survey"])
    return survey


def write_partition(recorder: RunRecorder, survey: dict[int, dict], class_names: tuple[str, ...]) -> None:
    """partition.json + heatmap (and per-site co-occurrence for multi-label data) from the survey."""
    sites = sorted(survey.values(), key=lambda s: s["site-id"])
    counts = np.array([s["label-counts"] for s in sites], dtype=np.int64)
    k = len(class_names)
    payload = {
        "sites": [
            {
                "site-id": s["site-id"],
                "train-size": s["train-size"],
                "val-size": s["val-size"],
                "label-counts": s["label-counts"],
                **({"cooccurrence": np.reshape(s["cooccurrence"], (k, k)).tolist()} if "cooccurrence" in s else {}),
            }
            for s in sites
        ],
        "unassigned": sites[0].get("unassigned", 0) if sites else 0,
        "class-names": list(class_names),
    }
    write_json(recorder.path / "partition.json", payload)
    plot_label_counts(counts, class_names, recorder.path / "partition.png", "training labels per site")
    if all("cooccurrence" in s for s in sites):
        matrices = [np.reshape(s["cooccurrence"], (k, k)) for s in sites]
        plot_cooccurrence(matrices, class_names, recorder.path / "cooccurrence.png")


def resume_point(cfg: RunConfig, recorder: RunRecorder) -> tuple[int, dict[str, torch.Tensor] | None]:
    """(rounds already done, global model) of `resume-from`, after checking that the earlier run
    shares every setting that shapes the partition, the model and the ETF; (0, None) without it."""
    if not cfg.resume_from:
        return 0, None
    previous = Path(cfg.resume_from)
    if cfg.method not in ("fedavg", "fedprox", "fednca"):
        raise ValueError(f"resume-from works with fedavg, fedprox and fednca; this run's method is {cfg.method!r}")
    if not (previous / "config.json").is_file():
        raise FileNotFoundError(f"resume-from = {str(previous)!r} holds no config.json; valid: a fedskew run directory")
    earlier = json.loads((previous / "config.json").read_text())
    now = cfg.to_run_config()
    differing = [f"{k}: {earlier.get(k)!r} -> {now[k]!r}" for k in RESUME_MUST_MATCH if k in now and earlier.get(k) != now[k]]
    if differing:
        raise ValueError("resume-from: these settings differ from the earlier run's: " + "; ".join(differing))
    done, state = recorder.continue_from(previous)
    if done >= cfg.num_server_rounds:
        raise ValueError(f"resume-from: the earlier run already completed {done} of num-server-rounds = {cfg.num_server_rounds}")
    print(f"fedskew: resuming {previous} after round {done}", flush=True)
    return done, state


def scalar_metrics(metrics: dict) -> MetricRecord:
    return MetricRecord({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and np.isfinite(v)})


def make_evaluate_fn(
    model: nn.Module,
    test: ImageDataset | None,
    device: torch.device,
    recorder: RunRecorder,
    round_metrics: Callable[[], tuple[dict, dict]],
    round_offset: int = 0,
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """After every round: evaluate the global model on the server's test split (with no test data,
    the sites' aggregated validation metrics are the round's evaluation), checkpoint it, and record
    the round. `round_offset` numbers the rounds of a resumed run after the earlier ones. Flower
    calls this after the round's federated evaluation, so the validation metrics are current."""

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        state = arrays.to_torch_state_dict()
        metrics = {}
        if test is not None:
            model.load_state_dict(state)
            metrics = evaluate(model, test.test_images, test.test_labels, device=device)
        if server_round == 0 and round_offset:
            return scalar_metrics(metrics)  # the resumed model: already recorded by the earlier run
        train, val = round_metrics()
        recorder.save_checkpoint(state, round_offset + server_round)
        recorder.record_round(round_offset + server_round, metrics, train=train, val=val)
        return scalar_metrics(metrics)

    return evaluate_fn


def train_centralized(
    cfg: RunConfig, task: TaskShape | ImageDataset, num_sites: int, device: torch.device, recorder: RunRecorder
) -> None:
    """The upper bound: the model of the method it bounds (`centralized-model`), with that method's
    losses and optimiser, on the pooled site training data for the same sample passes (rounds x local
    epochs over every site's data), evaluated on the same test split. One optimiser and learning-rate
    schedule span the whole run, as one site would train if it held all the data."""
    images, labels = pooled_training_data(cfg, num_sites)
    test = load_task_dataset(cfg)
    etf = server_etf(cfg, task.num_classes, task.image_shape) if cfg.fednca_model else None
    model = build_model(cfg, task.num_classes, task.image_shape, etf=etf).to(device)
    loader = make_loader(images, labels, cfg.batch_size, shuffle=True, seed=cfg.seed)
    optimizer, scheduler, loss_fn = local_optimisation(cfg, model, cfg.local_epochs * len(loader), server_round=1)
    recorder.record_round(0, evaluate(model, test.test_images, test.test_labels, device=device))
    for server_round in range(1, cfg.num_server_rounds + 1):
        stats = train_local(
            model, loader, epochs=cfg.local_epochs, optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn,
            device=device,
        )
        metrics = evaluate(model, test.test_images, test.test_labels, device=device)
        recorder.save_checkpoint(model.state_dict(), server_round)
        recorder.record_round(server_round, metrics, train=stats)


# --- deployment: where the server's test data comes from, and federated evaluation -------------------

FEDERATED_EVALUATION = "federated"


def load_server_test_set(cfg: RunConfig) -> ImageDataset | None:
    """The server's test data by run-config test-data: empty = the dataset's test split (simulation, or a
    centre that holds the dataset); a path = that site-layout folder or MedMNIST-layout npz;
    "federated" = none (None): the sites' validation metrics are the evaluation."""
    if cfg.test_data == FEDERATED_EVALUATION:
        return None
    if cfg.test_data:
        return load_test_set(cfg, cfg.test_data)
    dataset = load_task_dataset(cfg)
    if cfg.num_classes not in (0, dataset.num_classes):
        raise ValueError(
            f"key 'num-classes' = {cfg.num_classes} is invalid; {dataset.name} has {dataset.num_classes} classes "
            "(valid: 0 or that number)"
        )
    return dataset


@dataclass(frozen=True)
class TaskShape:
    """What the server needs to build the model when it holds no data (same names as ImageDataset)."""

    num_classes: int
    image_shape: tuple[int, int, int]
    class_names: tuple[str, ...]
    multilabel: bool
    name: str


def agreed_task_shape(cfg: RunConfig, survey: dict[int, dict], test: ImageDataset | None) -> TaskShape | ImageDataset:
    """The label space and image shape of the run: the server's test data when it has some, else what
    the sites reported. Every surveyed site must agree, or the run stops before training with the
    sites and values named (a mismatch would otherwise surface as shape errors in every round)."""
    reported = {node: (int(s["num-classes"]), tuple(int(v) for v in s["image-shape"])) for node, s in survey.items()}
    if test is not None:
        expected, source = (test.num_classes, test.image_shape), f"the server's test data ({test.name})"
    elif reported:
        expected, source = next(iter(reported.values())), f"site {next(iter(reported))}"
    else:
        raise RuntimeError("no site answered the survey and the server has no test data: nothing defines the model")
    mismatched = {node: value for node, value in reported.items() if value != expected}
    if mismatched:
        listed = "; ".join(f"site {node}: {k} classes, images {shape}" for node, (k, shape) in mismatched.items())
        raise ValueError(
            f"sites disagree with {source} ({expected[0]} classes, images {expected[1]} as C, H, W): {listed}. "
            "Set run-config num-classes and image-size, or fix those sites' classes.txt / images"
        )
    if test is not None:
        return test
    num_classes, image_shape = expected
    return TaskShape(num_classes, image_shape, tuple(str(k) for k in range(num_classes)), cfg.multilabel, "site data")
