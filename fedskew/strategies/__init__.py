"""Strategies by run-config `method`: Flower's own where they suffice, subclassed only for what we add.
Each is also a plain Flower strategy for a ServerApp of one's own (FedNCA, Scaffold, FedDyn, the Recorded*
classes): built from plain arguments, started with Flower's `start`, recording only when attached (docs/api.md)."""

from __future__ import annotations

from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedMedian, FedProx, FedTrimmedAvg, FedYogi

import torch
from torch import nn

from fedskew.config import FEDERATED_METHODS, RunConfig
from fedskew.protocol import EXAMPLES_KEY, UNIT_WEIGHT_KEY
from fedskew.strategies.drift import FedDyn, Scaffold
from fedskew.strategies.fednca import FedNCA
from fedskew.strategies.recording import RecordingMixin


class RecordedFedAvg(RecordingMixin, FedAvg):
    pass


class RecordedFedProx(RecordingMixin, FedProx):
    pass


class AveragedBuffers:
    """For Flower's adaptive server optimisers (FedAdam, FedYogi, FedAdagrad), which step every array of the
    model by their adaptive rule: Reddi et al. step the trainable parameters, and BatchNorm's running statistics
    (buffers, not parameters), moved by at most about eta a round, cannot follow the data's statistics; the model
    then normalises with the wrong ones (FedAdam at the default server-lr 0.01 stayed at chance for 3 rounds on
    tiny data it learns in 2 with the buffers averaged). The buffers take the sites' average, as in FedAvg."""

    def __init__(self, *args, buffers: frozenset[str], **kwargs):
        super().__init__(*args, **kwargs)
        self.buffers = buffers
        self._averaged_buffers: dict = {}

    def _compute_deltat_and_mt(self, aggregated_arrayrecord: ArrayRecord):
        delta_t, m_t, averaged = super()._compute_deltat_and_mt(aggregated_arrayrecord)
        self._averaged_buffers = {name: averaged[name] for name in self.buffers}
        return delta_t, m_t, averaged

    def aggregate_train(self, server_round: int, replies):
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is not None:
            arrays = ArrayRecord({name: Array(self._averaged_buffers[name]) if name in self.buffers else array
                                  for name, array in arrays.items()})  # fmt: skip
        return arrays, metrics


class RecordedFedAdam(RecordingMixin, AveragedBuffers, FedAdam):
    pass


class RecordedFedYogi(RecordingMixin, AveragedBuffers, FedYogi):
    pass


class RecordedFedAdagrad(RecordingMixin, AveragedBuffers, FedAdagrad):
    pass


class RecordedFedMedian(RecordingMixin, FedMedian):
    pass


class RecordedFedTrimmedAvg(RecordingMixin, FedTrimmedAvg):
    pass


SERVER_OPTIMISERS = {"fedadam": RecordedFedAdam, "fedyogi": RecordedFedYogi, "fedadagrad": RecordedFedAdagrad}


def weight_key(cfg: RunConfig) -> str:
    # Clients report both keys; the unit weight (always 1) turns the average unweighted.
    return EXAMPLES_KEY if cfg.aggregation == "weighted" else UNIT_WEIGHT_KEY


def build_strategy(cfg: RunConfig, num_sites: int, model: nn.Module, etf: torch.Tensor | None = None) -> FedAvg:
    """The strategy for `cfg.method`; every site trains and validates each round. `model` gives
    SCAFFOLD, FedDyn and FedNCA-ML's control variates the shapes of the parameters they cover."""
    common = dict(
        fraction_train=1.0,
        # Sites validate the global model on their local split; with no split there is nothing to do.
        fraction_evaluate=1.0 if cfg.val_fraction > 0 else 0.0,
        min_train_nodes=min(cfg.min_available_sites, num_sites),
        min_evaluate_nodes=min(cfg.min_available_sites, num_sites),
        min_available_nodes=min(cfg.min_available_sites, num_sites),
        weighted_by_key=weight_key(cfg),
        timeout=cfg.round_timeout,  # every wait for the sites, availability included
    )
    if cfg.method == "fedavg":
        return RecordedFedAvg(**common)
    if cfg.method == "fedprox":
        return RecordedFedProx(proximal_mu=cfg.proximal_mu, **common)
    if cfg.method == "fednca":
        trainable = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
        return FedNCA(etf, control_layout=trainable if cfg.fednca.control_variates else None, **common)
    if cfg.method in SERVER_OPTIMISERS:
        # Reddi et al.'s adaptive server optimisers; Flower's momentum and tau defaults are theirs.
        buffers = frozenset(model.state_dict()) - {name for name, _ in model.named_parameters()}
        return SERVER_OPTIMISERS[cfg.method](eta=cfg.server_lr, eta_l=cfg.lr, buffers=buffers, **common)
    if cfg.method == "fedmedian":
        return RecordedFedMedian(**common)
    if cfg.method == "fedtrimmedavg":
        return RecordedFedTrimmedAvg(beta=cfg.trim_fraction, **common)
    shapes = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    if cfg.method == "scaffold":
        return Scaffold(shapes, num_sites, **common)
    if cfg.method == "feddyn":
        return FedDyn(shapes, num_sites, cfg.feddyn_alpha, **common)
    raise ValueError(f"method {cfg.method!r} has no federated strategy; valid: {', '.join(FEDERATED_METHODS)}")
