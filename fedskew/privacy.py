"""Differential privacy of the weight-averaging methods (run-config section `dp.*`).

Flower does the clipping and the noise: its DP strategy wrappers on the server and its clipping /
local-DP mods on the ClientApp. This module picks them from the run config, keeps FedNCA-ML's public
ETF outside the clipped update, and accounts the privacy spent: after every release the Gaussian
mechanism that was really applied (noise std over the sensitivity of that round's average) is
composed in dp-accounting's RDP accountant, and epsilon at the run's delta goes into metrics.jsonl
and summary.json.

Unit of privacy. Central modes: one site's whole training set (add or remove a site; the number of
sites that train is public), as in DP-FedAvg (McMahan et al. 2018); a guarantee for a site's data
covers every patient in it. Local mode: each site's update on its own, against anyone who sees it
(the server included); any two datasets of a site may differ, so the sensitivity is twice the
clipping norm. Not covered in any mode: the site survey (label counts), training and validation
metrics, and the number of examples a site reports.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from dp_accounting import GaussianDpEvent
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.app.message_type import MessageType
from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from fedskew.accountant import epsilon_of
from fedskew.config import DPSection, RunConfig
from fedskew.results import RunRecorder
from fedskew.protocol import ETF_KEY

OFF = "off"
LOCAL = "local"


# --- accounting --------------------------------------------------------------------------------


def epsilon_spent(noise_multipliers: Iterable[float], delta: float) -> float:
    """Epsilon at `delta` of a sequence of Gaussian releases (no sampling: every site takes part in
    every round), each given by its noise multiplier; 0 before the first release."""
    return epsilon_of((GaussianDpEvent(z) for z in noise_multipliers), delta)


class PrivacyLedger:
    """The releases of one run and the epsilon they add up to, kept in the run's results."""

    def __init__(self, mode: str, delta: float, recorder: RunRecorder, earlier: list[float] | None = None):
        self.mode, self.delta, self.recorder = mode, delta, recorder
        self.noise_multipliers: list[float] = list(earlier or [])
        self._publish()

    def record_release(self, noise_multiplier: float) -> None:
        self.noise_multipliers.append(noise_multiplier)
        self._publish()

    def _publish(self) -> None:
        self.recorder.extra["privacy"] = {
            "mode": self.mode,
            "epsilon": epsilon_spent(self.noise_multipliers, self.delta),
            "delta": self.delta,
            "releases": len(self.noise_multipliers),
            "noise_multipliers": self.noise_multipliers,
            "accountant": "dp-accounting RDP",
            "unit": "one site's update" if self.mode == LOCAL else "one site's training set",
        }


def check_resumed_privacy(earlier: dict, now: dict) -> None:
    """ValueError when a run (flat run config `now`) would resume one (`earlier`) under other dp.* settings:
    the earlier rounds were released as that run's settings say, and a ledger started under others would not
    cover them (resuming a run trained without DP under DP would report the epsilon of the new rounds only).
    Both off: nothing was released under DP, the other dp.* keys shaped nothing."""
    if earlier.get("dp.mode", OFF) == OFF and now["dp.mode"] == OFF:
        return  # a config saved before dp.* existed ran without DP
    changed = [f"{key}: {earlier.get(key)!r} -> {now[key]!r}" for key in now if key.startswith("dp.") and earlier.get(key) != now[key]]
    if changed:
        raise ValueError(
            "resume-from: the earlier run released its rounds under other DP settings, which this run's privacy "
            f"ledger could not account: {'; '.join(changed)}; valid: the earlier run's dp.* settings (or a new run)"
        )


def earlier_releases(resumed_from: str, mode: str) -> list[float]:
    """A resumed run continues the privacy ledger of the run it resumes (its rounds were released under the
    same dp.* settings, `check_resumed_privacy`); ValueError when that run's summary holds no ledger of `mode`."""
    if not resumed_from:
        return []
    path = Path(resumed_from) / "summary.json"
    try:
        ledger = json.loads(path.read_text()).get("privacy")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as err:
        raise ValueError(f"resume-from: cannot read the privacy ledger in {path}: {err}") from None
    releases = ledger.get("noise_multipliers") if isinstance(ledger, dict) and ledger.get("mode") == mode else None
    if not (isinstance(releases, list) and all(isinstance(z, (int, float)) and not isinstance(z, bool) and z > 0 for z in releases)):
        raise ValueError(
            f"resume-from: {path} holds no privacy ledger of dp.mode = {mode!r} (its 'privacy' entry: {str(ledger)[:200]}); "
            "the epsilon of its released rounds is unknown; valid: a run directory written under the same dp.* settings"
        )
    return [float(z) for z in releases]


def adaptive_round_multiplier(update_multiplier: float, clipped_count_stddev: float) -> float:
    """Adaptive clipping also releases a noisy count of clipped updates; the two Gaussian releases
    together equal one with this multiplier (Andrew et al. 2021, as
    Flower splits it: z^-2 = z_update^-2 + (2 s)^-2)."""
    if clipped_count_stddev <= 0:
        return update_multiplier
    return (update_multiplier**-2 + (2 * clipped_count_stddev) ** -2) ** -0.5


# --- what a DP update may contain --------------------------------------------------------------


def keep_counters(reply: ArrayRecord, sent: ArrayRecord) -> ArrayRecord:
    """The reply with its integer arrays (BatchNorm's num_batches_tracked) put back to the values the
    server sent: they are step counters, not parameters; left in, they would dominate the clipped norm
    and carry each site's number of batches past the noise."""
    return ArrayRecord(
        {
            key: sent[key] if np.issubdtype(np.dtype(array.dtype), np.integer) and key in sent else array
            for key, array in reply.items()
        }
    )


def valid_statistics(arrays: ArrayRecord) -> ArrayRecord:
    """Noise can push BatchNorm running variances below zero (NaN outputs); clamping them is
    post-processing of a released model, so it costs no privacy."""
    return ArrayRecord(
        {
            key: Array(np.maximum(array.numpy(), 0.0)) if key.endswith("running_var") else array
            for key, array in arrays.items()
        }
    )


# --- server: Flower's wrappers with the accounting added -------------------------------------------


class _Accounted:
    """Put before a Flower DP wrapper: counters stay out of the clipped update, and every release is
    accounted with the noise that was really added over the sensitivity that really held."""

    ledger: PrivacyLedger
    sent: ArrayRecord

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self.sent = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        failed = [r for r in replies if r.has_error()]
        if failed and hasattr(self.strategy, "_count_in"):
            # Flower's DP wrappers skip the whole round when a site failed; here the round goes on with
            # the sites that answered (accounted below with the weaker noise that implies), and the
            # failures are recorded as in any run.
            self.strategy._count_in(server_round + self.strategy.round_offset, failed)
        replies = [r for r in replies if not r.has_error()]
        if hasattr(self.strategy, "_screen_updates"):  # a malformed update is refused before it is clipped
            replies = self.strategy._screen_updates(server_round + self.strategy.round_offset, replies)
        for reply in replies:
            reply.content["arrays"] = keep_counters(reply.content["arrays"], self.sent)
        clipped_at = self.clipping_norm
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics  # nothing released: nothing spent
        averaged = len(replies)
        # Noise std = multiplier x norm / sampled sites; sensitivity of the average = clip / averaged sites.
        # Flower's adaptive wrappers update the norm before noising, hence the two norms.
        update_multiplier = self.noise_multiplier * (self.clipping_norm / clipped_at) * (averaged / self.num_sampled_clients)
        self.ledger.record_release(adaptive_round_multiplier(update_multiplier, getattr(self, "clipped_count_stddev", 0.0)))
        return valid_statistics(arrays), metrics


class ServerFixedClipping(_Accounted, DifferentialPrivacyServerSideFixedClipping):
    pass


class _TargetUnclippedShare:
    """Flower 1.42's adaptive wrappers count the *clipped* updates but apply Andrew et al.'s rule, which
    is written for the share left *unclipped*: as shipped, a round in which every update was clipped
    shrinks the norm further (1.0 -> 0.905 here), so the norm runs away from its target. The rule is
    given the unclipped share, and dp.target-quantile is that share."""

    def _geometric_update(self, clipped_fraction: float) -> None:
        super()._geometric_update(1.0 - clipped_fraction)


class ServerAdaptiveClipping(_Accounted, _TargetUnclippedShare, DifferentialPrivacyServerSideAdaptiveClipping):
    pass


class ClientFixedClipping(_Accounted, DifferentialPrivacyClientSideFixedClipping):
    pass


class ClientAdaptiveClipping(_Accounted, _TargetUnclippedShare, DifferentialPrivacyClientSideAdaptiveClipping):
    pass


class LocalDpAccounting(Strategy):
    """Local DP: the sites clip and noise (LocalDpMod); the server averages as usual and accounts one
    release per site and round."""

    def __init__(self, strategy: Strategy, noise_multiplier: float):
        super().__init__()
        self.strategy, self.noise_multiplier = strategy, noise_multiplier

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics
        self.ledger.record_release(self.noise_multiplier)
        return valid_statistics(arrays), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()


def _central_wrapper(dp: DPSection, strategy: Strategy, num_sites: int) -> Strategy:
    if dp.clipping == "fixed":
        wrapper = ServerFixedClipping if dp.mode == "central-server-clipping" else ClientFixedClipping
        return wrapper(strategy, dp.noise_multiplier, dp.clipping_norm, num_sites)
    count_stddev = dp.clipped_count_stddev or num_sites / 20
    if dp.noise_multiplier >= 2 * count_stddev:
        raise ValueError(
            f"key 'dp.noise-multiplier' = {dp.noise_multiplier} is invalid with adaptive clipping over {num_sites} "
            f"sites: it must be below 2 x dp.clipped-count-stddev = {2 * count_stddev:g}; raise "
            "dp.clipped-count-stddev (0 means sites / 20) or use dp.clipping = 'fixed'"
        )
    wrapper = ServerAdaptiveClipping if dp.mode == "central-server-clipping" else ClientAdaptiveClipping
    return wrapper(
        strategy,
        dp.noise_multiplier,
        num_sites,
        initial_clipping_norm=dp.clipping_norm,
        target_clipped_quantile=dp.target_quantile,
        clip_norm_lr=dp.clip_norm_lr,
        clipped_count_stddev=count_stddev,
    )


def private_strategy(cfg: RunConfig, strategy: Strategy, num_sites: int, num_examples: int, recorder: RunRecorder) -> Strategy:
    """`strategy` as dp.mode asks: unchanged when off, else inside Flower's DP wrapper, accounted into
    `recorder` (delta defaults to 1 / the training examples of all `num_sites` sites)."""
    if cfg.dp.mode == OFF:
        return strategy
    private = LocalDpAccounting(strategy, cfg.dp.noise_multiplier) if cfg.dp.mode == LOCAL else _central_wrapper(cfg.dp, strategy, num_sites)
    delta = cfg.dp.delta or 1.0 / max(num_examples, 2)
    private.ledger = PrivacyLedger(cfg.dp.mode, delta, recorder, earlier_releases(cfg.resume_from, cfg.dp.mode))
    return private


# --- site: Flower's mods on training replies -----------------------------------------------------

# LocalDpMod derives its noise std from (epsilon, delta) with the classic Gaussian-mechanism formula;
# any delta works, epsilon is chosen so that the std is noise-multiplier x sensitivity.
_LOCAL_DP_FORMULA_DELTA = 1e-5


def site_dp_mod(dp: DPSection):
    """The Flower mod that clips (and, for local DP, noises) a site's training reply; None when the
    server does all of it (or DP is off)."""
    if dp.mode == LOCAL:
        sensitivity = 2 * dp.clipping_norm
        epsilon = math.sqrt(2 * math.log(1.25 / _LOCAL_DP_FORMULA_DELTA)) / dp.noise_multiplier
        return LocalDpMod(dp.clipping_norm, sensitivity, epsilon, _LOCAL_DP_FORMULA_DELTA)
    if dp.mode == "central-client-clipping":
        return fixedclipping_mod if dp.clipping == "fixed" else adaptiveclipping_mod
    return None


def privacy_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """ClientApp mod for dp.mode: runs Flower's clipping / local-DP mod on training messages. Flower's
    mods expect one ArrayRecord; FedNCA-ML's public ETF is set aside while they look and handed to the
    training handler, so it is neither clipped nor counted in the update."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    flower_mod = site_dp_mod(RunConfig.from_run_config(context.run_config).dp)
    if flower_mod is None:
        return call_next(msg, context)
    etf = msg.content.array_records.get(ETF_KEY)
    if etf is not None:
        del msg.content[ETF_KEY]
    sent = msg.content["arrays"]

    def train_with_etf(inner: Message, ctx: Context) -> Message:
        if etf is not None:
            inner.content[ETF_KEY] = etf
        reply = call_next(inner, ctx)
        if not reply.has_error():
            reply.content["arrays"] = keep_counters(reply.content["arrays"], sent)
        return reply

    return flower_mod(msg, context, train_with_etf)
