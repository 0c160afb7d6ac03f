"""FedNCA-ML's strategy: FedAvg plus a server-held simplex ETF that rides along in every
training and evaluation message as its own ArrayRecord. The ETF is never aggregated (clients
keep it in non-persistent buffers, so it is not in their replies) and never changes."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedskew.strategies.recording import RecordingMixin

ETF_KEY = "etf"


class FedNCA(RecordingMixin, FedAvg):
    def __init__(self, etf: torch.Tensor, **fedavg_kwargs):
        super().__init__(**fedavg_kwargs)
        self.etf_record = ArrayRecord({ETF_KEY: etf.detach().cpu().contiguous()})

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
