"""SCAFFOLD and FedDyn as Message-API strategies: FedAvg's rounds plus the server half of each
method's drift correction (the maths is in fedskew.drift). Sites keep their half between rounds
(fedskew.site_state)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedskew.drift import SCAFFOLD_DELTA_PREFIX, feddyn_server_update, scaffold_server_update
from fedskew.protocol import SCAFFOLD_CONTROL_KEY
from fedskew.strategies.recording import RecordingMixin


class ServerCorrection(RecordingMixin, FedAvg):
    """FedAvg's aggregation followed by a method's server-side correction of the averaged arrays."""

    num_sites: int

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics
        participation = self.accepted_updates / self.num_sites  # sites whose update went into the average
        return ArrayRecord(self.corrected(arrays.to_torch_state_dict(), participation)), metrics

    def corrected(self, averaged: dict[str, torch.Tensor], participation: float) -> dict[str, torch.Tensor]:
        """The next global model from the sites' weighted average; `participation`: share of sites that answered."""
        raise NotImplementedError


class Scaffold(ServerCorrection):
    """Sends the server control variate c with every training instruction (its own ArrayRecord);
    sites answer with their new model and delta_c in one ArrayRecord (delta keys prefixed)."""

    def __init__(self, parameter_shapes: dict[str, torch.Size], num_sites: int, **fedavg_kwargs):
        super().__init__(**fedavg_kwargs)
        self.control = {name: torch.zeros(shape) for name, shape in parameter_shapes.items()}
        self.num_sites = num_sites

    def extend_messages(self, messages: Iterable[Message]) -> list[Message]:
        control = ArrayRecord(self.control)
        return [
            Message(
                RecordDict({**dict(msg.content.items()), SCAFFOLD_CONTROL_KEY: control}),
                message_type=msg.metadata.message_type,
                dst_node_id=msg.metadata.dst_node_id,
            )
            if msg.metadata.message_type == MessageType.TRAIN
            else msg
            for msg in messages
        ]

    def reply_layout(self):
        deltas = {SCAFFOLD_DELTA_PREFIX + name: tuple(value.shape) for name, value in self.control.items()}
        return {**super().reply_layout(), **deltas}

    def corrected(self, averaged: dict[str, torch.Tensor], participation: float) -> dict[str, torch.Tensor]:
        mean_delta = {k.removeprefix(SCAFFOLD_DELTA_PREFIX): v for k, v in averaged.items() if k.startswith(SCAFFOLD_DELTA_PREFIX)}
        self.control = scaffold_server_update(self.control, mean_delta, participation)
        return {k: v for k, v in averaged.items() if not k.startswith(SCAFFOLD_DELTA_PREFIX)}


class FedDyn(ServerCorrection):
    """Keeps the server state h; the new global model is the sites' average corrected by -h / alpha."""

    def __init__(self, parameter_shapes: dict[str, torch.Size], num_sites: int, alpha: float, **fedavg_kwargs):
        super().__init__(**fedavg_kwargs)
        self.h = {name: torch.zeros(shape) for name, shape in parameter_shapes.items()}
        self.num_sites = num_sites
        self.alpha = alpha
        self.sent: dict[str, torch.Tensor] = {}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        state = arrays.to_torch_state_dict()
        self.sent = {name: state[name] for name in self.h}
        return super().configure_train(server_round, arrays, config, grid)

    def corrected(self, averaged: dict[str, torch.Tensor], participation: float) -> dict[str, torch.Tensor]:
        self.h, corrected = feddyn_server_update(
            self.h, self.sent, {name: averaged[name] for name in self.h}, self.alpha, participation
        )
        return {**averaged, **corrected}
