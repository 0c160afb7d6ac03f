"""What a run's summary reports: the best round is chosen on validation metrics only."""

import json

from fedskew.config import RunConfig
from fedskew.results import RunRecorder


def _recorder(tmp_path, multilabel=True):
    return RunRecorder.create(RunConfig(), multilabel=multilabel, base=tmp_path)


def test_the_best_round_is_chosen_on_validation_and_reports_test_metrics_at_that_round(tmp_path):
    recorder = _recorder(tmp_path)
    recorder.record_round(0, {"f1_macro": 0.0})
    # Round 1 is best on test, round 2 on validation: validation decides, test is only reported.
    recorder.record_round(1, {"f1_macro": 0.9}, val={"val_f1_macro": 0.4})
    recorder.record_round(2, {"f1_macro": 0.7}, val={"val_f1_macro": 0.6})
    recorder.record_round(3, {"f1_macro": 0.8}, val={"val_f1_macro": 0.6})  # a tie keeps the earlier round
    summary = json.loads((recorder.path / "summary.json").read_text())
    assert (summary["best_round"], summary["best"]) == (2, {"f1_macro": 0.7})
    assert summary["selected_by"].startswith("val_f1_macro: the sites' validation splits, weighted by examples")
    assert summary["final"] == {"f1_macro": 0.8}


def test_a_server_validation_split_chooses_the_round_when_the_run_has_one(tmp_path):
    recorder = _recorder(tmp_path)
    # The sites' validation prefers round 1, the server's val-data round 2: val-data decides.
    recorder.record_round(1, {"f1_macro": 0.5}, val={"val_f1_macro": 0.9}, server_val={"val_f1_macro": 0.3})
    recorder.record_round(2, {"f1_macro": 0.6}, val={"val_f1_macro": 0.2}, server_val={"val_f1_macro": 0.4})
    best, selected_by = recorder.best_round()
    assert best["round"] == 2 and selected_by == "val_f1_macro: the server's validation split (val-data)"
    assert json.loads((recorder.path / "metrics.jsonl").read_text().splitlines()[0])["server_val"] == {"val_f1_macro": 0.3}


def test_without_validation_metrics_the_final_round_is_reported_and_says_so(tmp_path):
    recorder = _recorder(tmp_path, multilabel=False)
    recorder.record_round(1, {"accuracy": 0.9})
    recorder.record_round(2, {"accuracy": 0.5})
    best, selected_by = recorder.best_round()
    assert best["round"] == 2 and "no validation metrics" in selected_by
    recorder.selected_within = "chosen inside the method"
    assert recorder.best_round() == (recorder.rounds[-1], "chosen inside the method")
