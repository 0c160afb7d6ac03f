"""A dead site never stalls a deployed run: with min-available-sites equal to the number of sites, a SuperNode
SIGKILLed as round 1 starts leaves fewer sites than the per-round floor, and the run ends as failed with that
reason within what round-timeout bounds (before, the ServerApp waited for the site to come back for as long as
it stayed away, logging 'Waiting for nodes to connect' once a second). A real deployment on loopback, as in
tests/test_deploy.py, whose fixtures and helpers this module shares; its own SuperLink, since those
fixtures are per module."""

import json
import time

import pytest

from test_deploy import (  # noqa: F401 - the fixtures are used by name
    THREADS,
    TINY,
    _only_run_dir,
    app_index,
    link,
    pki,
    running_sites,
    sites,
    with_pythonpath,
)

pytestmark = pytest.mark.walkthrough  # minutes of real processes: CI runs it after the suite (pyproject addopts)

ROUND_TIMEOUT = 60.0  # the survey (each site's first ClientApp: start-up, torch, its data) takes 20-30 s on two busy cores


def _round_recorded(results, server_round: int) -> bool:
    """metrics.jsonl holds `server_round` (round 0 is the initial evaluation, just before round 1's training)."""
    for metrics in results.glob("*/metrics.jsonl"):
        if any(json.loads(line)["round"] == server_round for line in metrics.read_text().splitlines() if line):
            return True
    return False


def _finished(link, run_id: int) -> bool:
    return any(r["run-id"] == str(run_id) and r.get("status", "").startswith("finished") for r in link.runs())


def test_a_site_killed_with_min_available_sites_equal_to_the_sites_ends_the_run_within_the_round_timeout(link, pki, sites, tmp_path):
    results = tmp_path / "results"
    # The sites heartbeat every 10 s (tests/short_heartbeat): the SuperLink notices the killed one after about 20 s.
    with running_sites(link, pki, tmp_path, [sites / f"site-{k}" for k in range(3)], env=with_pythonpath(THREADS, "short_heartbeat")) as nodes:
        run_id = link.submit({**TINY, "method": "fednca", "dataset": f"npz:{sites / 'own.npz'}", "mosaic-grid": 0,
                              "labels": "auto", "val-fraction": 0.2, "min-available-sites": 3,
                              "round-timeout": ROUND_TIMEOUT, "results-dir": str(results),
                              "test-data": str(sites / "server-test")})  # fmt: skip
        deadline = time.monotonic() + 300
        while not _round_recorded(results, 0) and time.monotonic() < deadline and not _finished(link, run_id):
            time.sleep(0.5)
        if not _round_recorded(results, 0):
            early = link.wait(run_id, timeout=30)
            pytest.fail(f"the run never reached round 1 ({early.status}):\n{early.output[-4000:]}")
        killed = nodes[2]
        killed_id = killed.node_id
        killed.kill()  # SIGKILL: a crash, the SuperLink is not told
        killed_at = time.monotonic()
        outcome = link.wait(run_id, timeout=400)
        ended_after = time.monotonic() - killed_at
    # A round waits for its sites at most round-timeout at each of its steps (connected sites, training,
    # validation): 3 x 20 s, plus the two live sites' ClientApp start-ups and training on shared cores (60 s).
    assert ended_after < 3 * ROUND_TIMEOUT + 60, (ended_after, outcome.output[-3000:])
    assert outcome.status == "finished:failed", (outcome.status, outcome.output[-3000:])
    summary = json.loads((_only_run_dir(results) / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "fewer than min-available-sites = 3 (a floor for every round)" in summary["reason"], summary["reason"]
    assert "round 1: 2 of 3 site(s) sent a usable" in summary["reason"], summary["reason"]
    # The killed site is recorded as dropped in round 1, by node id and the site id it declared in its survey.
    (dropped,) = [d for d in summary["dropped"] if d["site"] == str(killed_id)]
    assert dropped["round"] == 1 and dropped["site-id"] == 2 and dropped["reason"], dropped
    assert summary["site_ids"] == {str(n.node_id): k for k, n in enumerate(nodes)}
    assert "Waiting for nodes to connect" not in outcome.output
