"""A mixin that makes any Flower strategy report what a fedskew run records: bytes actually
serialised in each direction per site, the latest aggregated train/validation metrics, and
which sites failed in each round (with their reason). Recording is optional: a strategy that is
never attached to a RunRecorder (one started in someone else's ServerApp) records nothing, numbers
its rounds from 1 and sends to every connected node, and still bounds its waits, holds its rounds
to the floor and refuses replies that cannot be averaged."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedskew.protocol import VAL_COUNTS_KEY
from fedskew.results import RunRecorder
from fedskew.strategies.messages import (
    EXAMPLES_KEY,
    Declared,
    Layout,
    arrays_layout,
    summed_counts,
    training_reply_problem,
    validation_report_problem,
)


def payload_nbytes(message: Message) -> int:
    """Size of the message content as Flower serialises it for the wire."""
    return recorddict_to_proto(message.content).ByteSize() if message.has_content() else 0


class TooFewSites(RuntimeError):
    """Fewer sites than min-available-sites answered usably (or were connected) in a round: the run ends."""


class ConnectedNodes:
    """The one Grid call Flower's sampling makes (`get_node_ids`), answered with nodes already chosen, so that
    its wait for `min_available_nodes` (unbounded in Flower) never starts: RecordingMixin waits instead."""

    def __init__(self, node_ids: list[int]):
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


class RecordingMixin:
    """Put before a Flower strategy in the bases: `class X(RecordingMixin, FedAvg)`. Besides recording, it
    bounds every wait for the sites by `timeout` (run-config round-timeout) and holds each round to the floor
    `min_available_nodes` (run-config min-available-sites): fewer sites connected, or fewer usable replies,
    end the run with TooFewSites naming the round and why the others are missing.

    Without `attach` the strategy stands alone: no recorder, round offset 0, no survey (every connected node is
    asked and a site's weight is bounded by nothing it declared), and a validation report may hold any metrics
    (only its structure and its weights are checked), since the app's report keys are the app's own."""

    recorder: RunRecorder | None
    last_train_metrics: dict
    last_val_metrics: dict
    last_val_counts: np.ndarray | None
    min_available_nodes: int

    def __init__(self, *args, timeout: float = 3600.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.timeout = timeout
        self._begin(None)

    def attach(
        self, recorder: RunRecorder, round_offset: int = 0, declared: Mapping[int, Declared] | None = None,
        counts_shape: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        """Record into `recorder`; a resumed run numbers its rounds after `round_offset`, so the
        sites' schedules and seeds continue where the earlier run stopped. `declared`: what each site of
        the survey declared (fedskew.strategies.messages.declared_sites); only those nodes are sent anything
        and their replies are held to it (None: every connected node, unbounded, for tests of other parts).
        `counts_shape` (multi-label runs): the shape of the validation threshold counts every site reports;
        the sites' counts are summed, not averaged."""
        self._begin(recorder, round_offset, declared, counts_shape)
        if self.declared:
            # Results name sites by their site id; Flower knows them by node id (bytes, dropouts): the key between.
            recorder.extra["site_ids"] = {str(node): d.site_id for node, d in sorted(self.declared.items())}

    def _begin(
        self, recorder: RunRecorder | None, round_offset: int = 0, declared: Mapping[int, Declared] | None = None,
        counts_shape: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        self.recorder = recorder
        self.round_offset = round_offset
        self.declared = None if declared is None else dict(declared)
        self.counts_shape = counts_shape
        self.destinations: dict[str, int] = {}
        self.asked: set[int] = set()  # the sites of the last exchange, and those of them that replied
        self.answered: set[int] = set()
        self.last_train_metrics, self.last_val_metrics, self.last_val_counts = {}, {}, None
        self.sent_layout: Layout = {}
        self.accepted_updates = 0
        self.dropped: list[dict] = []  # {"round", "site", "reason"} of every site this strategy dropped

    def record_extra(self, key: str, entry: dict) -> None:
        """Append `entry` to the recorder's list `key` (summary.json); nothing when no recorder is attached."""
        if self.recorder is not None:
            self.recorder.extra.setdefault(key, []).append(entry)

    def site_name(self, node: int | str) -> str:
        """How logs and reasons name a site: its declared site id beside its node id, when it has one."""
        declared = (self.declared or {}).get(int(node))
        return f"site {node}" if declared is None else f"site {declared.site_id} (node {node})"

    def _declared_of(self, reply: Message) -> Declared | None:
        return None if self.declared is None else self.declared.get(int(self._site_of(reply)))

    def _count_out(self, messages: Iterable[Message]) -> list[Message]:
        messages = [msg for msg in messages if self.declared is None or msg.metadata.dst_node_id in self.declared]
        self.asked, self.answered = {msg.metadata.dst_node_id for msg in messages}, set()
        for msg in messages:
            self.destinations[msg.object_id] = msg.metadata.dst_node_id
            if self.recorder is not None:
                self.recorder.count_bytes("sent", str(msg.metadata.dst_node_id), payload_nbytes(msg))
        return messages

    def _site_of(self, reply: Message) -> str:
        # The SuperLink answers for a vanished node with its own id as the source, so replies
        # are traced back to their site through the id of the message they answer.
        return str(self.destinations.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id))

    def _site_order(self, reply: Message) -> tuple[int, int]:
        node = int(self._site_of(reply))
        declared = (self.declared or {}).get(node)
        return (node if declared is None else declared.site_id, node)

    def _count_in(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """Count the replies' bytes; a site that answered with an error is recorded as dropped with the reason.
        The replies come back in the order of their sites (declared site id, else node id): Flower samples the
        nodes in a random order and sums the float32 updates in it, so the same seed would otherwise give a
        different average, and a different run, each time."""
        replies = sorted(replies, key=self._site_order)
        for msg in replies:
            site = self._site_of(msg)
            self.answered.add(int(site))
            if msg.has_error():
                self._drop(server_round, site, msg.error.reason)
            elif self.recorder is not None:
                self.recorder.count_bytes("received", site, payload_nbytes(msg))
        return replies

    def _record_missing(self, server_round: int, what: str) -> None:
        """Record every site asked in the last exchange that sent no reply at all (not even an error) as dropped:
        the round timeout passed first."""
        for node in sorted(self.asked - self.answered):
            self._refuse(server_round, str(node), f"{self.site_name(node)}: round {server_round} {what} missing: no "
                                                  f"answer within the round timeout ({self.timeout} s)")
        self.answered |= self.asked

    def extend_messages(self, messages: Iterable[Message]) -> Iterable[Message]:
        """Hook for strategies that send more than the base strategy (counted as sent)."""
        return messages

    def prepare_train(self, server_round: int, arrays: ArrayRecord, grid: Grid, messages: list[Message]) -> list[Message]:
        """Hook for strategies that exchange more with the sites before they train (FedNCA-ML's control
        variates); the training messages to send."""
        return messages

    def available_sites(self, grid: Grid, server_round: int) -> ConnectedNodes:
        """The connected nodes to ask this round (those of the survey when there is one), once at least
        `min_available_nodes` are connected; after `timeout` s with fewer, TooFewSites."""
        deadline = time.monotonic() + self.timeout
        while True:
            nodes = sorted(n for n in grid.get_node_ids() if self.declared is None or n in self.declared)
            if len(nodes) >= self.min_available_nodes:
                return ConnectedNodes(nodes)
            if time.monotonic() >= deadline:
                raise TooFewSites(f"round {server_round}: {len(nodes)} site(s) connected after the round timeout "
                                  f"({self.timeout} s), fewer than min-available-sites = {self.min_available_nodes}")
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def require_floor(self, server_round: int, usable: int, what: str, refusals: Iterable[str] = ()) -> None:
        """End the run when fewer than `min_available_nodes` sites sent a usable `what` this round (sites were
        asked); the reasons of the round's dropouts (and `refusals` recorded elsewhere) say why the others did not."""
        if not self.asked or usable >= self.min_available_nodes:
            return
        lost = [d["reason"] if d["reason"].startswith("site ") else f"{self.site_name(d['site'])}: {d['reason']}"
                for d in self.dropped if d["round"] == server_round] + list(refusals)
        raise TooFewSites(f"round {server_round}: {usable} of {len(self.asked)} site(s) sent a usable {what}, fewer than "
                          f"min-available-sites = {self.min_available_nodes} (a floor for every round). "
                          + " | ".join(lost))  # fmt: skip

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        self.sent_layout = arrays_layout(arrays)
        server_round += self.round_offset
        nodes = self.available_sites(grid, server_round)
        messages = self.extend_messages(super().configure_train(server_round, arrays, config, nodes))
        return self._count_out(self.prepare_train(server_round, arrays, grid, list(messages)))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        server_round += self.round_offset
        self.asked = set()
        if self.fraction_evaluate == 0.0:  # no federated evaluation: nobody to wait for
            return []
        nodes = self.available_sites(grid, server_round)
        return self._count_out(self.extend_messages(super().configure_evaluate(server_round, arrays, config, nodes)))

    def reply_layout(self) -> Layout:
        """The arrays a site's training reply must hold: the model sent (SCAFFOLD adds its control deltas)."""
        return self.sent_layout

    def _screen_updates(self, server_round: int, replies: list[Message]) -> list[Message]:
        """Training replies that cannot be averaged (`training_reply_problem`) are recorded as dropped, with the
        reason, and left out; the round goes on with the others."""
        kept = self._screened(server_round, replies, "update", lambda reply: training_reply_problem(
            reply.content, self.reply_layout(), self.weighted_by_key, self._declared_of(reply)))
        self.accepted_updates = sum(not reply.has_error() for reply in kept)
        return kept

    def _screened(self, server_round: int, replies: list[Message], what: str,
                  problem_of: Callable[[Message], str | None]) -> list[Message]:  # fmt: skip
        kept = []
        for reply in replies:
            problem = None if reply.has_error() else problem_of(reply)
            if problem is None:
                kept.append(reply)
                continue
            site = self._site_of(reply)
            self._refuse(server_round, site, f"{self.site_name(site)}: round {server_round} {what} refused: {problem}")
        return kept

    def _drop(self, server_round: int, site: str, reason: str) -> None:
        self.dropped.append({"round": server_round, "site": site, "reason": reason})
        if self.recorder is None:
            return
        self.recorder.record_dropout(server_round, site, reason)
        declared = (self.declared or {}).get(int(site))
        if declared is not None:
            self.recorder.dropped[-1]["site-id"] = declared.site_id

    def _refuse(self, server_round: int, site: str, reason: str) -> None:
        print(reason, flush=True)
        self._drop(server_round, site, reason)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        server_round += self.round_offset
        replies = self._count_in(server_round, replies)
        self._record_missing(server_round, "training reply")
        replies = self._screen_updates(server_round, replies)
        self.require_floor(server_round, self.accepted_updates, "training reply")
        arrays, metrics = super().aggregate_train(server_round, replies)
        self.last_train_metrics = dict(metrics) if metrics is not None else {}
        return arrays, metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        server_round += self.round_offset
        attached = self.recorder is not None  # the app's report (its keys, weighted by examples), else any metrics
        weights = {self.weighted_by_key, EXAMPLES_KEY} if attached else {self.weighted_by_key}
        multilabel = (self.counts_shape is not None) if attached else None
        replies = self._count_in(server_round, replies)
        self._record_missing(server_round, "validation report")
        replies = self._screened(server_round, replies, "validation report", lambda reply: validation_report_problem(
                                     reply.content, weights, multilabel, self._declared_of(reply)))
        replies = self._sum_counts(server_round, replies)
        self.require_floor(server_round, sum(not m.has_error() for m in replies), "validation report")
        metrics = super().aggregate_evaluate(server_round, replies)
        if metrics is not None and attached and self.weighted_by_key != EXAMPLES_KEY:
            # Validation metrics pick the best round: always weighted by examples, whatever the model averaging.
            metrics = aggregate_metricrecords([m.content for m in replies if not m.has_error()], EXAMPLES_KEY)
        self.last_val_metrics = dict(metrics) if metrics is not None else {}
        # Flower averaged the counts like any metric; what the round's threshold is chosen on is their sum
        # (last_val_counts). Nor are they returned: Flower logs what is, and they are hundreds of numbers a round.
        self.last_val_metrics.pop(VAL_COUNTS_KEY, None)
        return None if metrics is None else MetricRecord(self.last_val_metrics)

    def _sum_counts(self, server_round: int, replies: list[Message]) -> list[Message]:
        """Sum the sites' validation threshold counts into last_val_counts; replies whose counts are
        malformed or beyond what the site declared are recorded as dropped and left out of the round's
        validation."""
        self.last_val_counts = None
        if self.counts_shape is None:
            return replies
        # Screened replies: each holds its MetricRecord "metrics".
        usable = [m for m in replies if not m.has_error()]
        reported = {self._site_of(m): m.content["metrics"].get(VAL_COUNTS_KEY) for m in usable}
        self.last_val_counts, refused = summed_counts(reported, self.counts_shape,
                                                      {self._site_of(m): self._declared_of(m) for m in usable})
        for site, problem in refused.items():
            self._refuse(server_round, site, f"{self.site_name(site)}: round {server_round} validation report refused: {problem}")
        return [m for m in replies if m.has_error() or self._site_of(m) not in refused]
