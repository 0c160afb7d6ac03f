"""fednca.schedule-span: the warm-up/decay schedule spans the whole run or each round's local steps."""

from __future__ import annotations

import pytest
import torch

from fedskew.client_tasks import local_optimisation
from fedskew.config import ConfigError, RunConfig


def _rates(run_config: dict, server_round: int, steps_per_round: int = 10) -> list[float]:
    """The learning rate of each of the round's optimiser steps at a site (or the bound's first `steps`)."""
    cfg = RunConfig.from_run_config({"num-server-rounds": 4, "local-epochs": 1, **run_config})
    parameter = torch.nn.Parameter(torch.zeros(2, 2))
    model = torch.nn.Module()
    model.weight = parameter
    optimizer, scheduler, _ = local_optimisation(cfg, model, steps_per_round, server_round, augment_seed=0)
    rates = []
    for _ in range(steps_per_round):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_round_span_warms_up_and_decays_within_every_round():
    peak = RunConfig().fednca.lr
    # 10 steps (one epoch), 0.2 epochs of warm-up: steps 1-2 rise to the peak, then (10 - s) / 8 of it down to
    # 1/8 at the last step.
    expected = [peak / 2, peak] + [peak * (10 - s) / 8 for s in range(2, 10)]
    for server_round in (1, 3):
        assert _rates({"fednca.schedule-span": "round", "fednca.warmup-epochs": 0.2}, server_round) == pytest.approx(expected)


def test_run_span_continues_one_schedule_over_the_rounds():
    peak = RunConfig().fednca.lr
    # 4 rounds x 10 steps, warm-up 0.8 epochs = 8 steps; round 3 holds global steps 20-29: (40 - s) / 32 of the peak.
    rates = _rates({"fednca.schedule-span": "run", "fednca.warmup-epochs": 0.8}, 3)
    assert rates == pytest.approx([peak * (40 - s) / 32 for s in range(20, 30)])


def test_the_warm_up_lasts_the_same_epochs_however_long_the_run():
    # 1.5 epochs of 10 steps = 15 steps whether the run has 4 or 40 rounds: the first 15 rates rise by peak / 15.
    peak = RunConfig().fednca.lr
    for rounds in (4, 40):
        rates = _rates({"num-server-rounds": rounds, "fednca.warmup-epochs": 1.5}, 1) + _rates(
            {"num-server-rounds": rounds, "fednca.warmup-epochs": 1.5}, 2
        )
        assert rates[:15] == pytest.approx([peak * (s + 1) / 15 for s in range(15)])
        assert rates[15] == pytest.approx(peak) and rates[16] < peak  # the decay starts after the peak step


def test_a_warm_up_longer_than_half_the_schedule_stops_at_half():
    # One round of 10 steps with 5 epochs of warm-up asked: 5 steps of warm-up, then 5 of decay to peak / 5.
    peak = RunConfig().fednca.lr
    rates = _rates({"num-server-rounds": 1, "fednca.warmup-epochs": 5}, 1)
    assert rates == pytest.approx([peak * (s + 1) / 5 for s in range(5)] + [peak * (10 - s) / 5 for s in range(5, 10)])


def test_the_centralised_bound_spans_its_whole_run_whatever_the_site_span():
    per_round = _rates({"method": "centralized", "fednca.schedule-span": "round"}, 1)
    whole_run = _rates({"method": "centralized", "fednca.schedule-span": "run"}, 1)
    assert per_round == pytest.approx(whole_run)
    # Step 10 of a 40-step schedule (warm-up 1.5 epochs = 15 steps): (9 + 1) / 15 of the peak, not a round's end.
    assert per_round[-1] == pytest.approx(RunConfig().fednca.lr * 10 / 15)


def test_an_unknown_span_is_refused_with_the_key_named():
    with pytest.raises(ConfigError, match="schedule-span"):
        RunConfig.from_run_config({"fednca.schedule-span": "epoch"})
