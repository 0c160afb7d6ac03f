"""The typed run config: the single source of truth for every run-config key.

Flower hands the ServerApp and ClientApp `context.run_config`, a flat dict whose nested
TOML tables arrive as dotted keys ("fednca.tau"). `RunConfig.from_run_config` turns it into
validated settings; the pyproject `[tool.flwr.app.config]` table and the README's config
table are generated from the models below (`python -m fedskew.config --toml | --readme`),
and a test fails when either is stale.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

GENERATED_DATASETS = ("deformed-digits", "shapes", "shapes-multi")  # drawn by fedskew.data.synthetic
MULTILABEL_SOURCES = ("medmnist:chestmnist", "shapes-multi")
MULTILABEL_METHODS: tuple[str, ...] = ("fednca",)
SINGLE_LABEL_METHODS: tuple[str, ...] = ("factory", "factory-p2p")


class ConfigError(ValueError):
    """A run-config value is invalid; the message names the key, the value and what is valid."""


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class _Section(BaseModel):
    model_config = ConfigDict(alias_generator=_kebab, populate_by_name=True, extra="forbid", frozen=True)


class FedNCASection(_Section):
    """FedNCA-ML settings (spec: fixed simplex-ETF classifier, LADM, two regularisers)."""

    ladm: bool = Field(True, description="Use the label-aware attention module (false: pooled feature, BCE only).")
    regularisers: bool = Field(True, description="Add negative-feature rejection and positive-feature contrastive losses.")
    learnable_queries: bool = Field(False, description="Ablation: learn the LADM queries (initialised at the ETF).")
    heads: int = Field(4, ge=1, le=64, description="LADM attention heads (must divide the feature dimension).")
    projection_dim: int = Field(
        0, ge=0, le=8192, description="Learned projection of backbone features before LADM (0 = none); needed when "
        "the backbone's dimension is below classes - 1."
    )
    rejection_weight: float = Field(0.01, ge=0, le=100, description="Weight of the negative-feature rejection loss.")
    contrastive_weight: float = Field(1.0, ge=0, le=100, description="Weight of the positive-feature contrastive loss.")
    margin: float = Field(0.3, ge=0, le=1, description="Rejection margin on sigmoid(max class-feature logit).")
    tau: float = Field(0.07, gt=0, le=10, description="Contrastive temperature.")
    lr: float = Field(3e-3, gt=0, le=1, description="Local AdamW learning rate (the paper: 1e-4 with ResNet-18 at 224 px).")
    beta2: float = Field(0.98, gt=0, lt=1, description="AdamW beta2 (beta1 is 0.9).")
    weight_decay: float = Field(0.01, ge=0, le=1, description="AdamW weight decay (not on biases, norms, scale).")
    warmup_fraction: float = Field(0.1, ge=0, lt=1, description="Share of all local steps spent in linear warm-up.")
    keep_optimizer_state: bool = Field(
        False, description="Each site keeps its AdamW moments from round to round (in its node state, never sent) "
        "instead of restarting them every round."
    )


class FactorySection(_Section):
    """FederatedFactory settings (spec: one upload of generators per site, a classifier trained on their
    synthetic data; P2P: site experts combined as a Product of Experts)."""

    conditional: bool = Field(
        False, description="One class-conditional generator per site instead of the paper's one unconditional "
        "generator per (site, class)."
    )
    generator: Literal["cpu", "gpu-32px"] = Field(
        "cpu", description="EDM2 preset: `cpu` (16 channels, 2 levels) or the paper's `gpu-32px` (128 channels, "
        "4 levels, ~50 M parameters; needs images whose side halves 3 times, e.g. image-size 32)."
    )
    generator_steps: int = Field(
        0, ge=0, le=10_000_000, description="Training steps per generator (0 = the preset's: cpu 400, gpu-32px "
        "6104 = 25 M images at batch 4096); the lr schedule is scaled to the run length."
    )
    min_class_images: int = Field(
        10, ge=1, le=1_000_000, description="A site trains a generator only for classes it holds at least this many "
        "training images of (a generator of a handful of images reproduces them)."
    )
    augment: Literal["none", "flip", "flip-rot90"] = Field(
        "none", description="Augmentation for generators and classifiers (classifiers also shift by up to 1/8 of the "
        "side): `flip` for natural images, `flip-rot90` for orientation-free tiles; `none` for digits."
    )
    audit_samples: int = Field(
        64, ge=1, le=100_000, description="Samples per class drawn for the site's memorisation audit."
    )
    max_memorization: float = Field(
        0.0, ge=0, le=1, description="Refuse to upload when a generator's audit share (samples closer to a training "
        "image than 1/3 of their distance to the nearest held-out image) exceeds this (0 = off)."
    )
    sampler_steps: int = Field(16, ge=2, le=1000, description="Deterministic Heun sampler steps (the paper: 50).")
    sample_batch_size: int = Field(256, ge=1, le=65536, description="Images per sampler batch.")
    samples_per_class: int = Field(
        300, ge=1, le=1_000_000, description="Synthetic images per class on the server (the paper: 10000); a class "
        "held by several sites is split in proportion to their image counts."
    )
    p2p_samples_per_class: int = Field(
        0, ge=0, le=1_000_000, description="P2P: synthetic images per class a site lacks (0 = the mean number of "
        "real images per class the site holds)."
    )
    classifier: Literal["small-cnn", "resnet18", "resnet50"] = Field(
        "resnet18", description="Classifier trained on synthetic data (ResNets with the small-image stem below "
        "96 px; the paper: resnet50)."
    )
    classifier_epochs: int = Field(6, ge=1, le=10_000, description="Classifier epochs (the paper: 300).")
    classifier_lr: float = Field(0.05, gt=0, le=10, description="Classifier SGD learning rate, cosine-decayed to 0.")
    classifier_batch_size: int = Field(64, ge=1, le=65536, description="Classifier mini-batch size.")
    classifier_momentum: float = Field(0.9, ge=0, lt=1, description="Classifier SGD momentum.")
    classifier_weight_decay: float = Field(1e-4, ge=0, le=1, description="Classifier SGD weight decay.")
    classifier_val_fraction: float = Field(
        0.1, gt=0, lt=0.5, description="Share of the server's synthetic set held out to pick the best epoch."
    )
    p2p_val_fraction: float = Field(
        0.2, gt=0, lt=0.5, description="P2P: share of a site's real + synthetic set held out to pick the best epoch."
    )


class RunConfig(_Section):
    method: Literal["fednca", "fedavg", "fedprox", "centralized", "factory", "factory-p2p"] = Field(
        "fednca",
        description="Training method: FedNCA-ML, FedAvg, FedProx, the centralised pooled-data upper bound, or "
        "FederatedFactory (one-shot generators; `factory-p2p`: site experts as a Product of Experts).",
    )
    dataset: str = Field(
        "digits",
        description="Image source: `digits` (bundled with scikit-learn), `medmnist:<name>`, "
        "`npz:<path>` (MedMNIST npz layout), `cifar10`, or a set generated from the seed: `deformed-digits`, "
        "`shapes` (single-label) or `shapes-multi` (multi-label).",
    )
    data_root: str = Field("data", description="Folder holding downloaded/placed dataset files.")
    num_classes: int = Field(
        0, ge=0, le=100000, description="Classes in the label space (0 = from the dataset, or a deployed site's "
        "classes.txt). Deployed sites without classes.txt need it; sites and server must agree."
    )
    test_data: str = Field(
        "", description="Server test set: empty = the dataset's test split; a path to a site-layout folder or a "
        "MedMNIST-layout npz; `federated` = none, the sites' validation metrics weighted by examples."
    )
    allow_download: bool = Field(
        False, description="Download MedMNIST/CIFAR-10 files into `data-root` when they are missing."
    )
    image_size: int = Field(0, ge=0, le=512, description="Resize source images to this side length (0 = native).")
    mosaic_grid: int = Field(
        2,
        ge=0,
        le=4,
        description="Build multi-label data: each image is a g x g mosaic of source images, labelled "
        "with the union of their classes (0 = off; 2-4).",
    )
    partition: Literal["iid", "dirichlet", "classes-per-site", "multilabel-skew"] = Field(
        "multilabel-skew", description="How the training data is split over sites."
    )
    alpha: float = Field(0.1, gt=0, le=1e6, description="Dirichlet concentration for `dirichlet` and `multilabel-skew`.")
    classes_per_site: int = Field(1, ge=1, description="Classes held by each site for `classes-per-site`.")
    missing_classes: int = Field(3, ge=0, description="Labels absent at each site for `multilabel-skew`.")
    min_site_size: int = Field(10, ge=1, description="Smallest allowed site training set (partitions are redrawn).")
    val_fraction: float = Field(0.1, ge=0, lt=0.5, description="Share of each site's data kept for local validation.")
    num_server_rounds: int = Field(20, ge=1, le=10000, description="Federated rounds (centralised: epochs = rounds x local-epochs).")
    local_epochs: int = Field(3, ge=1, le=1000, description="Local epochs per round at each site.")
    batch_size: int = Field(32, ge=1, le=65536, description="Local mini-batch size.")
    lr: float = Field(0.05, gt=0, le=10, description="Local SGD learning rate (FedAvg, FedProx, centralised).")
    momentum: float = Field(0.9, ge=0, lt=1, description="Local SGD momentum.")
    weight_decay: float = Field(5e-4, ge=0, le=1, description="Local SGD weight decay.")
    proximal_mu: float = Field(0.1, ge=0, le=100, description="FedProx proximal term weight mu.")
    model: Literal["small-cnn", "resnet18"] = Field(
        "small-cnn", description="Backbone: a small CNN for CPU runs or ResNet-18 with a small-image stem."
    )
    aggregation: Literal["weighted", "unweighted"] = Field(
        "weighted", description="Average client models weighted by example count, or unweighted."
    )
    min_available_sites: int = Field(1, ge=1, description="Sites that must answer for a round to proceed.")
    round_timeout: float = Field(3600.0, gt=0, description="Seconds to wait for site replies in each round.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for data split, partition, model init and training.")
    results_dir: str = Field("results", description="Where each run writes `<time>-<method>-<dataset>/`.")
    resume_from: str = Field(
        "", description="A previous run's results directory: continue after its last completed round, with the "
        "same partition and ETF (settings that shape the data or model must match)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Compute device (auto = CUDA when present).")
    centralized_model: Literal["auto", "fednca", "linear"] = Field(
        "auto",
        description="Model the `centralized` bound trains: `fednca` (FedNCA-ML's ETF model, losses and AdamW "
        "schedule), `linear` (backbone + linear head with SGD: the FedAvg/FedProx model), `auto` (fednca on "
        "multi-label data, else linear).",
    )
    fednca: FedNCASection = Field(default_factory=FedNCASection)
    factory: FactorySection = Field(default_factory=FactorySection)

    @field_validator("dataset")
    @classmethod
    def _known_dataset_form(cls, value: str) -> str:
        kind, sep, arg = value.partition(":")
        if value in ("digits", "cifar10", *GENERATED_DATASETS) or (sep and kind in ("medmnist", "npz") and arg):
            return value
        raise ValueError(
            f"key 'dataset' = {value!r} is invalid; valid: digits, cifar10, medmnist:<name> (e.g. "
            "medmnist:chestmnist), npz:<path to a MedMNIST-layout .npz> or a generated set: "
            + ", ".join(GENERATED_DATASETS)
        )

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RunConfig:
        if self.mosaic_grid == 1:
            raise _field_error("mosaic-grid", 1, "0 (off) or 2-4 (a 1 x 1 mosaic is the source image)")
        if self.mosaic_grid >= 2 and self.dataset in MULTILABEL_SOURCES:
            raise _field_error("mosaic-grid", self.mosaic_grid, f"0 for {self.dataset}, already multi-label")
        multilabel = self.multilabel
        if self.method in MULTILABEL_METHODS and not multilabel:
            raise _field_error(
                "method", self.method, "a multi-label dataset: set mosaic-grid to 2-4 or use a multi-label source"
            )
        if self.method in SINGLE_LABEL_METHODS and multilabel:
            raise _field_error(
                "method", self.method, "single-label data (mosaic-grid = 0 and a single-label dataset): "
                "FederatedFactory's generators and classifier model one class per image"
            )
        if self.centralized_model == "fednca" and not multilabel:
            raise _field_error("centralized-model", self.centralized_model, "linear or auto for single-label data")
        if self.partition == "multilabel-skew" and not multilabel:
            raise _field_error(
                "partition", self.partition, "iid, dirichlet or classes-per-site for single-label data "
                "(or set mosaic-grid to 2-4 for multi-label data)"
            )
        if self.partition in ("dirichlet", "classes-per-site") and multilabel:
            raise _field_error(
                "partition", self.partition, "iid or multilabel-skew for multi-label data (mosaic-grid > 0)"
            )
        return self

    @property
    def multilabel(self) -> bool:
        return self.mosaic_grid >= 2 or self.dataset in MULTILABEL_SOURCES

    @property
    def fednca_model(self) -> bool:
        """Whether the run trains FedNCA-ML's model: method fednca, or the centralised bound of it."""
        if self.method == "centralized" and self.centralized_model != "linear":
            return self.centralized_model == "fednca" or self.multilabel
        return self.method == "fednca"

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunConfig:
        """Parse Flower's flat run config; raise ConfigError with one readable message."""
        try:
            return cls.model_validate(_nest(dict(run_config)))
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None

    def to_run_config(self) -> dict[str, Any]:
        """The flat, dotted-key form Flower uses (round-trips through from_run_config)."""
        return _flatten(self.model_dump(by_alias=True))


def _field_error(key: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"key '{key}' = {value!r} is invalid; valid: {valid}")


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            nested[key] = value
    return nested


def _flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _describe(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        key = ".".join(str(part) for part in err["loc"])
        if err["type"] == "value_error":
            # Cross-field rules already name key, value and what is valid.
            problems.append(str(err["ctx"]["error"]))
        elif err["type"] == "extra_forbidden":
            problems.append(f"unknown key '{key}'; valid keys: {', '.join(sorted(_flat_defaults()))}")
        else:
            problems.append(f"key '{key}' = {err['input']!r} is invalid: {err['msg']}")
    return "invalid run config: " + "; ".join(problems)


def _flat_defaults() -> dict[str, Any]:
    return RunConfig().to_run_config()


def _iter_fields(model: type[BaseModel], prefix: str = ""):
    """Yield (dotted key, field info, default) for every leaf field, sections included."""
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _iter_fields(annotation, key + ".")
        else:
            yield key, info, info.default


def _range_text(info) -> str:
    bounds = {}
    for item in info.metadata:
        for attr in ("gt", "ge", "lt", "le"):
            if getattr(item, attr, None) is not None:
                bounds[attr] = getattr(item, attr)
    args = getattr(info.annotation, "__args__", None)
    if getattr(info.annotation, "__origin__", None) is Literal or (args and all(isinstance(a, str) for a in args)):
        return " \\| ".join(f"`{a}`" for a in args)
    low = f"> {bounds['gt']}" if "gt" in bounds else (f">= {bounds['ge']}" if "ge" in bounds else "")
    high = f"< {bounds['lt']}" if "lt" in bounds else (f"<= {bounds['le']}" if "le" in bounds else "")
    return ", ".join(part for part in (low, high) if part)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    return str(value)


def toml_table() -> str:
    """The `[tool.flwr.app.config]` body: every key with its default."""
    # TOML dotted keys ("fednca.tau = 0.07") build the nested tables Flower flattens back.
    return "".join(f"{key} = {_toml_value(default)}\n" for key, _, default in _iter_fields(RunConfig))


def readme_table() -> str:
    """Markdown table of every run-config key, generated for the README."""
    rows = ["| key | default | valid | meaning |", "|---|---|---|---|"]
    for key, info, default in _iter_fields(RunConfig):
        rows.append(f"| `{key}` | `{_toml_value(default)}` | {_range_text(info)} | {info.description or ''} |")
    return "\n".join(rows) + "\n"


README_MARKERS = ("<!-- config-table:start -->\n", "<!-- config-table:end -->")
PYPROJECT_MARKERS = ("[tool.flwr.app.config]\n", "\n[tool.pytest")


def _replace_between(text: str, markers: tuple[str, str], body: str, where: str) -> str:
    start, end = markers
    if start not in text or end not in text:
        raise ValueError(f"{where} lacks the markers {start.strip()!r} ... {end.strip()!r}")
    head, rest = text.split(start, 1)
    return head + start + body + end + rest.split(end, 1)[1]


def generated_files(root: Path) -> dict[Path, str]:
    """pyproject.toml and README.md as they must read with the current config model."""
    pyproject, readme = root / "pyproject.toml", root / "README.md"
    note = "# Generated from fedskew/config.py (python -m fedskew.config --write); a test fails when stale.\n"
    return {
        pyproject: _replace_between(pyproject.read_text(), PYPROJECT_MARKERS, note + toml_table(), str(pyproject)),
        readme: _replace_between(readme.read_text(), README_MARKERS, readme_table(), str(readme)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate (or check) the config tables in pyproject.toml and README.md.")
    parser.add_argument("--root", type=Path, default=Path.cwd())
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated tables in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if a generated table is stale")
    args = parser.parse_args(argv)
    stale = [path for path, text in generated_files(args.root).items() if path.read_text() != text]
    if args.write:
        for path, text in generated_files(args.root).items():
            path.write_text(text)
        return 0
    for path in stale:
        print(f"{path} is stale: run python -m fedskew.config --write")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
