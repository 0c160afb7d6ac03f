"""Wall-clock and CPU seconds of a piece of work: FederatedFactory is compute-bound, and on a shared
machine wall time alone says more about the neighbours than about the method."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Elapsed:
    wall: float = 0.0
    cpu: float = 0.0  # this process, all threads

    def add(self, other: Elapsed) -> None:
        self.wall += other.wall
        self.cpu += other.cpu

    def as_metrics(self, name: str) -> dict[str, float]:
        return {f"{name}_seconds": self.wall, f"{name}_cpu_seconds": self.cpu}


@contextmanager
def timed(total: Elapsed) -> Iterator[Elapsed]:
    """Add the block's wall and CPU seconds to `total`."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield total
    finally:
        total.wall += time.perf_counter() - wall
        total.cpu += time.process_time() - cpu
