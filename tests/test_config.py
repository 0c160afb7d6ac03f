import tomllib
from pathlib import Path

import pytest

from fedskew.config import ConfigError, RunConfig, current_run_config, generated_files

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_parse_and_round_trip():
    cfg = RunConfig.from_run_config({})
    assert RunConfig.from_run_config(cfg.to_run_config()) == cfg


def test_pyproject_and_configuration_page_tables_are_generated_from_the_model():
    stale = [str(p) for p, text in generated_files(ROOT).items() if p.read_text() != text]
    assert not stale, f"regenerate with `python -m fedskew.config --write`: {stale}"
    flwr_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]

    def flatten(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    assert flatten(flwr_config) == RunConfig().to_run_config()


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ({"alpha": -1}, ["'alpha'", "-1", "greater than 0"]),
        ({"method": "fedsgd"}, ["'method'", "fedsgd", "fedavg"]),
        ({"batch-size": 0}, ["'batch-size'", "0", "greater than or equal to 1"]),
        ({"partition": "dirichlet"}, ["'partition'", "dirichlet", "multilabel-skew"]),
        ({"mosaic-grid": 0, "method": "fedavg"}, ["'partition'", "multilabel-skew", "iid, dirichlet or classes-per-site"]),
        ({"mosaic-grid": 0, "partition": "iid"}, ["'method'", "fednca", "multi-label dataset"]),
        ({"fednca.tau": 0}, ["'fednca.tau'", "0", "greater than 0"]),
        ({"mosaic-grid": 1}, ["'mosaic-grid'", "0 (off) or 2-4"]),
        ({"dataset": "imagenet"}, ["'dataset'", "imagenet", "medmnist:<name>"]),
        ({"no-such-key": 1}, ["unknown key 'no-such-key'", "alpha"]),
        ({"device": "tpu"}, ["'device'", "tpu", "'auto', 'cpu' or 'cuda'"]),
        ({"labels": "single"}, ["'labels'", "single", "multi or auto when mosaic-grid >= 2"]),
        ({"labels": "single", "mosaic-grid": 0, "partition": "iid"}, ["'method'", "fednca", "multi-label"]),
        ({"labels": "multi", "method": "factory", "partition": "iid"}, ["'method'", "factory", "single-label data"]),
        ({"dataset": "medmnist:pathmnist", "mosaic-grid": 0}, ["'method'", "fednca", "multi-label"]),
        ({"val-data": "held/out", "test-data": "held/out"}, ["'val-data'", "held/out", "other than test-data"]),
        ({"val-data": "federated"}, ["'val-data'", "other than test-data"]),
        ({"val-data": "v", "method": "factory", "mosaic-grid": 0, "partition": "iid"}, ["'val-data'", "empty for method 'factory'"]),
        ({"threshold": 1.0}, ["'threshold'", "1.0", "'validation' (chosen on validation data) or a number in (0, 1)"]),
        ({"threshold": "valid"}, ["'threshold'", "'valid'", "a number in (0, 1)"]),
        ({"threshold": True}, ["'threshold'", "True", "a number in (0, 1)"]),
    ],
)
def test_bad_values_name_key_value_and_what_is_valid(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_run_config(overrides)
    message = str(info.value)
    assert message.startswith("invalid run config:")
    for fragment in fragments:
        assert fragment in message, message


def test_single_label_settings_are_accepted():
    cfg = RunConfig.from_run_config(
        {"method": "fedavg", "mosaic-grid": 0, "partition": "classes-per-site", "classes-per-site": 1}
    )
    assert cfg.label_kind == "single" and cfg.partition == "classes-per-site"


@pytest.mark.parametrize(
    "overrides, kind",
    [
        ({}, "multi"),  # digits mosaics
        ({"dataset": "medmnist:chestmnist", "mosaic-grid": 0}, "multi"),  # medmnist's INFO task
        ({"dataset": "medmnist:pathmnist", "mosaic-grid": 0, "method": "fedavg", "partition": "iid"}, "single"),
        ({"dataset": "npz:own.npz", "mosaic-grid": 0}, None),  # only the file can tell: checked when loaded
        ({"dataset": "npz:own.npz", "mosaic-grid": 0, "labels": "multi"}, "multi"),
    ],
)
def test_the_label_kind_comes_from_the_config_only_when_it_can_tell(overrides, kind):
    assert RunConfig.from_run_config(overrides).label_kind == kind


def test_a_p2p_run_saved_before_p2p_epochs_reads_with_its_experts_trained_as_long_as_its_classifier():
    before = {k: v for k, v in RunConfig().to_run_config().items() if k != "factory.p2p-epochs"}
    p2p = {**before, "method": "factory-p2p", "mosaic-grid": 0, "partition": "iid", "factory.classifier-epochs": 12}
    assert RunConfig.from_run_config(current_run_config(p2p)).factory.expert_epochs() == 12
    assert RunConfig.from_run_config(current_run_config({**p2p, "factory.p2p-epochs": 3})).factory.expert_epochs() == 3


@pytest.mark.parametrize(("setting", "side", "expected"), [(0, 8, 300), (0, 16, 300), (0, 28, 1000), (0, 64, 1000),
                                                           (50, 8, 50), (50, 64, 50)])
def test_server_samples_per_class_follow_the_image_side_only_when_not_set(setting, side, expected):
    factory = RunConfig.from_run_config({"factory.samples-per-class": setting}).factory
    assert factory.server_samples_per_class(side) == expected


@pytest.mark.parametrize(("p2p_epochs", "classifier_epochs", "expected"), [(0, 20, 20), (0, 60, 60), (3, 20, 3), (3, 60, 3)])
def test_experts_train_the_classifier_epochs_unless_set(p2p_epochs, classifier_epochs, expected):
    factory = RunConfig.from_run_config({"factory.p2p-epochs": p2p_epochs, "factory.classifier-epochs": classifier_epochs}).factory
    assert factory.expert_epochs() == expected


@pytest.mark.parametrize(("setting", "side", "real", "expected"), [(0, 8, 180, 180), (0, 16, 13, 13), (0, 28, 180, 500),
                                                                   (0, 28, 2000, 2000), (40, 8, 180, 40), (40, 28, 180, 40)])
def test_expert_samples_per_class_follow_the_image_side_only_when_not_set(setting, side, real, expected):
    factory = RunConfig.from_run_config({"factory.p2p-samples-per-class": setting}).factory
    assert factory.expert_samples_per_class(side, real) == expected
