"""A mixin that makes any Flower strategy report what a fedskew run records: bytes actually
serialised in each direction per site, the latest aggregated train/validation metrics, and
which sites failed in each round (with their reason)."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.serde import recorddict_to_proto
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedskew.results import RunRecorder


EXAMPLES_KEY = "num-examples"


def payload_nbytes(message: Message) -> int:
    """Size of the message content as Flower serialises it for the wire."""
    return recorddict_to_proto(message.content).ByteSize() if message.has_content() else 0


class RecordingMixin:
    """Put before a Flower strategy in the bases: `class X(RecordingMixin, FedAvg)`."""

    recorder: RunRecorder
    last_train_metrics: dict
    last_val_metrics: dict

    def attach(self, recorder: RunRecorder, round_offset: int = 0, refused: set[int] = frozenset()) -> None:
        """Record into `recorder`; a resumed run numbers its rounds after `round_offset`, so the
        sites' schedules and seeds continue where the earlier run stopped. `refused` nodes (refused at
        the site survey) are sent nothing."""
        self.recorder = recorder
        self.round_offset = round_offset
        self.refused = set(refused)
        self.destinations: dict[str, int] = {}
        self.last_train_metrics, self.last_val_metrics = {}, {}

    def _count_out(self, messages: Iterable[Message]) -> list[Message]:
        messages = [msg for msg in messages if msg.metadata.dst_node_id not in self.refused]
        for msg in messages:
            # The SuperLink answers for a vanished node with its own id as the source, so replies
            # are traced back to their site through the id of the message they answer.
            self.destinations[msg.object_id] = msg.metadata.dst_node_id
            self.recorder.count_bytes("sent", str(msg.metadata.dst_node_id), payload_nbytes(msg))
        return messages

    def _count_in(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        for msg in replies:
            site = str(self.destinations.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id))
            if msg.has_error():
                self.recorder.record_dropout(server_round, site, msg.error.reason)
            else:
                self.recorder.count_bytes("received", site, payload_nbytes(msg))
        return replies

    def extend_messages(self, messages: Iterable[Message]) -> Iterable[Message]:
        """Hook for strategies that send more than the base strategy (counted as sent)."""
        return messages

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self._count_out(self.extend_messages(super().configure_train(server_round + self.round_offset, arrays, config, grid)))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self._count_out(self.extend_messages(super().configure_evaluate(server_round + self.round_offset, arrays, config, grid)))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        server_round += self.round_offset
        arrays, metrics = super().aggregate_train(server_round, self._count_in(server_round, replies))
        self.last_train_metrics = dict(metrics) if metrics is not None else {}
        return arrays, metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        server_round += self.round_offset
        replies = self._count_in(server_round, replies)
        metrics = super().aggregate_evaluate(server_round, replies)
        if metrics is not None and self.weighted_by_key != EXAMPLES_KEY:
            # Validation metrics pick the best round: always weighted by examples, whatever the model averaging.
            metrics = aggregate_metricrecords([m.content for m in replies if not m.has_error()], EXAMPLES_KEY)
        self.last_val_metrics = dict(metrics) if metrics is not None else {}
        return metrics
