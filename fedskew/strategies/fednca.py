"""FedNCA-ML's strategy: FedAvg plus a server-held simplex ETF that rides along in every
training and evaluation message as its own ArrayRecord. The ETF is never aggregated (clients
keep it in non-persistent buffers, so it is not in their replies) and never changes."""

from __future__ import annotations

from collections.abc import Iterable

import json
from logging import WARNING
from pathlib import Path

import torch
from flwr.common.logger import log
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedskew.models.fednca import etf_fingerprint
from fedskew.results import RunRecorder
from fedskew.strategies.recording import RecordingMixin

ETF_KEY = "etf"


class FedNCA(RecordingMixin, FedAvg):
    def __init__(self, etf: torch.Tensor, **fedavg_kwargs):
        super().__init__(**fedavg_kwargs)
        self.etf_record = ArrayRecord({ETF_KEY: etf.detach().cpu().contiguous()})
        self.etf_crc32 = etf_fingerprint(etf)

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
        echoed = [m.content.metric_records.get("metrics", {}).get("etf-crc32") for m in replies if not m.has_error()]
        mismatched = sum(crc != self.etf_crc32 for crc in echoed)
        if mismatched:
            log(WARNING, "round %d: %d site(s) trained against an ETF that differs from the server's", server_round, mismatched)
        self.recorder.extra.setdefault("etf_checks", []).append(
            {"round": server_round + self.round_offset, "sites": len(echoed), "matching": len(echoed) - mismatched}
        )
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
