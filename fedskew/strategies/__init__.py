"""Strategies by run-config `method`: Flower's own where they suffice, subclassed only for what we add."""

from __future__ import annotations

from flwr.serverapp.strategy import FedAvg, FedProx

import torch

from fedskew.config import RunConfig
from fedskew.strategies.fednca import FedNCA
from fedskew.strategies.recording import RecordingMixin


class RecordedFedAvg(RecordingMixin, FedAvg):
    pass


class RecordedFedProx(RecordingMixin, FedProx):
    pass


def weight_key(cfg: RunConfig) -> str:
    # Clients report both keys; "unit-weight" (always 1) turns the average unweighted.
    return "num-examples" if cfg.aggregation == "weighted" else "unit-weight"


def build_strategy(cfg: RunConfig, num_sites: int, etf: torch.Tensor | None = None) -> FedAvg:
    """The strategy for `cfg.method`; every site trains and validates each round."""
    common = dict(
        fraction_train=1.0,
        # Sites validate the global model on their local split; with no split there is nothing to do.
        fraction_evaluate=1.0 if cfg.val_fraction > 0 else 0.0,
        min_train_nodes=min(cfg.min_available_sites, num_sites),
        min_evaluate_nodes=min(cfg.min_available_sites, num_sites),
        min_available_nodes=min(cfg.min_available_sites, num_sites),
        weighted_by_key=weight_key(cfg),
    )
    if cfg.method == "fedavg":
        return RecordedFedAvg(**common)
    if cfg.method == "fedprox":
        return RecordedFedProx(proximal_mu=cfg.proximal_mu, **common)
    if cfg.method == "fednca":
        return FedNCA(etf, **common)
    raise ValueError(f"method {cfg.method!r} has no federated strategy; valid: fedavg, fedprox, fednca")
