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


def test_without_validation_metrics_the_final_round_is_reported_and_says_so(tmp_path):
    recorder = _recorder(tmp_path, multilabel=False)
    recorder.record_round(1, {"accuracy": 0.9})
    recorder.record_round(2, {"accuracy": 0.5})
    best, selected_by = recorder.best_round()
    assert best["round"] == 2 and "no validation metrics" in selected_by
    recorder.selected_within = "chosen inside the method"
    assert recorder.best_round() == (recorder.rounds[-1], "chosen inside the method")
