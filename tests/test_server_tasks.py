"""The centralised upper bound: the same model trained on the pooled site data, recorded like a run."""

import json

import numpy as np
import pytest
import torch

from fedskew.config import RunConfig
from fedskew.data.sites import load_task_dataset, simulated_site
from fedskew.results import RunRecorder
from fedskew.data.site_folder import write_labelled_folder
from fedskew.server_tasks import load_server_validation_set, train_centralized



def test_centralized_trains_on_exactly_the_pooled_site_data_and_learns(tmp_path):
    cfg = RunConfig.from_run_config({"method": "centralized", "mosaic-grid": 0, "partition": "dirichlet", "alpha": 0.5,
                                     "model": "small-cnn", "num-server-rounds": 2, "local-epochs": 1, "batch-size": 64})  # fmt: skip
    recorder = RunRecorder.create(cfg, multilabel=False, base=tmp_path)
    torch.manual_seed(cfg.seed)
    train_centralized(cfg, load_task_dataset(cfg), 3, torch.device("cpu"), recorder)
    rounds = [json.loads(line) for line in (recorder.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    pooled = sum(len(simulated_site(cfg, k, 3).train_labels) for k in range(3))
    # each round is local-epochs passes over every site's training split, nothing more, nothing less
    assert [r["train"]["num_examples"] for r in rounds[1:]] == [pooled, pooled]
    # untrained: about chance (1/10); two passes over ~1,300 digits take a small CNN far beyond it
    assert rounds[0]["test"]["accuracy"] < 0.3 and rounds[2]["test"]["accuracy"] > 0.5
    assert np.isclose(sum(rounds[2]["test"]["per_class_recall"]) / 10, rounds[2]["test"]["balanced_accuracy"])
    assert json.loads((recorder.path / "checkpoint.json").read_text())["round"] == 2
    # the round is selected on the pooled site validation splits, like the federated methods' rounds
    assert all("val_accuracy" in r["val"] for r in rounds[1:])
    assert recorder.best_round()[1].startswith("val_accuracy")


def test_a_server_validation_set_must_hold_the_task_and_chooses_the_centralised_round(tmp_path):
    cfg = RunConfig.from_run_config({"method": "centralized", "mosaic-grid": 0, "partition": "iid", "model": "small-cnn",
                                     "num-server-rounds": 2, "local-epochs": 1, "batch-size": 64})  # fmt: skip
    task = load_task_dataset(cfg)
    held_out = write_labelled_folder(tmp_path / "val", task.test_images[:60], task.test_labels[:60], task.class_names)
    validation = load_server_validation_set(cfg.model_copy(update={"val_data": str(held_out)}), task)
    assert len(validation.test_labels) == 60 and validation.num_classes == task.num_classes
    recorder = RunRecorder.create(cfg, multilabel=False, base=tmp_path)
    train_centralized(cfg, task, 3, torch.device("cpu"), recorder, validation)
    rounds = [json.loads(line) for line in (recorder.path / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["server_val"]["val_accuracy"] <= 1 for r in rounds[1:])
    best, selected_by = recorder.best_round()
    assert selected_by.endswith("the server's validation split (val-data)")
    assert best["server_val"]["val_accuracy"] == max(r["server_val"]["val_accuracy"] for r in rounds[1:])
    # Validation data of another task (5 of 10 classes named, 8 px instead of the task's shape) is refused.
    other = write_labelled_folder(tmp_path / "other", np.zeros((4, 1, 8, 8), np.float32), np.arange(4) % 5,
                                  tuple(str(k) for k in range(5)))  # fmt: skip
    with pytest.raises(ValueError, match="val-data = .* holds single-label data with 5 classes"):
        load_server_validation_set(cfg.model_copy(update={"val_data": str(other)}), task)


def test_the_threshold_is_chosen_on_val_data_when_the_run_has_it_else_on_the_sites_counts():
    from fedskew.metrics import THRESHOLD_GRID
    from fedskew.server_tasks import decision_threshold

    def exact_at(threshold):  # one class predicted exactly at `threshold` only, missed everywhere else
        return np.array([[[2, 0, 0]] if t == threshold else [[0, 0, 2]] for t in THRESHOLD_GRID])

    sites, server = exact_at(0.2), exact_at(0.7)
    assert decision_threshold("validation", sites, server, THRESHOLD_GRID) == (0.7, "the server's validation split (val-data)")
    assert decision_threshold("validation", sites, None, THRESHOLD_GRID)[0] == 0.2
    assert decision_threshold(0.35, sites, server, (0.35, 0.5)) == (0.35, "run-config threshold (fixed)")
    assert decision_threshold("validation", None, None, THRESHOLD_GRID)[0] == 0.5


def test_a_sites_malformed_validation_counts_are_refused_with_the_reason_and_the_others_summed():
    from fedskew.strategies.recording import summed_counts

    good = np.arange(12).tolist()
    total, refused = summed_counts({"1": good, "2": good, "3": good[:-1], "4": [-1] * 12, "5": None, "6": [0.5] * 12}, (2, 2, 3))
    np.testing.assert_array_equal(total, 2 * np.arange(12).reshape(2, 2, 3))
    assert sorted(refused) == ["3", "4", "5", "6"]
    assert "must be 12 non-negative integers (thresholds x classes x [tp, fp, fn] = 2 x 2 x 3); found 11 values" in refused["3"]
    assert "not all non-negative integers" in refused["4"] and "found none" in refused["5"]
    assert summed_counts({"3": good[:-1]}, (2, 2, 3))[0] is None  # no usable counts: no validation this round


def test_flowers_strategy_sums_the_sites_counts_and_records_a_malformed_report_as_dropped(tmp_path, monkeypatch):
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedskew.client_tasks import VAL_COUNTS_KEY
    from fedskew.strategies import RecordedFedAvg

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # messages outside a Flower runtime
        monkeypatch.setattr(TaskIdentity, name, value)

    class ThreeSites:
        def get_node_ids(self):
            return [1, 2, 3]

    strategy = RecordedFedAvg(fraction_evaluate=1.0, weighted_by_key="num-examples")
    recorder = RunRecorder.create(RunConfig(), multilabel=True, base=tmp_path)
    strategy.attach(recorder, counts_shape=(2, 1, 3))  # 2 thresholds, 1 class
    sent = strategy.configure_evaluate(1, ArrayRecord({"w": torch.zeros(1)}), ConfigRecord(), ThreeSites())
    reports = {1: [1, 0, 0, 0, 0, 1], 2: [3, 1, 0, 2, 0, 1], 3: [5, 5]}  # site 3 sends 2 numbers, not 6
    replies = [Message(RecordDict({"metrics": MetricRecord({VAL_COUNTS_KEY: reports[m.metadata.dst_node_id], "num-examples": 4})}),
                       reply_to=m) for m in sent]  # fmt: skip
    logged = strategy.aggregate_evaluate(1, replies)
    # Summed, not averaged by Flower, and without site 3, which is recorded as dropped with the reason.
    np.testing.assert_array_equal(strategy.last_val_counts, [[[4, 1, 0]], [[2, 0, 2]]])
    assert VAL_COUNTS_KEY not in strategy.last_val_metrics
    # Nor in the record Flower logs every round (all that is left of it are the weights).
    assert logged is not None and VAL_COUNTS_KEY not in logged
    assert [(d["round"], d["site"]) for d in recorder.dropped] == [(1, "3")] and "found 2 values" in recorder.dropped[0]["reason"]


def test_a_run_on_the_sites_own_folders_is_named_by_them_not_by_the_default_dataset(tmp_path):
    from fedskew.report import run_report
    from fedskew.server_tasks import run_data_name

    cfg = RunConfig()  # a deployment keeps the default dataset, digits, which no site holds
    folders = {11: {"data-source": "site-folder"}, 12: {"data-source": "site-folder"}}
    assert run_data_name(cfg, folders, ("effusion", "nodule")) == "site-folders-effusion-nodule"
    assert run_data_name(cfg, folders, ("0", "1", "2")) == "site-folders-3-classes"  # classes.txt-less sites
    assert run_data_name(cfg, folders, tuple("x" * 40 for _ in range(2))) == "site-folders-2-classes"
    assert run_data_name(cfg, {11: {"data-source": "partition"}}, ("0", "1")) == "digits"  # simulated shares of it
    recorder = RunRecorder.create(cfg, multilabel=True, base=tmp_path)
    assert recorder.path.name.endswith("-fednca-digits")  # before the survey only the run config names it
    recorder.name_by_data("site-folders-effusion-nodule")
    (run,) = tmp_path.iterdir()
    assert run == recorder.path and run.name.endswith("-fednca-site-folders-effusion-nodule")
    assert (run / "config.json").is_file()  # written before the survey, moved with the folder
    recorder.write_summary("completed")
    assert json.loads((run / "summary.json").read_text())["data"] == "site-folders-effusion-nodule"
    assert "fednca</b> on <b>site-folders-effusion-nodule</b>" in run_report(run)


def test_the_round_line_says_how_far_the_run_is_and_when_it_ends_at_this_rounds_pace(tmp_path):
    recorder = RunRecorder.create(RunConfig(), multilabel=True, base=tmp_path)
    entry = {"round": 1, "round_seconds": 30.0, "train": {"train_loss": 0.5}, "test": {"f1_macro": 0.25}}
    assert recorder.round_line(entry) == "[fednca] round   1 | train loss 0.5000 | f1_macro 0.2500 | 30.0s"
    recorder.total_rounds = 4
    assert recorder.round_line(entry).endswith("| 30.0s | 1/4 rounds, ETA 1m30s")  # 3 rounds of 30 s left
    assert recorder.round_line({**entry, "round": 4}).endswith("| 30.0s")  # the last one: nothing left
