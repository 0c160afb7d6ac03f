"""FedNCA-ML's strategy: FedAvg plus a server-held simplex ETF that rides along in every
training and evaluation message as its own ArrayRecord. The ETF is never aggregated (clients
keep it in non-persistent buffers, so it is not in their replies) and never changes. With
fednca.control-variates each round starts with a query for the sites' mean gradients at the
global weights, and each site's training message carries its correction c - c_i (fedskew.drift).
A site's side of it, for a ClientApp of one's own, is in fedskew.fednca_site."""

from __future__ import annotations

from collections.abc import Iterable

import json
from logging import WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.common.logger import log
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedskew.drift import control_shifts
from fedskew.models.fednca import etf_fingerprint
from fedskew.protocol import CONTROL_SHIFT_KEY, ETF_ECHO_KEY, ETF_KEY, GRADIENT_QUERY
from fedskew.results import RunRecorder
from fedskew.strategies.messages import Layout, training_reply_problem
from fedskew.strategies.recording import RecordingMixin


class FedNCA(RecordingMixin, FedAvg):
    def __init__(self, etf: torch.Tensor | np.ndarray, control_layout: Layout | None = None, **strategy_kwargs):
        """`etf`: the simplex ETF (dim, classes) every site's model classifies with (fedskew.models.fednca.simplex_etf);
        `strategy_kwargs`: FedAvg's, and `timeout` (s) for every wait for the sites. `control_layout` (the
        trainable parameters' names and shapes) turns on fednca.control-variates: each round then starts with a
        GRADIENT_QUERY that the sites must answer (fedskew's own ClientApp does)."""
        super().__init__(**strategy_kwargs)
        etf = torch.as_tensor(etf)
        self.etf_record = ArrayRecord({ETF_KEY: etf.detach().cpu().contiguous()})
        self.etf_crc32 = etf_fingerprint(etf)
        self.control_layout = control_layout

    def attach(self, recorder: RunRecorder, **options) -> None:
        super().attach(recorder, **options)
        recorder.extra["etf_crc32"] = self.etf_crc32
        resumed = recorder.extra.get("resumed_from")
        if resumed:
            earlier = json.loads((Path(resumed["run"]) / "summary.json").read_text()).get("etf_crc32")
            if earlier != self.etf_crc32:
                raise ValueError(f"resume-from: the earlier run's ETF (crc32 {earlier}) differs from this run's ({self.etf_crc32})")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        replies = list(replies)
        # Read before the replies are screened: a reply without the echo counts as trained on another ETF.
        echoed = [m.content.metric_records.get("metrics", {}).get(ETF_ECHO_KEY) for m in replies if not m.has_error()]
        mismatched = sum(crc != self.etf_crc32 for crc in echoed)
        if mismatched:
            log(WARNING, "round %d: %d site(s) trained against an ETF that differs from the server's", server_round, mismatched)
        self.record_extra("etf_checks", {"round": server_round + self.round_offset, "sites": len(echoed),
                                         "matching": len(echoed) - mismatched})
        return super().aggregate_train(server_round, replies)

    def extend_messages(self, messages: Iterable[Message]) -> list[Message]:
        # A new RecordDict per message: FedAvg shares one RecordDict object across its messages.
        return [
            Message(
                RecordDict({**dict(msg.content.items()), ETF_KEY: self.etf_record}),
                message_type=msg.metadata.message_type,
                dst_node_id=msg.metadata.dst_node_id,
            )
            for msg in messages
        ]

    def prepare_train(self, server_round: int, arrays: ArrayRecord, grid: Grid, messages: list[Message]) -> list[Message]:
        """With control variates: ask the sites about to train for their mean gradients at `arrays`, and send each site
        that answered usably its correction c - c_i. A site whose answer is missing or unusable (`training_reply_problem`:
        wrong arrays, NaN, a bad weight) is recorded as dropped with the reason and sits the round out, so every
        site that trains is corrected against the same c; fewer usable answers than min-available-sites end the run."""
        if self.control_layout is None:
            return messages
        trainees = [msg for msg in messages if msg.metadata.message_type == MessageType.TRAIN]
        queries = self._count_out(self.extend_messages([
            Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})}),
                    message_type=GRADIENT_QUERY, dst_node_id=msg.metadata.dst_node_id)
            for msg in trainees
        ]))
        replies = self._count_in(server_round, grid.send_and_receive(queries, timeout=self.timeout))
        self._record_missing(server_round, "mean gradient")
        answers = self._screened(server_round, replies, "mean gradient", lambda reply: training_reply_problem(
            reply.content, self.control_layout, self.weighted_by_key, self._declared_of(reply)))
        answered = {int(self._site_of(m)): m.content for m in answers if not m.has_error()}
        self.record_extra("control_variates", {"round": server_round, "sites_asked": len(queries),
                                               "sites_corrected": len(answered)})
        self.require_floor(server_round, len(answered), "mean gradient")
        shifts = control_shifts({node: content["arrays"].to_torch_state_dict() for node, content in answered.items()},
                                   {node: float(content["metrics"][self.weighted_by_key]) for node, content in answered.items()})
        return [
            Message(RecordDict({**dict(msg.content.items()), CONTROL_SHIFT_KEY: ArrayRecord(shifts[msg.metadata.dst_node_id])}),
                    message_type=msg.metadata.message_type, dst_node_id=msg.metadata.dst_node_id)
            for msg in trainees if msg.metadata.dst_node_id in shifts
        ]
