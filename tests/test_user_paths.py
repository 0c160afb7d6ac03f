"""The user-path matrix: every method the run config offers, through a real `flwr run`, on tiny data written in
the layouts a user brings: a MedMNIST-layout npz of uint8 or float pixels, grey or RGB, single-label or
multi-hot; PNG site folders (dataset sites:<dir>), single- and multi-label. Each run must learn, not
just finish: its final test score must reach the floor derived from its test labels (pattern_data.learnt_floor:
halfway from the best image-blind score to a perfect one). Not here: mosaics (mosaic-grid 2-4) of single-label
images, which the tiny budget does not learn (fednca and feddyn on 2 x 2 mosaics stayed below the floor after 3
rounds: test macro-F1 0.78 and 0.77 against 0.88). The rows on PNG site folders and FederatedFactory's are in
test_user_paths_factory_sites.py, so the two test workers share the runs."""

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from pattern_data import chance_score, learnt_floor, pattern_set, write_npz, write_site_folders
from test_privacy import SitesOnline, flower_identity  # noqa: F401 - a fixture

from fedskew.config import RunConfig
from fedskew.results import RunRecorder
from fedskew.strategies import build_strategy

NUM_CLASSES, NUM_SITES = 4, 3
# 40 training images a class as MedMNIST stores them (its val split is merged into training), 20 test images a
# class; multi-label: each label on 40 % of the images.
SINGLE_SIZES = {"train": 160, "val": 40, "test": 80}
MULTI_SIZES = {"train": 200, "val": 40, "test": 100}
# Label skew across the sites, as the project studies, mild enough to learn in 3 rounds.
SKEWED_SINGLE = {"mosaic-grid": 0, "partition": "dirichlet", "alpha": 1.0, "min-site-size": 5}
SKEWED_MULTI = {"mosaic-grid": 0, "partition": "multilabel-skew", "missing-classes": 1, "min-site-size": 5}
# Every run: 3 sites of about 50 training images; 5 local epochs of batches of 16 (about 20 steps a round) take a
# fraction of a second and let a round learn something, so 3 rounds suffice.
TINY = {"num-server-rounds": 3, "local-epochs": 5, "batch-size": 16, "val-fraction": 0.2}


@dataclass(frozen=True)
class Layout:
    channels: int
    multilabel: bool
    store: str  # npz pixels "uint8" | "float32", or "png" site folders
    keys: dict = field(default_factory=dict)  # the run-config keys it is run with
    side: int = 28  # MedMNIST's


LAYOUTS = {
    "npz-uint8-grey": Layout(1, False, "uint8", SKEWED_SINGLE),
    "npz-uint8-rgb": Layout(3, False, "uint8", SKEWED_SINGLE),
    "npz-float-grey": Layout(1, False, "float32", SKEWED_SINGLE),
    "npz-uint8-grey-multi": Layout(1, True, "uint8", SKEWED_MULTI),
    "npz-float-rgb-multi": Layout(3, True, "float32", SKEWED_MULTI),
    # FederatedFactory's generators learn 8 px images in a few dozen steps (test_user_paths_factory_sites.py).
    "npz-uint8-grey-8px": Layout(1, False, "uint8", SKEWED_SINGLE, side=8),
    "npz-uint8-rgb-8px": Layout(3, False, "uint8", SKEWED_SINGLE, side=8),
    # The sites keep the folders' own split (fedskew's partition keys stay at their defaults).
    "png-sites-grey": Layout(1, False, "png"),
    "png-sites-rgb-multi": Layout(3, True, "png"),
}


@dataclass(frozen=True)
class Written:
    keys: dict  # run-config keys that name the data
    test_labels: np.ndarray  # what the server tests on: the floor is derived from them


class WrittenLayouts:
    """Each layout written on first use under `folder` (its data drawn from its place in LAYOUTS)."""

    def __init__(self, folder):
        self.folder, self.written = folder, {}

    def __getitem__(self, name: str) -> Written:
        if name not in self.written:
            self.written[name] = self._write(name, LAYOUTS[name], seed=list(LAYOUTS).index(name))
        return self.written[name]

    def _write(self, name: str, layout: Layout, seed: int) -> Written:
        data = pattern_set(NUM_CLASSES, MULTI_SIZES if layout.multilabel else SINGLE_SIZES, side=layout.side,
                           channels=layout.channels, multilabel=layout.multilabel, seed=seed)  # fmt: skip
        if layout.store == "png":
            sites, test = write_site_folders(data, self.folder / name, NUM_SITES)
            return Written({"dataset": f"sites:{sites}", "test-data": str(test), "mosaic-grid": 0}, data.labels["test"])
        return Written({"dataset": f"npz:{write_npz(data, self.folder / f'{name}.npz', layout.store)}", **layout.keys},
                       data.labels["test"])


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> WrittenLayouts:
    return WrittenLayouts(tmp_path_factory.mktemp("layouts"))


def only_run_dir(results_dir):
    (run,) = [p for p in results_dir.iterdir() if p.is_dir()]
    return run


def run_row(superlink, written: Written, config: dict, results) -> tuple:
    """One completed `flwr run` of `config` on the written layout: its run folder, summary and rounds."""
    outcome = superlink.run_app({**TINY, **written.keys, **config, "results-dir": str(results)}, num_supernodes=NUM_SITES)
    assert outcome.completed, outcome.output[-4000:]
    run = only_run_dir(results)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    return run, summary, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_learnt(row: str, measured: float, test_labels: np.ndarray) -> None:
    metric = "macro-F1" if test_labels.ndim == 2 else "accuracy"
    floor = learnt_floor(test_labels)
    # Printed for the matrix's record (pytest -s shows it): the row, its floor and what it scored.
    print(f"\nmatrix row {row}: test {metric} {measured:.3f}, floor {floor:.3f} (chance {chance_score(test_labels):.3f})")
    assert measured >= floor, f"{row}: test {metric} {measured:.3f} below the floor {floor:.3f}"


def check_federated_row(superlink, layouts, results, method: str, layout: str) -> None:
    written = layouts[layout]
    run, summary, rounds = run_row(superlink, written, {"method": method}, results)
    assert [r["round"] for r in rounds] == [0, 1, 2, 3] and summary["rounds_completed"] == 3
    assert len(json.loads((run / "partition.json").read_text())["sites"]) == NUM_SITES
    if method == "scaffold":
        # Round 1 starts from zeros everywhere; from round 2 every site finds the control variate it stored.
        assert [r["train"]["site-state-restored"] for r in rounds[1:]] == [0.0, 1.0, 1.0]
    assert_learnt(f"{method} on {layout}", summary["final"]["f1_macro" if written.test_labels.ndim == 2 else "accuracy"],
                  written.test_labels)  # fmt: skip


# The weight-averaging methods on npz files; on site folders in test_user_paths_factory_sites.py.
NPZ_ROWS = [
    ("fednca", "npz-uint8-grey-multi"),
    ("fedavg", "npz-uint8-rgb"),
    ("fedprox", "npz-float-grey"),
    ("scaffold", "npz-float-rgb-multi"),
    ("feddyn", "npz-uint8-grey"),
    ("fedadam", "npz-float-grey"),
    ("fedyogi", "npz-uint8-grey"),
    ("fedadagrad", "npz-uint8-grey-multi"),
]


@pytest.mark.parametrize(("method", "layout"), NPZ_ROWS, ids=[f"{m}-{l}" for m, l in NPZ_ROWS])
def test_a_federated_method_learns_on_an_npz(tiny_run_superlink, layouts, tmp_path, method, layout):
    check_federated_row(tiny_run_superlink, layouts, tmp_path, method, layout)


class WeightAndStatistic(torch.nn.Module):
    """One trainable weight and one buffer, as BatchNorm keeps its running statistics."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.register_buffer("running_mean", torch.zeros(1))


@pytest.mark.parametrize("method", ["fedadam", "fedyogi", "fedadagrad"])
def test_server_optimisers_step_the_parameters_and_average_the_buffers(flower_identity, tmp_path, method):
    # The fedadam row stayed at chance while the adaptive step moved BatchNorm's statistics too.
    # Sent w = 1, running_mean = 0; the two sites return 2 and 4 for both: their average is 3. FedAdam (eta 0.1,
    # beta1 0.9, beta2 0.99, tau 1e-3): delta 2, m = 0.2, v = 0.04, eta_t = 0.1 sqrt(1 - 0.99^2) / (1 - 0.9^2),
    # w = 1 + eta_t 0.2 / (0.2 + 1e-3).
    cfg = RunConfig.from_run_config({"method": method, "server-lr": 0.1})
    strategy = build_strategy(cfg, 2, WeightAndStatistic())
    strategy.attach(RunRecorder.create(cfg, multilabel=False, base=tmp_path))
    sent = ArrayRecord({"w": Array(np.ones(1, np.float32)), "running_mean": Array(np.zeros(1, np.float32))})
    outgoing = list(strategy.configure_train(1, sent, ConfigRecord(), SitesOnline(2)))
    replies = [
        Message(RecordDict({"arrays": ArrayRecord({name: Array(np.full(1, value, np.float32)) for name in ("w", "running_mean")}),
                            "metrics": MetricRecord({"num-examples": 10, "unit-weight": 1})}), reply_to=message)
        for value, message in zip((2.0, 4.0), outgoing)
    ]  # fmt: skip
    new = strategy.aggregate_train(1, replies)[0].to_torch_state_dict()
    assert new["running_mean"].item() == pytest.approx(3.0)
    assert new["w"].item() != pytest.approx(3.0)  # the parameter takes the server optimiser's step, not the average
    if method == "fedadam":
        eta_t = 0.1 * np.sqrt(1 - 0.99**2) / (1 - 0.9**2)
        assert new["w"].item() == pytest.approx(1 + eta_t * 0.2 / (0.2 + 1e-3))
