"""Server-side work of a run, kept out of server_app.py so it reads as build-and-start:
waiting for sites, the site survey that records the partition, server-side evaluation,
and the centralised (pooled-data) upper bound."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from torch import nn

from fedskew.config import RunConfig
from fedskew.data.plots import plot_cooccurrence, plot_label_counts
from fedskew.data.sites import load_task_dataset, pooled_training_data
from fedskew.data.sources import ImageDataset
from fedskew.results import RunRecorder, write_json
from fedskew.training import evaluate, make_loader, sgd, train_local

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


def scalar_metrics(metrics: dict) -> MetricRecord:
    return MetricRecord({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and np.isfinite(v)})


def make_evaluate_fn(
    model: nn.Module,
    test: ImageDataset,
    device: torch.device,
    recorder: RunRecorder,
    round_metrics: Callable[[], tuple[dict, dict]],
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Evaluate the global model on the real test split after every round and record the round."""

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        state = arrays.to_torch_state_dict()
        model.load_state_dict(state)
        metrics = evaluate(model, test.test_images, test.test_labels, device=device)
        train, val = round_metrics()
        recorder.record_round(server_round, metrics, train=train, val=val)
        recorder.save_checkpoint(state)
        return scalar_metrics(metrics)

    return evaluate_fn


def train_centralized(cfg: RunConfig, model: nn.Module, num_sites: int, device: torch.device, recorder: RunRecorder) -> None:
    """The upper bound: the same model on the pooled site training data, the same sample passes
    (rounds x local epochs over every site's data), evaluated on the same test split."""
    images, labels = pooled_training_data(cfg, num_sites)
    test = load_task_dataset(cfg)
    loader = make_loader(images, labels, cfg.batch_size, shuffle=True, seed=cfg.seed)
    optimizer = sgd(model, cfg.lr, cfg.momentum, cfg.weight_decay)
    recorder.record_round(0, evaluate(model, test.test_images, test.test_labels, device=device))
    for server_round in range(1, cfg.num_server_rounds + 1):
        stats = train_local(model, loader, epochs=cfg.local_epochs, optimizer=optimizer, device=device)
        metrics = evaluate(model, test.test_images, test.test_labels, device=device)
        recorder.record_round(server_round, metrics, train=stats)
        recorder.save_checkpoint(model.state_dict())
