"""The method registry (fedskew.methods): one record for each name the run config's `method` key takes, the only
place besides the config's validation where code tells methods apart by name, and the strategies build_strategy
makes from it."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
import torch
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedMedian, FedProx, FedTrimmedAvg, FedYogi

from fedskew.config import RunConfig
from fedskew.methods import METHODS, method_named, method_of
from fedskew.strategies import AveragedBuffers, build_strategy
from fedskew.strategies.drift import FedDyn, Scaffold
from fedskew.strategies.fednca import FedNCA
from fedskew.strategies.recording import RecordingMixin

ROOT = Path(__file__).resolve().parents[1]
# Where a method's name may be compared with a value: the registry itself and the run config's validation.
ALLOWED = {ROOT / "fedskew" / "methods.py", ROOT / "fedskew" / "config.py"}
SCANNED = ("fedskew", "bench")


def test_every_config_method_has_exactly_one_record_and_every_record_is_a_config_method():
    config_names = typing.get_args(RunConfig.model_fields["method"].annotation)
    assert len(set(config_names)) == len(config_names)
    assert sorted(METHODS) == sorted(config_names)
    assert all(name == record.name for name, record in METHODS.items())


def test_an_unknown_method_name_is_refused_naming_where_it_came_from_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"^the header's 'method' = 'fedsgd' is not a method; valid: fednca, fedavg, "):
        method_named("fedsgd", "the header's 'method'")
    with pytest.raises(ValueError, match=r"^key 'method' = \['fedavg'\] is not a method; valid: fednca, "):
        method_of(RunConfig.model_construct(method=["fedavg"]))


def _names_a_method(node: ast.expr) -> bool:
    """`<anything>.method`, a variable `method`, `<anything>["method"]` or `<anything>.get("method")`: an
    expression whose value is a method's name."""
    if isinstance(node, ast.Attribute):
        return node.attr == "method"
    if isinstance(node, ast.Name):
        return node.id == "method"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "method"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return isinstance(node.args[0], ast.Constant) and node.args[0].value == "method"
    return False


def _is_the_registry(node: ast.expr) -> bool:
    # `name in METHODS` checks that a name read from a file is a method at all: validation, not telling methods apart.
    return isinstance(node, ast.Name) and node.id == "METHODS"


def method_comparisons(source: str, filename: str) -> list[str]:
    """"file:line: code" of every comparison (==, !=, in, not in, is) of a method's name with another value."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            # Two expressions that both name a method (a file's method against the one asked for) are a consistency
            # check; one method against anything else tells methods apart.
            if any(map(_names_a_method, operands)) and not all(_names_a_method(o) or _is_the_registry(o) for o in operands):
                found.append(f"{filename}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


@pytest.mark.parametrize("code, compares", [
    ('if cfg.method == "fedprox": pass', True),
    ('x = method in ("factory", "factory-p2p")', True),
    ('x = cfg.method not in FACTORY_METHODS', True),
    ('x = config["method"] != "fednca"', True),
    ('x = saved.get("method") == "scaffold"', True),
    ('x = method_of(cfg).family == "factory"', False),
    ('x = method in METHODS', False),
    ('x = saved.get("method") != cfg.method', False),
    ('for method in ("fednca", "centralized"): pass', False),
])  # fmt: skip
def test_the_scan_finds_a_comparison_of_a_method_name_and_only_that(code, compares):
    assert bool(method_comparisons(code, "example.py")) is compares


def test_no_code_tells_methods_apart_by_name_outside_the_registry_and_the_config():
    """Issue 67: every "which method is this?" reads an attribute of the method's record."""
    found = [
        hit
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path not in ALLOWED
        for hit in method_comparisons(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == [], "compare a method's name outside fedskew/methods.py and fedskew/config.py:\n" + "\n".join(found)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2, 3))
        self.frozen = torch.nn.Parameter(torch.ones(1), requires_grad=False)
        self.register_buffer("running_mean", torch.zeros(1))


# The strategy each federated method ran with before the registry, its Flower base, and the constructor
# arguments that differ between methods (the settings below are all off their defaults, so each must arrive).
EXPECTED = {
    "fedavg": ("RecordedFedAvg", FedAvg, {}),
    "fedprox": ("RecordedFedProx", FedProx, {"proximal_mu": 0.3}),
    "fednca": ("FedNCA", FedAvg, {"control_layout": None}),
    "fedadam": ("RecordedFedAdam", FedAdam, {"eta": 0.02, "eta_l": 0.07, "buffers": frozenset({"running_mean"})}),
    "fedyogi": ("RecordedFedYogi", FedYogi, {"eta": 0.02, "eta_l": 0.07, "buffers": frozenset({"running_mean"})}),
    "fedadagrad": ("RecordedFedAdagrad", FedAdagrad, {"eta": 0.02, "eta_l": 0.07, "buffers": frozenset({"running_mean"})}),
    "fedmedian": ("RecordedFedMedian", FedMedian, {}),
    "fedtrimmedavg": ("RecordedFedTrimmedAvg", FedTrimmedAvg, {"beta": 0.25}),
    "scaffold": ("Scaffold", FedAvg, {"num_sites": 5}),
    "feddyn": ("FedDyn", FedAvg, {"num_sites": 5, "alpha": 0.05}),
}  # fmt: skip
SETTINGS = {"proximal-mu": 0.3, "server-lr": 0.02, "lr": 0.07, "trim-fraction": 0.25, "feddyn-alpha": 0.05,
            "aggregation": "unweighted", "round-timeout": 77.0, "min-available-sites": 3, "val-fraction": 0.0}


def test_the_expected_table_covers_every_federated_method():
    assert sorted(EXPECTED) == sorted(name for name, method in METHODS.items() if method.family == "federated")


@pytest.mark.parametrize("method", list(EXPECTED))
def test_build_strategy_builds_each_federated_method_s_strategy_from_its_record(method):
    class_name, flower_base, arguments = EXPECTED[method]
    strategy = build_strategy(RunConfig.from_run_config({"method": method, **SETTINGS}), 5, _Model(), etf=torch.eye(2))
    assert type(strategy).__name__ == class_name and isinstance(strategy, flower_base)
    assert isinstance(strategy, RecordingMixin)
    assert isinstance(strategy, AveragedBuffers) == ("buffers" in arguments)
    assert {name: getattr(strategy, name) for name in arguments} == arguments
    # The arguments every strategy takes alike.
    assert (strategy.fraction_evaluate, strategy.min_train_nodes, strategy.min_available_nodes,
            strategy.weighted_by_key, strategy.timeout) == (0.0, 3, 3, "unit-weight", 77.0)  # fmt: skip
    if isinstance(strategy, (Scaffold, FedDyn)):  # one zero state per trainable parameter, none for the frozen one
        state = strategy.control if isinstance(strategy, Scaffold) else strategy.h
        assert {name: tuple(t.shape) for name, t in state.items()} == {"w": (2, 3)}
    if isinstance(strategy, FedNCA):
        assert torch.equal(torch.from_numpy(strategy.etf_record["etf"].numpy()), torch.eye(2))


def test_fednca_s_control_variates_cover_the_trainable_parameters():
    cfg = RunConfig.from_run_config({"method": "fednca", "fednca.control-variates": True})
    assert build_strategy(cfg, 5, _Model(), etf=torch.eye(2)).control_layout == {"w": (2, 3)}


@pytest.mark.parametrize("method", [name for name, method in METHODS.items() if method.family != "federated"])
def test_a_method_without_rounds_has_no_strategy(method):
    cfg = RunConfig.model_construct(method=method)
    with pytest.raises(ValueError, match=f"method '{method}' has no federated strategy; valid: fednca, fedavg"):
        build_strategy(cfg, 5, _Model())
