"""bench.scaling's bookkeeping: what a run directory yields, which stored points are reused, and the
per-site cost read off the table."""

import json

import pytest

from bench.scaling import per_site_cost, recorded, stored_point, write

FEDNCA = {"method": "fednca", "num-server-rounds": 1}


def fake_point(sites: int, **values) -> dict:
    # a cost of 2 s, 0.5 CPU s and 0.1 + 0.05 MB per site on top of a fixed 30 s / 20 CPU s / 0 MB
    point = {"run_config": FEDNCA, "sites": sites, "cpus_per_client": 1, "run_wall_seconds": 30 + 2 * sites,
             "round_seconds": 1 + 0.3 * sites, "cpu_seconds": 20 + 0.5 * sites, "mb_sent": 0.1 * sites,
             "mb_received": 0.05 * sites, "load_average": [2.0, 3.0]}
    return {**point, **values}


def test_recorded_reads_the_first_trained_round_and_the_bytes(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({
        "wall_seconds": 40.0, "bytes": {"sent_total": 3_000_000, "received_total": 1_500_000,
                                        "sent_per_site": {"a": 1, "b": 2}, "received_per_site": {"a": 1, "b": 2}}}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"round": r, "round_seconds": s})
                                                      for r, s in ((0, 27.0), (1, 4.0))))
    assert recorded(tmp_path) == {"server_wall_seconds": 40.0, "round_seconds": 4.0, "mb_sent": 3.0, "mb_received": 1.5,
                                  "sites_replied": 2}


def test_recorded_splits_a_factory_run_into_the_sites_generators_and_the_servers_work(tmp_path):
    sites = [{"generator_cpu_seconds": 9.0, "audit_cpu_seconds": 1.0}, {"generator_cpu_seconds": 7.5, "audit_cpu_seconds": 0.5}]
    (tmp_path / "summary.json").write_text(json.dumps({
        "wall_seconds": 500.0, "bytes": {"sent_total": 160, "received_total": 2_000_000, "sent_per_site": {},
                                         "received_per_site": {"a": 1, "b": 1}},
        "factory": {"site_metrics": sites, "modules": [{}, {}, {}, {}]}}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"round": 1, "round_seconds": 480.0, "train": {"synthesis_cpu_seconds": 160.0, "classifier_cpu_seconds": 35.0}}))
    record = recorded(tmp_path)
    assert (record["generators"], record["generators_cpu_seconds"]) == (4, 18.0)
    assert (record["synthesis_cpu_seconds"], record["classifier_cpu_seconds"]) == (160.0, 35.0)


def test_a_stored_point_is_reused_only_for_the_same_run_config_and_cpus():
    results = {"points": {"fednca/5": fake_point(5)}}
    assert stored_point(results, "fednca", 5, dict(FEDNCA), 1) == results["points"]["fednca/5"]
    assert stored_point(results, "fednca", 5, {**FEDNCA, "local-epochs": 1}, 1) is None
    assert stored_point(results, "fednca", 5, FEDNCA, 2) is None
    assert stored_point(results, "fednca", 10, FEDNCA, 1) is None


def test_the_cost_of_one_more_site_is_the_slope_of_the_points():
    points = [fake_point(n) for n in (5, 10, 20, 50)]
    assert per_site_cost(points, "run_wall_seconds") == pytest.approx(2.0)
    assert per_site_cost(points, "mb_sent") == pytest.approx(0.1)


def test_the_table_has_a_row_per_size_and_the_per_site_cost(tmp_path):
    results = {"machine": {"cpu_count": 2, "platform": "test"}, "cpus_per_client": 1, "configs": {"fednca": "method='fednca'"},
               "points": {f"fednca/{n}": fake_point(n) for n in (10, 5)}}
    text = write(results, tmp_path, "python -m bench.scaling --out x")
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 5", "| 10"]  # ordered by size
    assert rows[0].startswith("| 5 | 40.0 | 2.5 | 22.5 | 0.5 | 0.25 | 2.0–3.0 |")
    assert "flwr run wall s +2.00," in text and "MB sent +0.1," in text
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (tmp_path / "scaling.png").stat().st_size > 0
