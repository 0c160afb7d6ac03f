"""The app through real Flower processes: a simulation SuperLink on free loopback ports with
its own FLWR_HOME, `flwr run`, and the run judged by `flwr ls` and the results it wrote."""

import json

import pytest
from safetensors.torch import load_file

from fedskew.launch import SimulationSuperLink

TINY = {"num-server-rounds": 2, "batch-size": 64, "val-fraction": 0.2, "min-site-size": 5}


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    with SimulationSuperLink(tmp_path_factory.mktemp("flwr-home")) as link:
        yield link


def _only_run_dir(results_dir):
    (run,) = [p for p in results_dir.iterdir() if p.is_dir()]
    return run


def test_fedavg_runs_two_rounds_on_three_sites_and_writes_results(superlink, tmp_path):
    outcome = superlink.run_app({**TINY, "method": "fedavg", "results-dir": str(tmp_path)}, num_supernodes=3)
    assert outcome.completed, outcome.output[-4000:]
    run = _only_run_dir(tmp_path)
    for name in ("config.json", "partition.json", "partition.png", "cooccurrence.png", "metrics.jsonl",
                 "summary.json", "curves.png", "model.safetensors"):
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
def fednca_run(superlink, tmp_path_factory):
    """One real fednca run (2 sites, 2 rounds), shared by the tests that inspect or resume it."""
    results = tmp_path_factory.mktemp("fednca")
    outcome = superlink.run_app({**TINY, "method": "fednca", "results-dir": str(results)}, num_supernodes=2)
    assert outcome.completed, outcome.output[-4000:]
    return _only_run_dir(results)


def test_fednca_two_rounds_every_site_trains_against_the_servers_etf(fednca_run):
    summary = json.loads((fednca_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    # each site echoes the CRC32 of the ETF it received; the server compares with its own
    assert summary["etf_checks"] == [{"round": r, "sites": 2, "matching": 2} for r in (1, 2)]
    assert 0.0 <= summary["final"]["f1_macro"] <= 1.0 and len(summary["final"]["per_class_f1"]) == 10
    # the neural-collapse analysis of the final model: class-mean cosine vs the ETF's -1/(K-1), and the t-SNE map
    analysis = json.loads((fednca_run / "nc_analysis.json").read_text())
    assert summary["neural_collapse"] == analysis and analysis["etf_cosine"] == -1 / 9
    assert -1.0 <= analysis["mean_pairwise_cosine"] <= 1.0 and (fednca_run / "nc_tsne.png").stat().st_size > 10_000


def test_a_resumed_run_continues_after_the_last_completed_round(superlink, fednca_run, tmp_path):
    before = {p.name: p.read_bytes() for p in fednca_run.iterdir()}
    resumed = superlink.run_app(
        {**TINY, "method": "fednca", "num-server-rounds": 3, "resume-from": str(fednca_run), "results-dir": str(tmp_path)},
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
    assert {p.name: p.read_bytes() for p in fednca_run.iterdir()} == before  # the earlier run is untouched


def test_a_bad_config_value_fails_the_run_with_the_clear_message(superlink, tmp_path):
    outcome = superlink.run_app({**TINY, "alpha": -1.0, "results-dir": str(tmp_path)}, num_supernodes=2)
    assert not outcome.completed
    assert "key 'alpha' = -1.0 is invalid" in outcome.output


def test_scaffold_sites_keep_their_control_variate_between_rounds(superlink, tmp_path):
    outcome = superlink.run_app({**TINY, "method": "scaffold", "results-dir": str(tmp_path)}, num_supernodes=2)
    assert outcome.completed, outcome.output[-4000:]
    rounds = [json.loads(line) for line in (_only_run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    # Round 1 starts from zeros everywhere; in round 2 every site finds the state it stored in round 1.
    assert [r["train"]["site-state-restored"] for r in rounds[1:]] == [0.0, 1.0]
