"""Privacy accounting shared by the sites' DP-SGD generators (fedskew.factory.dp_sgd) and the run-level
guarantees of fedskew.privacy: one place composes dp-accounting events into an epsilon."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dp_accounting import DpEvent
from dp_accounting.rdp import RdpAccountant


def epsilon_of(events: Iterable[DpEvent], delta: float) -> float:
    """Epsilon at `delta` of the composition of dp-accounting `events` in its RDP accountant; 0 for none."""
    events = list(events)
    if not events:
        return 0.0
    # For subsampled events at large rates dp-accounting warns about every fractional RDP order it cannot
    # evaluate and leaves out (the epsilon is the minimum over the orders that remain): kept out of site logs.
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        accountant = RdpAccountant()
        for event in events:
            accountant.compose(event)
        return float(accountant.get_epsilon(delta))
    finally:
        absl_logger.setLevel(level)
