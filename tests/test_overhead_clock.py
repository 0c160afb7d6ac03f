"""The overhead figure's clocks: CPU seconds of a process tree (exited children included) and the
steady-state round read from the run's `[method] round k |` lines."""

import os
import subprocess
import sys

import pytest

from bench.compare import RoundClock
from fedskew.testing.launch import ProcessTreeCPU

BURN = "import time\nstart = time.process_time()\nwhile time.process_time() - start < {seconds}: pass\n"


def test_process_tree_cpu_counts_a_child_that_has_exited():
    with ProcessTreeCPU(os.getpid(), interval=0.05) as cpu:
        before = cpu.sample()
        subprocess.run([sys.executable, "-c", BURN.format(seconds=0.6)], check=True)
        spent = cpu.sample() - before
        labels = set(cpu.labels.values())
    # the child burnt 0.6 CPU s (plus its start-up); the last sample of it is at most one interval before its end,
    # and this process's own CPU in the meantime only adds
    assert spent >= 0.6 - 0.05 - 0.05
    assert "python -c ..." in labels, labels  # the child, named by what it runs


class FakeCPU:
    def __init__(self, readings):
        self.readings = iter(readings)
        self.last = 0.0

    def sample(self):
        self.last = next(self.readings)
        return self.last

    def by_process(self):
        return {"flwr-simulation": self.last / 2, "Ray worker (ClientApp actor)": self.last / 2}


def test_round_clock_averages_from_the_first_rounds_line_to_the_last(monkeypatch):
    clock = RoundClock(FakeCPU([10.0, 13.0, 19.0]))
    times = iter([100.0, 104.0, 110.0])
    monkeypatch.setattr("bench.compare.time.perf_counter", lambda: next(times))
    for line in ("[fedavg] round   1 | train loss 1.0 | 3.0s", "fedskew: not a round line",
                 "[fedavg] round   2 | train loss 0.9 | 4.0s", "[fedavg] round   3 | train loss 0.8 | 6.0s"):
        clock(line)
    assert clock.steady_round() == {
        "wall_seconds": pytest.approx(5.0), "cpu_seconds": pytest.approx(4.5), "rounds": 2,
        "cpu_seconds_by_process": {"flwr-simulation": pytest.approx(2.25), "Ray worker (ClientApp actor)": pytest.approx(2.25)},
    }
