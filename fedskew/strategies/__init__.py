"""Strategies by run-config `method`: Flower's own where they suffice, subclassed only for what we add.
Each is also a plain Flower strategy for a ServerApp of one's own (FedNCA, Scaffold, FedDyn, FederatedFactory, the
Recorded* classes): built from plain arguments, started with Flower's `start`, recording only when attached (docs/api.md)."""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedMedian, FedProx, FedTrimmedAvg, FedYogi

import torch
from torch import nn

from fedskew.config import RunConfig
from fedskew.methods import method_of, methods_where
from fedskew.protocol import EXAMPLES_KEY, UNIT_WEIGHT_KEY
from fedskew.strategies.drift import FedDyn, Scaffold
from fedskew.strategies.factory import FederatedFactory  # noqa: F401 - the strategy a ServerApp of one's own imports (docs/api.md)
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


# The strategy class of each fedskew.methods.StrategySpec kind.
STRATEGY_CLASSES: dict[str, type[FedAvg]] = {
    "fedavg": RecordedFedAvg,
    "fedprox": RecordedFedProx,
    "fednca": FedNCA,
    "fedadam": RecordedFedAdam,
    "fedyogi": RecordedFedYogi,
    "fedadagrad": RecordedFedAdagrad,
    "fedmedian": RecordedFedMedian,
    "fedtrimmedavg": RecordedFedTrimmedAvg,
    "scaffold": Scaffold,
    "feddyn": FedDyn,
}


def _trainable_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}


# The constructor arguments a StrategySpec's model_inputs name, from (cfg, num_sites, model, etf).
MODEL_INPUTS: dict[str, Callable[[RunConfig, int, nn.Module, torch.Tensor | None], object]] = {
    "etf": lambda cfg, num_sites, model, etf: etf,
    # FedNCA-ML's control variates cover the trainable parameters; None turns them off.
    "control_layout": lambda cfg, num_sites, model, etf: _trainable_shapes(model) if cfg.fednca.control_variates else None,
    # SCAFFOLD's control variates and FedDyn's gradient state: one tensor per trainable parameter.
    "parameter_shapes": lambda cfg, num_sites, model, etf: _trainable_shapes(model),
    "num_sites": lambda cfg, num_sites, model, etf: num_sites,
    # The model's buffers (BatchNorm's statistics), which AveragedBuffers averages instead of stepping.
    "buffers": lambda cfg, num_sites, model, etf: frozenset(model.state_dict()) - {name for name, _ in model.named_parameters()},
}


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
    method = method_of(cfg)
    if method.strategy is None:
        raise ValueError(f"method {method.name!r} has no federated strategy; valid: {', '.join(methods_where(family='federated'))}")
    spec = method.strategy
    settings = {keyword: getattr(cfg, attribute) for keyword, attribute in spec.settings}
    inputs = {keyword: MODEL_INPUTS[keyword](cfg, num_sites, model, etf) for keyword in spec.model_inputs}
    return STRATEGY_CLASSES[spec.kind](**inputs, **settings, **common)
