"""The method registry: every fact the code asks about a run-config `method`, in one record per method.

Code that behaves differently by method reads an attribute of `method_of(cfg)` (`.plain_sgd`, `.family`,
...) and never compares `cfg.method` with a name, so adding or changing a method is one record here. The
run config (fedskew.config) lists the names a `method` key may take and validates combinations of keys; a
test checks that its list and this table hold the same names. This module sits below the config: it imports
nothing of fedskew's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True)
class StrategySpec:
    """How fedskew.strategies.build_strategy builds a federated method's strategy, whose classes live in that
    (higher) layer. `kind` names the class in its table; `settings` maps constructor keywords to the RunConfig
    attributes they take; `model_inputs` names the constructor keywords built from the global model, the ETF or
    the number of sites (fedskew.strategies.MODEL_INPUTS says how)."""

    kind: str
    settings: tuple[tuple[str, str], ...] = ()
    model_inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Method:
    """One run-config method. `family`: "federated" (rounds of weight updates through a strategy), "factory"
    (FederatedFactory: one upload of generators per site) or "centralized" (the pooled-data upper bound)."""

    name: str
    family: Literal["federated", "factory", "centralized"]
    strategy: StrategySpec | None = None  # the federated methods' strategy; None for the other families
    p2p: bool = False  # the Product of Experts round of site experts (factory-p2p)
    autoguided: bool = False  # factory.guide-steps' autoguidance guides the server's synthesis (p2p sites draw unguided)
    proximal: bool = False  # the site adds FedProx's proximal term, with the mu of the server's message
    server_etf: bool = False  # the server broadcasts the simplex ETF every site's model classifies with
    # The state a site keeps between rounds to correct its drift: SCAFFOLD's control variate or FedDyn's
    # gradient; both corrections assume plain local SGD (no momentum).
    drift_state: Literal["scaffold", "feddyn"] | None = None
    fednca_model: bool = False  # sites train FedNCA-ML's model (ETF classifier, LADM) under the fednca.* keys
    weight_averaging: bool = False  # the weight-averaging methods dp.* covers with Flower's DP wrappers
    resumable: bool = False  # resume-from continues a stopped run
    labels: Literal["single", "multi", "any"] = "any"  # the label kind of the data it trains on

    @property
    def plain_sgd(self) -> bool:
        """Whether the sites train with plain SGD (no momentum), as the drift corrections assume."""
        return self.drift_state is not None


_AVERAGING = dict(family="federated", weight_averaging=True, resumable=True)


def _adaptive(name: str) -> Method:
    # Reddi et al.'s adaptive server optimisers: the server's learning rate and the sites' (eta_l) as Flower
    # takes them, and the model's buffers averaged (fedskew.strategies.AveragedBuffers).
    return Method(name, "federated", StrategySpec(name, (("eta", "server_lr"), ("eta_l", "lr")), ("buffers",)))


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        Method("fednca", strategy=StrategySpec("fednca", model_inputs=("etf", "control_layout")), server_etf=True,
               fednca_model=True, labels="multi", **_AVERAGING),
        Method("fedavg", strategy=StrategySpec("fedavg"), **_AVERAGING),
        Method("fedprox", strategy=StrategySpec("fedprox", (("proximal_mu", "proximal_mu"),)), proximal=True,
               **_AVERAGING),
        Method("scaffold", "federated", StrategySpec("scaffold", model_inputs=("parameter_shapes", "num_sites")),
               drift_state="scaffold"),
        Method("feddyn", "federated", StrategySpec("feddyn", (("alpha", "feddyn_alpha"),),
                                                   ("parameter_shapes", "num_sites")),
               drift_state="feddyn"),
        _adaptive("fedadam"),
        _adaptive("fedyogi"),
        _adaptive("fedadagrad"),
        Method("fedmedian", "federated", StrategySpec("fedmedian")),
        Method("fedtrimmedavg", "federated", StrategySpec("fedtrimmedavg", (("beta", "trim_fraction"),))),
        Method("centralized", "centralized"),
        Method("factory", "factory", autoguided=True, labels="single"),
        Method("factory-p2p", "factory", p2p=True, labels="single"),
    )
}


class HasMethod(Protocol):
    method: str


def method_named(name: str, source: str = "key 'method'") -> Method:
    """The record of method `name`; `source` names where the name came from for the error of an unknown one."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{source} = {name!r} is not a method; valid: {', '.join(METHODS)}") from None


def method_of(cfg: HasMethod) -> Method:
    """The record of a run config's `method`."""
    return method_named(cfg.method)


def methods_where(**facts: object) -> tuple[str, ...]:
    """The names of the methods whose attributes have the given values, in the table's order
    (methods_where(family="federated"))."""
    return tuple(name for name, method in METHODS.items() if all(getattr(method, k) == v for k, v in facts.items()))
