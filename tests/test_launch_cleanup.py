"""Leaving a SimulationSuperLink stops every process of its runs, also those that left its process group."""

from __future__ import annotations

import subprocess
import sys

from fedskew.testing.launch import SimulationSuperLink, processes_with_env


def test_leaving_the_superlink_stops_processes_that_left_its_process_group(tmp_path):
    with SimulationSuperLink(tmp_path / "flwr-home") as link:
        # What a run's flwr-simulation or a Ray worker is: a process of its own session with the link's env.
        escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=link.env, start_new_session=True)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        try:
            assert escaped.pid in processes_with_env("FLWR_HOME", str(link.home))
            assert other.pid not in processes_with_env("FLWR_HOME", str(link.home))
        except AssertionError:
            escaped.kill(), other.kill()
            raise
    try:
        assert escaped.wait(timeout=30) < 0  # stopped by a signal, not left running
        assert other.poll() is None  # a process of another FLWR_HOME is left alone
    finally:
        escaped.kill(), other.kill()
        escaped.wait(), other.wait()
