"""The app through real Flower processes: a simulation SuperLink on free loopback ports with
its own FLWR_HOME, `flwr run`, and the run judged by `flwr ls` and the results it wrote."""

import json

import pytest

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
    # 3 sites x 2 rounds x (train + evaluate) messages out, each carrying the model
    assert len(summary["bytes"]["sent_per_site"]) == 3
    assert summary["bytes"]["sent_total"] > 12 * 0.9 * sum(1 for _ in [0]) * 1000
    partition = json.loads((run / "partition.json").read_text())
    assert sorted(s["site-id"] for s in partition["sites"]) == [0, 1, 2]


def test_a_bad_config_value_fails_the_run_with_the_clear_message(superlink, tmp_path):
    outcome = superlink.run_app({**TINY, "alpha": -1.0, "results-dir": str(tmp_path)}, num_supernodes=2)
    assert not outcome.completed
    assert "key 'alpha' = -1.0 is invalid" in outcome.output
