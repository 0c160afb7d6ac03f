"""The user-path matrix: every method the run config offers, through a real `flwr run`, on tiny data written
in the layouts a user brings (MedMNIST-layout npz of uint8 or float pixels, grey or RGB, single- or
multi-label). Each run must learn, not just finish: its final test score must reach the floor derived from
the test labels (pattern_data.learnt_floor: halfway from the best image-blind score to a perfect one)."""

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from pattern_data import chance_score, learnt_floor, pattern_set, write_npz
from test_privacy import SitesOnline, flower_identity  # noqa: F401 - a fixture

from fedskew.config import RunConfig
from fedskew.results import RunRecorder
from fedskew.strategies import build_strategy


class WeightAndStatistic(torch.nn.Module):
    """One trainable weight and one buffer, as BatchNorm keeps its running statistics."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.register_buffer("running_mean", torch.zeros(1))


@pytest.mark.parametrize("method", ["fedadam", "fedyogi", "fedadagrad"])
def test_server_optimisers_step_the_parameters_and_average_the_buffers(flower_identity, tmp_path, method):
    # The fedadam row below stayed at chance while the adaptive step moved BatchNorm's statistics too.
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

# 40 training images a class (MedMNIST's val split is merged into training), 20 test images a class.
SINGLE_SIZES = {"train": 160, "val": 40, "test": 80}
MULTI_SIZES = {"train": 200, "val": 40, "test": 100}
LAYOUTS = {
    "uint8-grey": dict(channels=1, multilabel=False, pixels="uint8"),
    "uint8-rgb": dict(channels=3, multilabel=False, pixels="uint8"),
    "float-grey": dict(channels=1, multilabel=False, pixels="float32"),
    "uint8-grey-multi": dict(channels=1, multilabel=True, pixels="uint8"),
    "float-rgb-multi": dict(channels=3, multilabel=True, pixels="float32"),
}
NUM_CLASSES = 4
# Every run: 3 sites of about 50 training images; 5 local epochs of batches of 16 (about 20 steps a round) take a
# fraction of a second and let a round learn something, so 3 rounds suffice.
TINY = {"num-server-rounds": 3, "local-epochs": 5, "batch-size": 16, "val-fraction": 0.2}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Each layout's npz, and its test labels (what the floor is derived from)."""
    folder, written = tmp_path_factory.mktemp("layouts"), {}
    for seed, (name, layout) in enumerate(LAYOUTS.items()):
        data = pattern_set(NUM_CLASSES, MULTI_SIZES if layout["multilabel"] else SINGLE_SIZES, channels=layout["channels"],
                           multilabel=layout["multilabel"], seed=seed)  # fmt: skip
        written[name] = (write_npz(data, folder / f"{name}.npz", layout["pixels"]), data.labels["test"])
    return written


def _only_run_dir(results_dir):
    (run,) = [p for p in results_dir.iterdir() if p.is_dir()]
    return run


def _run(superlink, layouts, layout, config, results, sites=3):
    path, test_labels = layouts[layout]
    outcome = superlink.run_app({**TINY, "dataset": f"npz:{path}", **config, "results-dir": str(results)},
                                num_supernodes=sites)  # fmt: skip
    assert outcome.completed, outcome.output[-4000:]
    run = _only_run_dir(results)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    return run, summary, test_labels


def _report(row, metric, measured, test_labels):
    print(f"\nmatrix row {row}: {metric} {measured:.3f}, floor {learnt_floor(test_labels):.3f} (chance {chance_score(test_labels):.3f})")


# Label skew across the sites, as the project studies, mild enough for 3 rounds.
SINGLE = {"mosaic-grid": 0, "partition": "dirichlet", "alpha": 1.0, "min-site-size": 5}
MULTI = {"mosaic-grid": 0, "partition": "multilabel-skew", "missing-classes": 1, "min-site-size": 5}

FEDERATED_ROWS = [
    ("fedavg", "uint8-rgb", SINGLE),
    ("fedadam", "float-grey", SINGLE),
    ("fedyogi", "uint8-grey", SINGLE),
]


@pytest.mark.parametrize(("method", "layout", "extra"), FEDERATED_ROWS, ids=[f"{m}-{l}" for m, l, _ in FEDERATED_ROWS])
def test_a_federated_method_learns_on_a_users_layout(tiny_run_superlink, layouts, tmp_path, method, layout, extra):
    run, summary, test_labels = _run(tiny_run_superlink, layouts, layout, {"method": method, **extra}, tmp_path)
    metric = "f1_macro" if test_labels.ndim == 2 else "accuracy"
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    measured = summary["final"][metric]
    _report(f"{method} on {layout}", metric, measured, test_labels)
    assert measured >= learnt_floor(test_labels), (metric, measured, rounds)
