"""bench.compare's tables report each method at the round its validation selected, never only at its last
round: a bound whose last epochs swing would otherwise read below the method it bounds."""

import json
from types import SimpleNamespace

from bench.compare import write_report


def _run(path, best_round, best_accuracy, final_accuracy, rounds=3):
    path.mkdir(parents=True)
    metrics = {"accuracy": final_accuracy, "balanced_accuracy": final_accuracy, "auroc_macro": 0.9,
               "per_class_recall": [final_accuracy, final_accuracy]}
    best = {**metrics, "accuracy": best_accuracy, "per_class_recall": [best_accuracy, best_accuracy]}
    (path / "summary.json").write_text(json.dumps({
        "status": "completed", "rounds_completed": rounds, "final": metrics, "best_round": best_round, "best": best,
        "wall_seconds": 10.0, "bytes": {"sent_total": 1_000_000, "received_total": 1_000_000}}))
    (path / "metrics.jsonl").write_text("\n".join(json.dumps({"round": r, "round_seconds": 1.0}) for r in range(rounds + 1)))
    (path / "partition.json").write_text(json.dumps({"class-names": ["a", "b"]}))
    return path


def test_each_method_is_reported_at_its_selected_round_with_the_final_beside_it_where_it_differs(tmp_path):
    runs = {("centralized", 0): _run(tmp_path / "c0", best_round=2, best_accuracy=0.98, final_accuracy=0.82),
            ("centralized", 1): _run(tmp_path / "c1", best_round=1, best_accuracy=0.96, final_accuracy=0.90),
            ("factory", 0): _run(tmp_path / "f0", best_round=3, best_accuracy=0.95, final_accuracy=0.95)}
    args = SimpleNamespace(methods="centralized,factory", run_config="mosaic-grid=0", method_config=[], seeds="0,1",
                           variant_seeds="", overhead_repeats=0, num_sites=2, out=tmp_path)
    table = write_report(args, runs, {})
    header = next(line for line in table.splitlines() if line.startswith("| method"))
    rows = {line.split(" | ")[0][2:]: dict(zip(header.split(" | "), line.split(" | ")))
            for line in table.splitlines() if line.startswith(("| centralized", "| factory"))}
    assert rows["centralized"]["accuracy"] == "0.9700 ± 0.0141 (final 0.8600 ± 0.0566)"
    assert rows["centralized"]["selected_round"] == "2, 1"
    assert rows["factory"]["accuracy"] == "0.9500" and rows["factory"]["selected_round"] == "3"  # no bracket: equal
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["centralized"]["accuracy"] == [0.98, 0.96] and saved["centralized"]["final_accuracy"] == [0.82, 0.90]
