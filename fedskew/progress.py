"""Progress lines for long work where users wait (a site training generators, the server synthesising
or training a classifier): at most one line per `interval_s`, plus the first and last step, printed with
flush so they reach `flwr run --stream` / `flwr log` (simulation: Ray forwards the ClientApp's stdout to
the ServerApp's log) and a SuperNode's own output (deployment) while the work is still running."""

from __future__ import annotations

import time
from collections.abc import Callable

# Users should never wait more than this for a sign of life; leaves margin under 30 s.
DEFAULT_INTERVAL_S = 20.0


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class ProgressReporter:
    """Call it after every step with (step, total, loss): it prints `label: step k/n, loss, items/s, ETA`
    when `interval_s` has passed since its last line, and always on the first and the last step.

    `items_per_step` turns steps into a rate (images per step = the batch size); `counted` names what a
    step is ("image" where the work counts images, not optimiser steps); `clock` and `emit` are
    injectable so that tests need neither sleeps nor captured stdout."""

    def __init__(
        self,
        label: str,
        items_per_step: int = 1,
        unit: str = "images",
        interval_s: float = DEFAULT_INTERVAL_S,
        counted: str = "step",
        clock: Callable[[], float] = time.monotonic,
        emit: Callable[[str], None] | None = None,
    ):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.label, self.items_per_step, self.unit, self.interval_s = label, items_per_step, unit, interval_s
        self.counted = counted
        self.clock = clock
        self.emit = emit or (lambda line: print(line, flush=True))
        self.started = clock()
        self.last_line: float | None = None

    def __call__(self, step: int, total: int, loss: float | None = None) -> None:
        now = self.clock()
        due = self.last_line is None or now - self.last_line >= self.interval_s
        if not (due or step >= total):
            return
        self.last_line = now
        self.emit(self.line(step, total, loss, now - self.started))

    def line(self, step: int, total: int, loss: float | None, elapsed: float) -> str:
        parts = [f"{self.label}: {self.counted} {step}/{total}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if elapsed > 0:
            rate = step * self.items_per_step / elapsed
            parts.append(f"{rate:.1f} {self.unit}/s")
            remaining = (total - step) * elapsed / max(step, 1)
            parts.append(f"elapsed {format_duration(elapsed)}")
            if step < total:
                parts.append(f"ETA {format_duration(remaining)}")
        return ", ".join(parts)
