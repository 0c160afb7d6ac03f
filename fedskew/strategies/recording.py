"""A mixin that makes any Flower strategy report what a fedskew run records: bytes actually
serialised in each direction per site, the latest aggregated train/validation metrics, and
which sites failed in each round (with their reason)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedskew.client_tasks import SINGLE_LABEL_VAL_KEYS, UNIT_WEIGHT_KEY, VAL_COUNTS_KEY
from fedskew.results import RunRecorder


EXAMPLES_KEY = "num-examples"


def summed_counts(reported: dict[str, object], shape: tuple[int, ...]) -> tuple[np.ndarray | None, dict[str, str]]:
    """(the sum of the sites' validation threshold counts, refused site -> reason). A site's counts must be
    a list of prod(shape) non-negative integers (thresholds x classes x [tp, fp, fn]); a site whose counts
    are not is left out of the sum (and so of the round's validation) with the reason. None when no
    site's counts are usable."""
    total, refused = np.zeros(shape, dtype=np.int64), {}
    size = int(np.prod(shape))
    for site, counts in reported.items():
        values = np.asarray(counts if isinstance(counts, list) else [], dtype=np.float64)
        if values.shape != (size,) or not np.all(np.isfinite(values) & (values >= 0) & (values == np.round(values))):
            found = f"{len(counts)} values" if isinstance(counts, list) else "none"
            refused[site] = (f"site {site}: validation report refused: '{VAL_COUNTS_KEY}' must be {size} non-negative "
                             f"integers (thresholds x classes x [tp, fp, fn] = {' x '.join(map(str, shape))}); found "
                             f"{found}{' (not all non-negative integers)' if values.shape == (size,) else ''}")  # fmt: skip
            continue
        total += values.astype(np.int64).reshape(shape)
    return (total if len(refused) < len(reported) else None), refused


Layout = dict[str, tuple[int, ...]]  # array name -> shape


def arrays_layout(arrays: ArrayRecord) -> Layout:
    """The names and shapes of the arrays in a record."""
    return {name: tuple(array.shape) for name, array in arrays.items()}


def update_problem(content: RecordDict, layout: Layout, weight_key: str) -> str | None:
    """Why a site's training reply cannot be averaged into the model, or None when it can: it must hold one
    ArrayRecord `arrays` with exactly the arrays of `layout` (same shapes, real numbers, float values
    finite; integer or float either way, since the average of a site's integer counter arrives as a
    float) and one MetricRecord `metrics` whose `weight_key` is a finite number > 0. A site that sends
    anything else (a bug, a damaged message or a forged one) would otherwise abort the round in Flower's
    averaging, or poison the model with NaN or a huge weight."""
    if list(content.array_records) != ["arrays"] or list(content.metric_records) != ["metrics"]:
        return (f"expected one ArrayRecord 'arrays' and one MetricRecord 'metrics', found ArrayRecords "
                f"{sorted(content.array_records)} and MetricRecords {sorted(content.metric_records)}")
    arrays = content["arrays"]
    missing, unknown = sorted(layout.keys() - arrays.keys()), sorted(arrays.keys() - layout.keys())
    if missing or unknown:
        return (f"its arrays are not the model's: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                f"unknown {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for name, shape in layout.items():
        try:
            value = arrays[name].numpy()
        except Exception as exc:  # any damage to the serialised bytes: refuse the reply, never the round
            return f"array '{name}' cannot be read ({type(exc).__name__}: {exc})"
        if value.shape != shape or value.dtype.kind not in "fiu":
            return f"array '{name}' has shape {value.shape} and dtype {value.dtype}; the model's has shape {shape}, real numbers"
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"array '{name}' holds NaN or infinite values"
    return weight_problem(content["metrics"], weight_key)


def weight_problem(metrics: MetricRecord, key: str) -> str | None:
    weight = metrics.get(key)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        return f"metric '{key}' must be a finite number > 0, found {weight!r}"
    return None


def report_problem(content: RecordDict, weight_keys: Iterable[str], multilabel: bool) -> str | None:
    """Why a site's validation reply cannot be averaged, or None when it can: one MetricRecord `metrics` and
    nothing else, the weights finite and > 0, and the validation report's keys: the threshold counts
    (multi-label; checked when summed) or accuracies in [0, 1] (single-label). Flower's averaging would
    otherwise abort the round, or let one site's value stand for all."""
    if list(content.array_records) or list(content.config_records) or list(content.metric_records) != ["metrics"]:
        return (f"expected only a MetricRecord 'metrics', found ArrayRecords {sorted(content.array_records)}, "
                f"ConfigRecords {sorted(content.config_records)}, MetricRecords {sorted(content.metric_records)}")
    metrics = content["metrics"]
    for key in weight_keys:
        if (problem := weight_problem(metrics, key)) is not None:
            return problem
    report_keys = (VAL_COUNTS_KEY,) if multilabel else SINGLE_LABEL_VAL_KEYS
    unexpected = sorted(set(metrics) - set(report_keys) - {EXAMPLES_KEY, UNIT_WEIGHT_KEY})
    if unexpected or any(key not in metrics for key in report_keys):
        return f"its metrics are {sorted(metrics)}; a validation report holds {sorted(report_keys)} and the weights"
    for key in () if multilabel else report_keys:
        value = metrics[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            return f"metric '{key}' must be a number in [0, 1], found {value!r}"
    return None


def payload_nbytes(message: Message) -> int:
    """Size of the message content as Flower serialises it for the wire."""
    return recorddict_to_proto(message.content).ByteSize() if message.has_content() else 0


class RecordingMixin:
    """Put before a Flower strategy in the bases: `class X(RecordingMixin, FedAvg)`."""

    recorder: RunRecorder
    last_train_metrics: dict
    last_val_metrics: dict
    last_val_counts: np.ndarray | None

    def attach(
        self, recorder: RunRecorder, round_offset: int = 0, refused: set[int] = frozenset(),
        counts_shape: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        """Record into `recorder`; a resumed run numbers its rounds after `round_offset`, so the
        sites' schedules and seeds continue where the earlier run stopped. `refused` nodes (refused at
        the site survey) are sent nothing. `counts_shape` (multi-label runs): the shape of the
        validation threshold counts every site reports; the sites' counts are summed, not averaged."""
        self.recorder = recorder
        self.round_offset = round_offset
        self.refused = set(refused)
        self.counts_shape = counts_shape
        self.destinations: dict[str, int] = {}
        self.last_train_metrics, self.last_val_metrics, self.last_val_counts = {}, {}, None
        self.sent_layout: Layout = {}
        self.accepted_updates = 0

    def _count_out(self, messages: Iterable[Message]) -> list[Message]:
        messages = [msg for msg in messages if msg.metadata.dst_node_id not in self.refused]
        for msg in messages:
            self.destinations[msg.object_id] = msg.metadata.dst_node_id
            self.recorder.count_bytes("sent", str(msg.metadata.dst_node_id), payload_nbytes(msg))
        return messages

    def _site_of(self, reply: Message) -> str:
        # The SuperLink answers for a vanished node with its own id as the source, so replies
        # are traced back to their site through the id of the message they answer.
        return str(self.destinations.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id))

    def _count_in(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        for msg in replies:
            site = self._site_of(msg)
            if msg.has_error():
                self.recorder.record_dropout(server_round, site, msg.error.reason)
            else:
                self.recorder.count_bytes("received", site, payload_nbytes(msg))
        return replies

    def extend_messages(self, messages: Iterable[Message]) -> Iterable[Message]:
        """Hook for strategies that send more than the base strategy (counted as sent)."""
        return messages

    def prepare_train(self, server_round: int, arrays: ArrayRecord, grid: Grid, messages: list[Message]) -> list[Message]:
        """Hook for strategies that exchange more with the sites before they train (FedNCA-ML's control
        variates); the training messages to send."""
        return messages

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self.sent_layout = arrays_layout(arrays)
        server_round += self.round_offset
        messages = self.extend_messages(super().configure_train(server_round, arrays, config, grid))
        return self._count_out(self.prepare_train(server_round, arrays, grid, list(messages)))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self._count_out(self.extend_messages(super().configure_evaluate(server_round + self.round_offset, arrays, config, grid)))

    def reply_layout(self) -> Layout:
        """The arrays a site's training reply must hold: the model sent (SCAFFOLD adds its control deltas)."""
        return self.sent_layout

    def _screen_updates(self, server_round: int, replies: list[Message]) -> list[Message]:
        """Training replies that cannot be averaged (`update_problem`) are recorded as dropped, with the
        reason, and left out; the round goes on with the others."""
        kept = self._screened(server_round, replies, "update", lambda content: update_problem(
            content, self.reply_layout(), self.weighted_by_key))
        self.accepted_updates = sum(not reply.has_error() for reply in kept)
        return kept

    def _screened(self, server_round: int, replies: list[Message], what: str, problem_of) -> list[Message]:
        kept = []
        for reply in replies:
            problem = None if reply.has_error() else problem_of(reply.content)
            if problem is None:
                kept.append(reply)
                continue
            site = self._site_of(reply)
            self._refuse(server_round, site, f"site {site}: round {server_round} {what} refused: {problem}")
        return kept

    def _refuse(self, server_round: int, site: str, reason: str) -> None:
        print(reason, flush=True)
        self.recorder.record_dropout(server_round, site, reason)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        server_round += self.round_offset
        replies = self._screen_updates(server_round, self._count_in(server_round, replies))
        arrays, metrics = super().aggregate_train(server_round, replies)
        self.last_train_metrics = dict(metrics) if metrics is not None else {}
        return arrays, metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        server_round += self.round_offset
        weights = {self.weighted_by_key, EXAMPLES_KEY}
        replies = self._screened(server_round, self._count_in(server_round, replies), "validation report",
                                 lambda content: report_problem(content, weights, self.counts_shape is not None))
        replies = self._sum_counts(server_round, replies)
        metrics = super().aggregate_evaluate(server_round, replies)
        if metrics is not None and self.weighted_by_key != EXAMPLES_KEY:
            # Validation metrics pick the best round: always weighted by examples, whatever the model averaging.
            metrics = aggregate_metricrecords([m.content for m in replies if not m.has_error()], EXAMPLES_KEY)
        self.last_val_metrics = dict(metrics) if metrics is not None else {}
        # Flower averaged the counts like any metric; what the round's threshold is chosen on is their sum.
        self.last_val_metrics.pop(VAL_COUNTS_KEY, None)
        return metrics

    def _sum_counts(self, server_round: int, replies: list[Message]) -> list[Message]:
        """Sum the sites' validation threshold counts into last_val_counts; replies whose counts are
        malformed are recorded as dropped and left out of the round's validation."""
        self.last_val_counts = None
        if self.counts_shape is None:
            return replies
        # Screened replies: each holds its MetricRecord "metrics".
        reported = {self._site_of(m): m.content["metrics"].get(VAL_COUNTS_KEY) for m in replies if not m.has_error()}
        self.last_val_counts, refused = summed_counts(reported, self.counts_shape)
        for site, reason in refused.items():
            self._refuse(server_round, site, reason)
        return [m for m in replies if m.has_error() or self._site_of(m) not in refused]
