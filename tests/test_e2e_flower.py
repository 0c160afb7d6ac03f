"""The app through real Flower processes: a simulation SuperLink on free loopback ports with
its own FLWR_HOME, `flwr run`, and the run judged by `flwr ls` and the results it wrote."""

import csv
import json
import shutil

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent
from dp_accounting.rdp import RdpAccountant
from multihot_npz import CLASS_NAMES, write_multihot_npz
from safetensors.torch import load_file

from fedskew.metrics import THRESHOLD_GRID, multilabel_metrics
from fedskew.models.model_file import read_model_file
from fedskew.predict import predict

TINY = {"num-server-rounds": 2, "batch-size": 64, "val-fraction": 0.2, "min-site-size": 5}
# Central DP with server-side clipping: one run covers Flower's DP wrapper around FedNCA-ML's strategy.
DP = {"aggregation": "unweighted", "dp.mode": "central-server-clipping", "dp.noise-multiplier": 1.0}


def _only_run_dir(results_dir):
    (run,) = [p for p in results_dir.iterdir() if p.is_dir()]
    return run


def test_fedavg_runs_two_rounds_on_three_sites_and_writes_results(tiny_run_superlink, tmp_path):
    outcome = tiny_run_superlink.run_app({**TINY, "method": "fedavg", "results-dir": str(tmp_path)}, num_supernodes=3)
    assert outcome.completed, outcome.output[-4000:]
    assert "fedskew: 3 site(s) take part" in outcome.output  # the federation size is never silent
    run = _only_run_dir(tmp_path)
    for name in ("config.json", "partition.json", "partition.png", "cooccurrence.png", "metrics.jsonl",
                 "summary.json", "curves.png", "model.safetensors", "report.html"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert 0.0 <= rounds[-1]["test"]["f1_macro"] <= 1.0 and "val_f1_macro" in rounds[-1]["val"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    # 3 sites x 2 rounds x (train + evaluate) messages out and 3 x 2 training replies back, each
    # carrying the whole model: the serialised bytes must at least cover those tensors
    model_bytes = sum(t.numel() * t.element_size() for t in load_file(str(run / "model.safetensors")).values())
    assert len(summary["bytes"]["sent_per_site"]) == 3
    assert 12 * model_bytes <= summary["bytes"]["sent_total"] < 12 * model_bytes * 1.1
    assert 6 * model_bytes <= summary["bytes"]["received_total"] < 6 * model_bytes * 1.1 + 3 * 2 * 10_000
    partition = json.loads((run / "partition.json").read_text())
    assert sorted(s["site-id"] for s in partition["sites"]) == [0, 1, 2]


@pytest.fixture(scope="module")
def own_multilabel(tmp_path_factory):
    """The run config of a hospital's own multi-hot npz (not a mosaic): the label kind comes from the file."""
    path = write_multihot_npz(tmp_path_factory.mktemp("own") / "own.npz")
    return {"dataset": f"npz:{path}", "mosaic-grid": 0, "labels": "auto"}


@pytest.fixture(scope="module")
def fednca_run(tiny_run_superlink, own_multilabel, tmp_path_factory):
    """One real fednca run with central DP (2 sites, 2 rounds) on a multi-hot npz, shared by the tests that
    inspect or resume it."""
    results = tmp_path_factory.mktemp("fednca")
    outcome = tiny_run_superlink.run_app({**TINY, **DP, **own_multilabel, "method": "fednca", "results-dir": str(results)}, num_supernodes=2)
    assert outcome.completed, outcome.output[-4000:]
    return _only_run_dir(results)


def test_fednca_two_rounds_every_site_trains_against_the_servers_etf(fednca_run):
    summary = json.loads((fednca_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    # each site echoes the CRC32 of the ETF it received; the server compares with its own
    assert summary["etf_checks"] == [{"round": r, "sites": 2, "matching": 2} for r in (1, 2)]
    assert 0.0 <= summary["final"]["f1_macro"] <= 1.0 and len(summary["final"]["per_class_f1"]) == len(CLASS_NAMES)
    # The decision threshold is chosen every round on the sites' summed validation counts (a grid point),
    # and the summary's is the selected round's; the F1 at the fixed 0.5 is reported beside it.
    rounds = {r["round"]: r for r in map(json.loads, (fednca_run / "metrics.jsonl").read_text().splitlines())}
    assert all(rounds[r]["threshold"] in THRESHOLD_GRID for r in (1, 2))
    assert summary["threshold"] == rounds[summary["best_round"]]["threshold"]
    assert summary["threshold_chosen_by"] == "the sites' validation splits (their summed counts)"
    assert {"val_f1_macro", "val_f1_micro", "val_f1_macro_at_0.5"} <= set(rounds[2]["val"])
    assert rounds[2]["val"]["val_f1_macro"] >= rounds[2]["val"]["val_f1_macro_at_0.5"]  # the grid's best, 0.5 among it
    assert 0.0 <= summary["final"]["f1_macro_at_0.5"] <= 1.0
    partition = json.loads((fednca_run / "partition.json").read_text())
    assert partition["class-names"] == list(CLASS_NAMES) and "cooccurrence" in partition["sites"][0]
    # the neural-collapse analysis of the final model: class-mean cosine vs the ETF's -1/(K-1), and the t-SNE map
    analysis = json.loads((fednca_run / "nc_analysis.json").read_text())
    assert summary["neural_collapse"] == analysis and analysis["etf_cosine"] == pytest.approx(-1 / (len(CLASS_NAMES) - 1))
    assert -1.0 <= analysis["mean_pairwise_cosine"] <= 1.0 and (fednca_run / "nc_tsne.png").stat().st_size > 10_000


def test_predict_on_the_test_split_reproduces_the_runs_reported_test_metrics(fednca_run, own_multilabel, tmp_path):
    summary = json.loads((fednca_run / "summary.json").read_text())
    assert summary["selected_by"].startswith("val_f1_macro")  # chosen on validation, never on test
    out = tmp_path / "predictions.csv"
    report = predict(fednca_run, own_multilabel["dataset"].removeprefix("npz:"), out)
    assert report["model"].endswith("model-selected.safetensors")
    rows = list(csv.DictReader(out.open()))
    probs = np.array([[float(r[f"p:{name}"]) for name in CLASS_NAMES] for r in rows])
    test_labels = np.load(own_multilabel["dataset"].removeprefix("npz:"))["test_labels"]
    # At the threshold the selected round chose on validation, which the model file carries.
    assert read_model_file(report["model"])[0].threshold == summary["threshold"]
    recomputed = multilabel_metrics(test_labels, probs, summary["threshold"])
    assert [r["predicted"] for r in rows] == ["|".join(np.array(CLASS_NAMES)[p > summary["threshold"]]) for p in probs]
    for key in ("f1_macro", "f1_micro", "auc_macro", "map"):
        assert recomputed[key] == summary["best"][key], key


def _accountant_epsilon(releases: int, delta: float) -> float:
    accountant = RdpAccountant()
    accountant.compose(GaussianDpEvent(DP["dp.noise-multiplier"]), releases)
    return accountant.get_epsilon(delta)


def test_fednca_with_central_dp_reports_the_accountants_epsilon_every_round(fednca_run):
    summary = json.loads((fednca_run / "summary.json").read_text())
    train_size = sum(s["train-size"] for s in json.loads((fednca_run / "partition.json").read_text())["sites"])
    privacy = summary["privacy"]
    assert privacy["mode"] == "central-server-clipping" and privacy["delta"] == pytest.approx(1 / train_size)
    # both sites answered every round: each release had exactly the configured noise multiplier
    assert privacy["noise_multipliers"] == [1.0, 1.0]
    rounds = [json.loads(line) for line in (fednca_run / "metrics.jsonl").read_text().splitlines()]
    for r in rounds:
        assert r["privacy"]["epsilon"] == pytest.approx(_accountant_epsilon(r["round"], privacy["delta"]) if r["round"] else 0.0)
    assert privacy["epsilon"] == rounds[-1]["privacy"]["epsilon"] > 0


def test_a_resumed_run_continues_after_the_last_completed_round(tiny_run_superlink, own_multilabel, fednca_run, tmp_path):
    before = {p.name: p.read_bytes() for p in fednca_run.iterdir()}
    resumed = tiny_run_superlink.run_app(
        {**TINY, **DP, **own_multilabel, "method": "fednca", "num-server-rounds": 3, "resume-from": str(fednca_run), "results-dir": str(tmp_path)},
        num_supernodes=2,
    )
    assert resumed.completed, resumed.output[-4000:]
    run = _only_run_dir(tmp_path)
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == {"run": str(fednca_run), "round": 2}
    assert summary["etf_checks"] == [{"round": 3, "sites": 2, "matching": 2}]
    assert json.loads((run / "checkpoint.json").read_text())["round"] == 3
    # the privacy ledger continues: round 3 is the third release
    assert summary["privacy"]["epsilon"] == pytest.approx(_accountant_epsilon(3, summary["privacy"]["delta"]))
    assert {p.name: p.read_bytes() for p in fednca_run.iterdir()} == before  # the earlier run is untouched


def test_a_resume_from_a_damaged_checkpoint_fails_inside_the_serverapp_and_records_why(tiny_run_superlink, own_multilabel, fednca_run, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(fednca_run, damaged)
    (damaged / "checkpoint.json").write_text('{"round": "abc"}')
    outcome = tiny_run_superlink.run_app(
        {**TINY, **DP, **own_multilabel, "method": "fednca", "num-server-rounds": 3, "resume-from": str(damaged),
         "results-dir": str(tmp_path / "results")},
        num_supernodes=2,
    )
    assert not outcome.completed
    summary = json.loads((_only_run_dir(tmp_path / "results") / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rounds_completed"] == 0
    assert summary["reason"] == f"ValueError: resume-from: {damaged / 'checkpoint.json'} must hold the completed round as an int >= 1, got 'abc'"


def test_fedprox_with_federated_evaluation_sends_mu_to_every_site_and_records_their_validation(tiny_run_superlink, tmp_path):
    outcome = tiny_run_superlink.run_app({**TINY, "method": "fedprox", "proximal-mu": 0.25, "test-data": "federated",
                                 "results-dir": str(tmp_path)}, num_supernodes=2)  # fmt: skip
    assert outcome.completed, outcome.output[-4000:]
    run = _only_run_dir(tmp_path)
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2] and rounds[0]["test"] == {}
    for entry in rounds[1:]:
        # every site trained with the server's mu (the mean of the sites' reports is that mu)
        assert entry["train"]["proximal-mu"] == pytest.approx(0.25) and entry["test"] == {}
        assert set(entry["val"]) >= {"val_f1_macro", "val_f1_micro"}
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


def test_a_bad_config_value_fails_the_run_with_the_clear_message(tiny_run_superlink, tmp_path):
    outcome = tiny_run_superlink.run_app({**TINY, "alpha": -1.0, "results-dir": str(tmp_path)}, num_supernodes=2)
    assert not outcome.completed
    assert "ConfigError: invalid run config: key 'alpha' = -1.0 is invalid: Input should be greater than 0" in outcome.output
    assert "Traceback" not in outcome.output  # the message alone, not the frames of the config's validation
