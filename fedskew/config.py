"""The typed run config: the single source of truth for every run-config key.

Flower hands the ServerApp and ClientApp `context.run_config`, a flat dict whose nested
TOML tables arrive as dotted keys ("fednca.tau"). `RunConfig.from_run_config` turns it into
validated settings; the pyproject `[tool.flwr.app.config]` table and the key table of
docs/configuration.md are generated from the models below (`python -m fedskew.config --write`),
and a test fails when either is stale.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from fedskew.methods import method_of, methods_where

GENERATED_DATASETS = ("deformed-digits", "shapes", "shapes-multi")  # drawn by fedskew.data.synthetic
MULTILABEL_SOURCES = ("medmnist:chestmnist", "shapes-multi")
LABEL_KINDS: tuple[str, ...] = ("single", "multi")
MEDMNIST_MULTILABEL_TASK = "multi-label, binary-class"  # the `task` of medmnist's INFO entry
# A generator that does not copy its training images scores ~0 (0.0% on every digit class in the generator
# benchmark); a deployed site refuses to upload one whose audit finds more than 1 sample in 20 a near-copy.
DEPLOYED_MAX_MEMORIZATION = 0.05
SITES_DATASET = "sites"  # dataset = "sites:<dir>": simulate on the sites' own folders, one sub-folder per site
# With dataset sites:<dir> these keys do not apply: each folder is one site and its images stay where they are.
SITE_SPLIT_KEYS: tuple[str, ...] = ("partition", "alpha", "classes-per-site", "missing-classes", "min-site-size")
FEDERATED_EVALUATION = "federated"  # test-data value: no server test set, the sites' validation metrics
# Upper bounds of counts: far above any run (a federation of 10,000 sites, 100,000 classes, a site of 10^9
# images) and below what would only make a run wait forever or allocate without end.
MAX_SITES, MAX_CLASSES, MAX_SITE_IMAGES = 10_000, 100_000, 1_000_000_000
MAX_ROUND_TIMEOUT = 30 * 24 * 3600.0  # a FederatedFactory round trains every generator of a site in one reply


# How a run config saved by an earlier version reads today: keys added since, at the value that reproduces the
# behaviour of then (the small CNN had one stride-2 stage), and keys retired since, which only shaped training.
ADDED_KEYS_AS_BEFORE = {"feature-side": 0}
RETIRED_TRAINING_KEYS = ("fednca.warmup-fraction",)  # replaced by fednca.warmup-epochs


def current_run_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved flat run config (a model card's, a run's config.json) in today's keys."""
    # factory.p2p-epochs needs no entry: before the key the experts trained factory.classifier-epochs, what its
    # default (0) means.
    return {**ADDED_KEYS_AS_BEFORE, **{k: v for k, v in saved.items() if k not in RETIRED_TRAINING_KEYS}}


class ConfigError(ValueError):
    """A run-config value is invalid; the message names the key, the value and what is valid."""


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class _Section(BaseModel):
    # No inf/NaN in any float key: an infinite timeout or weight is never a setting, only a typo or an attack.
    model_config = ConfigDict(alias_generator=_kebab, populate_by_name=True, extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_and_booleans_kept_apart(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads `true` as the count 1 and 1 or "yes" as `true`: a TOML value of the wrong
        # type is a mistake in the config, never meant as the other type.
        annotation = cls.model_fields[info.field_name].annotation
        if annotation in (int, float) and isinstance(value, bool):
            raise PydanticCustomError("bool_for_number", f"Input should be {'an integer' if annotation is int else 'a number'}, not true/false")
        if annotation is bool and not isinstance(value, bool):
            raise PydanticCustomError("bool_type", "Input should be true or false")
        return value


class FedNCASection(_Section):
    """FedNCA-ML settings (fixed simplex-ETF classifier, LADM, two regularisers; docs/fednca.md)."""

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
    rejection_scope: Literal["other", "all"] = Field(
        "other", description="Prototypes an absent label's feature is rejected from: `other` (the paper: every "
        "prototype but its own) or `all` K (ablation)."
    )
    tau: float = Field(0.07, gt=0, le=10, description="Contrastive temperature.")
    lr: float = Field(3e-3, gt=0, le=1, description="Local AdamW learning rate (the paper: 1e-4 with ResNet-18 at 224 px).")
    beta2: float = Field(0.98, gt=0, lt=1, description="AdamW beta2 (beta1 is 0.9).")
    weight_decay: float = Field(0.01, ge=0, le=1, description="AdamW weight decay (not on biases, norms, scale).")
    warmup_epochs: float = Field(
        1.5, ge=0, le=1000, description="Epochs of linear warm-up at the start of the schedule (see `schedule-span`), "
        "a fixed length whatever the run's length; at most half the schedule's steps, so a short run still decays."
    )
    schedule_span: Literal["run", "round"] = Field(
        "run", description="What the warm-up/linear-decay schedule spans at a site: the whole `run` (each round "
        "continues it) or each `round` (warm-up and decay within every round's local steps). The centralised bound "
        "always spans its whole run."
    )
    keep_optimizer_state: bool = Field(
        False, description="Each site keeps its AdamW moments from round to round (in its node state, never sent) "
        "instead of restarting them every round."
    )
    control_variates: bool = Field(
        False, description="Correct every local gradient for the site's label skew: before a round's training each "
        "site sends its mean gradient at the global weights (one more pass over its training images and one more "
        "exchange a round), and steps along g - c_i + c, c the sites' weighted mean (FedSVRG / FedLin; SCAFFOLD's "
        "control variates measured, not estimated). Not with dp.mode other than off."
    )


# factory.samples-per-class = 0: the server's synthetic images per class by image side.
SMALL_IMAGE_SIDE, SMALL_IMAGE_SAMPLES_PER_CLASS, LARGE_IMAGE_SAMPLES_PER_CLASS = 16, 300, 1000
# factory.p2p-samples-per-class = 0: above SMALL_IMAGE_SIDE px at least this many per lacking class.
LARGE_IMAGE_EXPERT_SAMPLES_PER_CLASS = 500
# factory.guide-steps = AUTO_GUIDE_STEPS: guides of AUTO_GUIDE_STEPS_WIDE steps under generators wider than
# the CPU preset, else none (fedskew.factory.site.guide_steps).
AUTO_GUIDE_STEPS, AUTO_GUIDE_STEPS_WIDE = -1, 200


def by_image_side(setting: int, image_side: int, small: int, large: int) -> int:
    """A count key's value: `setting` where set, or (0) `small` for images up to SMALL_IMAGE_SIDE px, `large` above."""
    return setting or (small if image_side <= SMALL_IMAGE_SIDE else large)


class FactorySection(_Section):
    """FederatedFactory settings (docs/factory.md: one upload of generators per site, a classifier trained on their
    synthetic data; P2P: site experts combined as a Product of Experts)."""

    conditional: bool = Field(
        False, description="One class-conditional generator per site instead of the paper's one unconditional "
        "generator per (site, class)."
    )
    generator: Literal["cpu", "gpu-32px"] = Field(
        "cpu", description="EDM2 preset: `cpu` (16 channels, 2 levels) or the paper's `gpu-32px` (128 channels, "
        "4 levels, ~50 M parameters; needs images whose side halves 3 times, e.g. image-size 32)."
    )
    generator_channels: int = Field(
        0, ge=0, le=1024, description="Channels of each generator's first UNet level, the deeper levels scaled "
        "alike (0 = the preset's: cpu 16, gpu-32px 128). Textured colour images need more than 16; cost grows "
        "about with its square."
    )
    generator_lr: float = Field(
        0.0, ge=0.0, le=1.0, description="Each generator's reference learning rate, reached after the ramp-up and "
        "decayed as 1/sqrt(t) after t_ref, as in EDM2 (0 = the preset's: cpu 0.04, gpu-32px 0.01, EDM2's)."
    )
    generator_images: int = Field(
        0, ge=0, le=10_000_000_000, description="Training budget per generator in images seen, whatever batch the "
        "class size gives (0 = the preset's: cpu 25,600 at 8 px, 12,800 more per extra UNet level at larger "
        "images; gpu-32px 25 M); the lr schedule scales with it."
    )
    generator_steps: int = Field(
        0, ge=0, le=10_000_000, description="Training steps per generator instead of a budget in images (0 = from "
        "`factory.generator-images`); the lr schedule scales with the run."
    )
    parallel_generators: int = Field(
        0, ge=0, le=1024, description="Worker processes that run generators side by side: a site's per-class "
        "generators in training, and their draws when the server or a P2P site synthesises images. They share "
        "the process's torch threads (0 = automatic: on the CPU one per thread torch may use, in simulation "
        "the ClientApp's `client-resources-num-cpus`; on CUDA 1). Same generators and images for any value at "
        "the same threads per generator."
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
        -1.0, ge=-1, le=1, description="A site withholds each generator whose audit share (samples closer to a "
        "training image than 1/3 of their distance to the nearest held-out image) exceeds this, uploads the rest, "
        "and refuses when none is left (0 = off; -1 = "
        f"{DEPLOYED_MAX_MEMORIZATION} at a site that runs from its own folder (a data-dir, or dataset sites:<dir>), "
        "off on a simulated partition)."
    )

    @field_validator("max_memorization")
    @classmethod
    def _limit_or_deployment_default(cls, value: float) -> float:
        if value < 0 and value != -1:
            raise ValueError(f"key 'factory.max-memorization' = {value!r} is invalid; valid: -1 (deployment default) or 0-1")
        return value

    def memorization_limit(self, deployed: bool) -> float:
        """The audit limit a site applies before uploading (0 = none)."""
        if self.max_memorization == -1:
            return DEPLOYED_MAX_MEMORIZATION if deployed else 0.0
        return self.max_memorization

    dp_noise_multiplier: float = Field(
        0.0, ge=0, le=1000, description="DP-SGD for the generators: Gaussian noise std over `factory.dp-clipping-norm` "
        "added to each step's sum of clipped per-image gradients, Poisson-sampled batches (0 = off); each "
        "generator's epsilon goes into its manifest entry."
    )
    dp_clipping_norm: float = Field(
        1.0, gt=0, le=1e6, description="DP-SGD: L2 bound of each training image's gradient (over all parameters)."
    )
    dp_delta: float = Field(
        0.0, ge=0, lt=1, description="DP-SGD: delta of each generator's epsilon (0 = 1 / the images it trains on)."
    )
    max_epsilon: float = Field(
        0.0, ge=0, le=1e6, description="A site refuses to train and upload a generator whose DP epsilon exceeds this, "
        "and the server rejects an upload that declares none or a larger one (0 = no limit)."
    )
    @model_validator(mode="after")
    def _epsilon_limit_needs_dp(self) -> FactorySection:
        if self.max_epsilon > 0 and self.dp_noise_multiplier == 0:
            raise _field_error(
                "factory.max-epsilon", self.max_epsilon, "0 while factory.dp-noise-multiplier is 0 (generators trained "
                "without DP have no epsilon to limit)"
            )  # fmt: skip
        return self

    sampler_steps: int = Field(16, ge=2, le=1000, description="Deterministic Heun sampler steps (the paper: 50).")
    guide_steps: int = Field(
        AUTO_GUIDE_STEPS, ge=AUTO_GUIDE_STEPS, le=10_000_000, description="Autoguidance (Karras et al. 2024): each "
        "site also trains a guide per generator, the CPU preset at its own width, for this many steps, audits it "
        "and uploads it with the generator (a generator whose guide is withheld is withheld with it); the server "
        "then draws guide + `factory.guidance-weight` x (generator - guide). Method factory only, without DP-SGD "
        f"(0 = off; {AUTO_GUIDE_STEPS} = {AUTO_GUIDE_STEPS_WIDE} steps when the generators are wider than the CPU "
        "preset, i.e. `factory.generator-channels` above 16 or the gpu-32px preset, else off, and off for "
        "factory-p2p and under DP-SGD)."
    )
    guidance_weight: float = Field(
        2.0, ge=1, le=10, description="Autoguidance weight w of `factory.guide-steps` (1 = the generator alone)."
    )

    @model_validator(mode="after")
    def _guides_without_dp(self) -> FactorySection:
        if self.guide_steps > 0 and self.dp_noise_multiplier > 0:
            raise _field_error(
                "factory.guide-steps", self.guide_steps, "0 while factory.dp-noise-multiplier is set (a guide trains "
                "on the same images as its generator; the two DP guarantees would compose, which is not accounted)"
            )  # fmt: skip
        return self

    sample_batch_size: int = Field(256, ge=1, le=65536, description="Images per sampler batch.")
    samples_per_class: int = Field(
        0, ge=0, le=1_000_000, description="Synthetic images per class on the server (the paper: 10000; 0 = by "
        f"image side: {SMALL_IMAGE_SAMPLES_PER_CLASS} up to {SMALL_IMAGE_SIDE} px, {LARGE_IMAGE_SAMPLES_PER_CLASS} "
        "above); a class held by several sites is split in proportion to their image counts, each capped at the "
        "other holders' total (no site's claim takes more than half of a shared class)."
    )

    def server_samples_per_class(self, image_side: int) -> int:
        """`samples-per-class`, or where it is 0 the count for images of `image_side` px: at 28 px 300 per
        class left the classifier at 0.85x of the centralised model and 1,000 reach 0.93x (docs/benchmarks-
        factory.md); at 16 px and below 300 keep the quick starts under 10 minutes on 2 cores."""
        return by_image_side(self.samples_per_class, image_side, SMALL_IMAGE_SAMPLES_PER_CLASS, LARGE_IMAGE_SAMPLES_PER_CLASS)

    p2p_samples_per_class: int = Field(
        0, ge=0, le=1_000_000, description="P2P: synthetic images per class a site lacks (0 = as many as the "
        f"site's largest class has real images, and above {SMALL_IMAGE_SIDE} px at least "
        f"{LARGE_IMAGE_EXPERT_SAMPLES_PER_CLASS})."
    )

    def expert_samples_per_class(self, image_side: int, real_per_class: int) -> int:
        """`p2p-samples-per-class`, or where it is 0 the real images of the site's largest class, raised above
        SMALL_IMAGE_SIDE px to LARGE_IMAGE_EXPERT_SAMPLES_PER_CLASS: at 28 px 180 per lacking class (the mean)
        left the Product of Experts at 0.87-0.89x of the centralised runs and 500 reach 0.91-0.93x (three seeds,
        docs/benchmarks-factory.md), as the server's classifier needed more synthetic images there too."""
        large = max(real_per_class, LARGE_IMAGE_EXPERT_SAMPLES_PER_CLASS)
        return by_image_side(self.p2p_samples_per_class, image_side, real_per_class, large)

    classifier: Literal["small-cnn", "resnet18", "resnet50"] = Field(
        "small-cnn", description="Classifier trained on synthetic data (and the P2P experts): `small-cnn` is "
        "the network `model` defaults to, built with the same `feature-side`, so the centralised bound and FedAvg "
        "train the same one; ResNets take the small-image stem "
        "below 96 px (the paper: resnet50, a GPU setting: at 28 px resnet18 costs 13x the small CNN per step)."
    )
    classifier_epochs: int = Field(
        20, ge=1, le=10_000, description="Most epochs of the server's classifier (the paper: 300); the cosine lr "
        "decay spans them."
    )
    classifier_patience: int = Field(
        0, ge=0, le=10_000, description="Stop the classifier once its held-out score (accuracy, ties broken by the "
        "likelihood) has not improved for this many epochs (0 = train all `factory.classifier-epochs`)."
    )
    classifier_lr: float = Field(0.05, gt=0, le=10, description="Classifier SGD learning rate, cosine-decayed to 0.")
    classifier_batch_size: int = Field(64, ge=1, le=65536, description="Classifier mini-batch size.")
    classifier_momentum: float = Field(0.9, ge=0, lt=1, description="Classifier SGD momentum.")
    classifier_weight_decay: float = Field(1e-4, ge=0, le=1, description="Classifier SGD weight decay.")
    classifier_val_fraction: float = Field(
        0.1, gt=0, lt=0.5, description="Share of the server's synthetic set held out to pick the best epoch "
        "(highest accuracy; among equal ones the highest likelihood)."
    )
    fidelity: bool = Field(
        True, description="Measure per-class FD/KID of the synthetic set against the real data in a small CNN's "
        "features (needs the dataset's training split at the server; written to fidelity.json)."
    )
    inception_weights: str = Field(
        "", description="Local path of the FID Inception-v3 weights (torch-fidelity's pt_inception-2015-12-05 file) "
        "to add Inception FID/KID; empty = skip. Nothing is downloaded."
    )
    site_validation: bool = Field(
        False, description="The sites evaluate the server classifier's checkpoints on their own real validation "
        "images (only per-class counts and probability sums leave a site) to pick the epoch and calibrate the "
        "output biases; off: the synthetic hold-out alone picks the epoch."
    )
    calibration_rounds: int = Field(
        3, ge=0, le=100, description="With `factory.site-validation`: rounds of output-bias calibration at the sites "
        "(0 = pick the epoch only)."
    )
    match_intensity: bool = Field(
        False, description="Sites send per-class histograms of their real training pixels with their generators "
        "(counts only); the server maps each synthetic class's pixels onto them (histogram matching) before "
        "training its classifier (in factory-p2p the round-1 classifier; the experts train on unmatched images)."
    )
    p2p_epochs: int = Field(
        0, ge=0, le=10_000, description="P2P: epochs of each site's expert classifier (otherwise the server "
        "classifier's recipe; 0 = `factory.classifier-epochs`); ten experts train at the sites where the server "
        "trains one classifier."
    )

    def expert_epochs(self) -> int:
        """`p2p-epochs`, or where it is 0 the server classifier's epochs: the same count held on every dataset
        measured (docs/benchmarks-factory.md), where the former 6 up to 16 px left the experts near chance on
        16 px textured shapes and 6 at 28 px left them under-trained; at 8 px 6, 20 and 60 are level."""
        return self.p2p_epochs or self.classifier_epochs

    p2p_val_fraction: float = Field(
        0.2, gt=0, lt=0.5, description="P2P: share of a site's real + synthetic set held out to pick the best epoch."
    )


class DPSection(_Section):
    """Differential privacy of the weight-averaging methods (fedavg, fedprox, fednca) with Flower's own DP
    strategy wrappers and ClientApp mods; the epsilon spent is accounted with dp-accounting's RDP accountant."""

    mode: Literal["off", "central-server-clipping", "central-client-clipping", "local"] = Field(
        "off", description="`central-server-clipping`: the server clips each site's update and noises the average; "
        "`central-client-clipping`: sites clip, the server noises; `local`: each site clips and noises its own "
        "update (protects against the server too)."
    )
    noise_multiplier: float = Field(
        1.0, gt=0, le=1000, description="Gaussian noise std over the sensitivity of what is released (central: "
        "clipping-norm / sites; local: 2 x clipping-norm per site)."
    )
    clipping: Literal["fixed", "adaptive"] = Field(
        "fixed", description="Fixed clipping norm, or adapted each round towards a quantile of the update norms "
        "(central modes only)."
    )
    clipping_norm: float = Field(1.0, gt=0, le=1e6, description="L2 bound of a site's model update (adaptive: "
        "the initial bound).")
    target_quantile: float = Field(0.5, ge=0, le=1, description="Adaptive: share of updates left unclipped.")
    clip_norm_lr: float = Field(0.2, gt=0, le=10, description="Adaptive: geometric learning rate of the bound.")
    clipped_count_stddev: float = Field(
        0.0, ge=0, le=1e6, description="Adaptive: noise std of the count of clipped updates (0 = sites / 20, "
        "Flower's default); must exceed noise-multiplier / 2."
    )
    delta: float = Field(0.0, ge=0, lt=1, description="Target delta of the reported epsilon (0 = 1 / training "
        "examples over all sites).")


class RunConfig(_Section):
    method: Literal[
        "fednca", "fedavg", "fedprox", "scaffold", "feddyn", "fedadam", "fedyogi", "fedadagrad", "fedmedian",
        "fedtrimmedavg", "centralized", "factory", "factory-p2p",
    ] = Field(
        "fednca",
        description="Training method: FedNCA-ML, FedAvg, FedProx, SCAFFOLD, FedDyn (both with plain local SGD, as "
        "in their papers), Flower's FedAdam/FedYogi/FedAdagrad/FedMedian/FedTrimmedAvg, the centralised "
        "pooled-data upper bound, or FederatedFactory (one-shot generators; `factory-p2p`: site experts as a "
        "Product of Experts).",
    )
    dataset: str = Field(
        "digits",
        description="Image source: `digits` (bundled with scikit-learn), `medmnist:<name>`, "
        "`npz:<path>` (MedMNIST npz layout), `cifar10`, a set generated from the seed: `deformed-digits`, "
        "`shapes` (single-label) or `shapes-multi` (multi-label), or `sites:<dir>`: the sites' own folders, one "
        "sub-folder of <dir> per site in a deployed site's layout, simulated SuperNode k reading the k-th by name "
        "(numbers compared as numbers); the sites' split is kept (partition keys stay at their defaults), "
        "`mosaic-grid` must be 0 and `test-data` a path or `federated`. A relative <path>/<dir> is under "
        "`data-root`.",
    )
    data_root: str = Field("data", description="Folder holding downloaded/placed dataset files.")
    num_classes: int = Field(
        0, ge=0, le=MAX_CLASSES, description="Classes in the label space (0 = from the dataset, or a deployed site's "
        "classes.txt). Deployed sites without classes.txt need it; sites and server must agree."
    )
    test_data: str = Field(
        "", description="Server test set: empty = the dataset's test split; a path to a site-layout folder or a "
        "MedMNIST-layout npz; `federated` = none, the sites' validation metrics weighted by examples."
    )
    val_data: str = Field(
        "", description="Server validation set that chooses the best round instead of the sites' validation "
        "splits: empty = none; a path, read like `test-data` (a site-layout folder, all of it, or a "
        "MedMNIST-layout npz's test split); never the test data itself. Round-based methods only."
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
    labels: Literal["auto", "single", "multi"] = Field(
        "auto",
        description="Label kind: `single` (one class per image), `multi` (any set of classes per image) or `auto`: "
        "read from the data (mosaic-grid >= 2, the MedMNIST task, multi-hot (N, K) npz labels, `|` in labels.csv); "
        "a site whose kind differs from the run's is refused.",
    )
    partition: Literal["iid", "dirichlet", "classes-per-site", "multilabel-skew"] = Field(
        "multilabel-skew", description="How the training data is split over sites."
    )
    alpha: float = Field(0.1, gt=0, le=1e6, description="Dirichlet concentration for `dirichlet` and `multilabel-skew`.")
    classes_per_site: int = Field(1, ge=1, le=MAX_CLASSES, description="Classes held by each site for `classes-per-site`.")
    missing_classes: int = Field(3, ge=0, le=MAX_CLASSES, description="Labels absent at each site for `multilabel-skew`.")
    min_site_size: int = Field(10, ge=1, le=MAX_SITE_IMAGES, description="Smallest allowed site training set (partitions are redrawn).")
    val_fraction: float = Field(0.1, ge=0, lt=0.5, description="Share of each site's data kept for local validation.")
    num_server_rounds: int = Field(60, ge=1, le=10000, description="Federated rounds (centralised: epochs = rounds x local-epochs).")
    local_epochs: int = Field(1, ge=1, le=1000, description="Local epochs per round at each site.")
    batch_size: int = Field(32, ge=1, le=65536, description="Local mini-batch size.")
    augment: Literal["none", "shift", "shift-flip"] = Field(
        "none", description="Augmentation of the training images at the sites and in the centralised run (not "
        "FederatedFactory's, see `factory.augment`): `shift` moves each image by up to 1/8 of its side, "
        "`shift-flip` also mirrors half of them (only where a mirrored image keeps its labels)."
    )
    lr: float = Field(0.05, gt=0, le=10, description="Local SGD learning rate (FedAvg, FedProx, centralised).")
    momentum: float = Field(0.9, ge=0, lt=1, description="Local SGD momentum (scaffold and feddyn train without).")
    weight_decay: float = Field(5e-4, ge=0, le=1, description="Local SGD weight decay.")
    proximal_mu: float = Field(0.1, ge=0, le=100, description="FedProx proximal term weight mu.")
    feddyn_alpha: float = Field(0.01, gt=0, le=100, description="FedDyn regulariser weight alpha (its paper: 0.01-0.1).")
    server_lr: float = Field(
        0.01, gt=0, le=10, description="Server learning rate eta of fedadam, fedyogi and fedadagrad (Reddi et al. "
        "found 10^-2 to 10^-1.5 best for Adam/Yogi on CIFAR-10)."
    )
    trim_fraction: float = Field(
        0.2, gt=0, lt=0.5, description="fedtrimmedavg: share of the highest and of the lowest values cut per weight."
    )
    model: Literal["small-cnn", "resnet18"] = Field(
        "small-cnn", description="Backbone: a small CNN for CPU runs or ResNet-18 with a small-image stem."
    )
    feature_side: int = Field(
        8, ge=0, le=4096, description="small-cnn (as `model` and as `factory.classifier`): add a stride-2 stage (two 3x3 "
        "convs) while the feature map's side is above this, so the receptive field grows with the image (0 = one "
        "stride-2 stage whatever the size)."
    )
    pretrained: str = Field(
        "", description="Local torchvision-format ResNet state dict (.safetensors, or a PyTorch file read with "
        "weights_only) to start `model` from: torchvision's stem, ImageNet normalisation, grey repeated to RGB; "
        "read by the server only, nothing is downloaded (empty = random init)."
    )
    fractal_pretrain_epochs: int = Field(
        0, ge=0, le=1000, description="Before round 1 the server trains `model`'s backbone this many epochs to tell "
        "apart 64 categories of formula-drawn fractals (6,400 images at the data's size and channels, drawn from "
        "`seed`; Kataoka et al., ACCV 2020): a start off random weights with no site's data and no download, given "
        "to every weight-averaging method and the centralised bound alike. About 15 s an epoch at 32 px on a CPU "
        "core (0 = random init)."
    )
    aggregation: Literal["weighted", "unweighted"] = Field(
        "weighted", description="Average client models weighted by example count, or unweighted."
    )
    min_available_sites: int = Field(
        1, ge=1, le=MAX_SITES, description="Sites that must answer usably in every round (a floor): fewer, or fewer "
        "connected after round-timeout, end the run as failed with the reason."
    )
    round_timeout: float = Field(
        3600.0, gt=0, le=MAX_ROUND_TIMEOUT, description="Seconds any wait for the sites lasts (connecting, training, "
        "validation, queries); a site silent that long is recorded as dropped."
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for data split, partition, model init and training.")
    results_dir: str = Field(
        "results", description="Where each run writes `<time>-<method>-<dataset>/` (no `..` in the path: the server "
        "writes there)."
    )
    log_tensorboard: bool = Field(
        False, description="Also write TensorBoard event files (`tensorboard/` in the run's directory): one scalar "
        "per metric per round. Needs the `tensorboard` package (`pip install 'fedskew[tensorboard]'`)."
    )
    resume_from: str = Field(
        "", description="A previous run's results directory: continue after its last completed round, with the "
        "same partition and ETF (settings that shape the data or model must match)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Compute device (auto = CUDA when present).")
    threshold: str | float = Field(
        "validation", description="Multi-label decision threshold shared by all classes: `validation` = chosen every "
        "round on validation data (the sites' summed per-threshold counts, or val-data when given; grid 0.05-0.95, "
        "best macro-F1, ties to the nearest 0.5), never on the test split; or a fixed number in (0, 1), e.g. 0.5."
    )
    centralized_model: Literal["auto", "fednca", "linear"] = Field(
        "auto",
        description="Model the `centralized` bound trains: `fednca` (FedNCA-ML's ETF model, losses and AdamW "
        "schedule), `linear` (backbone + linear head with SGD: the FedAvg/FedProx model), `auto` (fednca on "
        "multi-label data, else linear).",
    )
    fednca: FedNCASection = Field(default_factory=FedNCASection)
    factory: FactorySection = Field(default_factory=FactorySection)
    dp: DPSection = Field(default_factory=DPSection)

    @field_validator("dataset")
    @classmethod
    def _known_dataset_form(cls, value: str) -> str:
        kind, sep, arg = value.partition(":")
        if value in ("digits", "cifar10", *GENERATED_DATASETS) or (sep and kind in ("medmnist", "npz", SITES_DATASET) and arg):
            return value
        raise ValueError(
            f"key 'dataset' = {value!r} is invalid; valid: digits, cifar10, medmnist:<name> (e.g. "
            "medmnist:chestmnist), npz:<path to a MedMNIST-layout .npz>, sites:<folder of site folders> or a "
            "generated set: " + ", ".join(GENERATED_DATASETS)
        )

    @field_validator("results_dir")
    @classmethod
    def _results_dir_without_parent_steps(cls, value: str) -> str:
        # The server creates folders and writes files there: a '..' would let a submitted config climb out of
        # the folder its operator named.
        if ".." in re.split(r"[/\\]", value):
            raise _field_error("results-dir", value, "a path without '..' components (e.g. 'results' or '/srv/fedskew/results')")
        return value

    @field_validator("threshold", mode="before")
    @classmethod
    def _validation_or_probability(cls, value: Any) -> str | float:
        if value == "validation":
            return value
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        if isinstance(number, (int, float)) and not isinstance(number, bool) and 0 < number < 1:
            return float(number)
        raise _field_error("threshold", value, "'validation' (chosen on validation data) or a number in (0, 1)")

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RunConfig:
        if self.mosaic_grid == 1:
            raise _field_error("mosaic-grid", 1, "0 (off) or 2-4 (a 1 x 1 mosaic is the source image)")
        if self.mosaic_grid >= 2 and self.dataset in MULTILABEL_SOURCES:
            raise _field_error("mosaic-grid", self.mosaic_grid, f"0 for {self.dataset}, already multi-label")
        if sites_dir(self.dataset) is not None:
            _check_site_folders_run(self)
        if self.labels == "single" and self.mosaic_grid >= 2:
            raise _field_error("labels", "single", "multi or auto when mosaic-grid >= 2 (a mosaic holds several classes)")
        if self.pretrained and self.fractal_pretrain_epochs:
            raise _field_error("fractal-pretrain-epochs", self.fractal_pretrain_epochs,
                               "0 when pretrained is set (the backbone starts from one of them, not both)")
        if self.pretrained and self.model == "small-cnn":
            raise _field_error("model", self.model, "resnet18 when pretrained is set (pretrained weights are ResNet weights)")
        if self.label_kind is not None:
            problems = label_kind_conflicts(self, self.label_kind)
            if problems:
                raise ValueError(problems[0])
        if self.centralized_model == "fednca" and self.label_kind == "single":
            raise _field_error("centralized-model", self.centralized_model, "linear or auto for single-label data")
        method = method_of(self)
        if self.factory.guide_steps > 0 and method.p2p:
            raise _field_error("factory.guide-steps", self.factory.guide_steps, "0 for method "
                               f"{self.method!r} (autoguidance guides the server's synthesis of method 'factory'; "
                               "factory-p2p sites draw unguided)")  # fmt: skip
        if self.val_data and method.family == "factory":
            raise _field_error("val-data", self.val_data, "empty for method "
                               f"{self.method!r} (its classifier epoch is chosen inside the one round)")  # fmt: skip
        if self.val_data and self.val_data in (self.test_data, FEDERATED_EVALUATION):
            raise _field_error("val-data", self.val_data, "a path other than test-data (validation must not be "
                               "the split that is reported)")  # fmt: skip
        _check_dp(self)
        return self

    @property
    def label_kind(self) -> str | None:
        """"multi" or "single" when the config alone decides it (labels key, mosaic-grid, a named
        dataset); None when only the data can tell (an npz file, a deployed site's folder, sites:<dir>)."""
        if self.labels != "auto":
            return self.labels
        if self.mosaic_grid >= 2:
            return "multi"
        kind, _, name = self.dataset.partition(":")
        if self.dataset in MULTILABEL_SOURCES:
            return "multi"
        if self.dataset in ("digits", "cifar10", *GENERATED_DATASETS):
            return "single"
        if kind == "medmnist":
            # Imported here: medmnist is slow to import and most runs never name it.
            from medmnist.info import INFO

            if name in INFO:
                return "multi" if INFO[name]["task"] == MEDMNIST_MULTILABEL_TASK else "single"
        return None

    @property
    def fednca_model(self) -> bool:
        """Whether the run trains FedNCA-ML's model: method fednca, or the centralised bound of it."""
        method = method_of(self)
        if method.family == "centralized" and self.centralized_model != "linear":
            return self.centralized_model == "fednca" or self.label_kind == "multi"
        return method.fednca_model

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


def sites_dir(dataset: str) -> str | None:
    """The folder of site folders that dataset `sites:<dir>` names, as written; None for other datasets."""
    kind, _, folder = dataset.partition(":")
    return folder if kind == SITES_DATASET else None


def _check_site_folders_run(cfg: RunConfig) -> None:
    """What a run on the sites' own folders cannot use: a mosaic (the folders are read as stored), a partition
    setting (each folder is one site), or the dataset's test split (the folders hold no test split)."""
    if cfg.mosaic_grid != 0:
        raise _field_error("mosaic-grid", cfg.mosaic_grid, f"0 with dataset {cfg.dataset!r} (the site folders' images "
                           "are read as stored, never tiled into mosaics)")  # fmt: skip
    defaults = RunConfig.model_fields
    for key in SITE_SPLIT_KEYS:
        name = key.replace("-", "_")
        if getattr(cfg, name) != defaults[name].default:
            raise _field_error(key, getattr(cfg, name), f"its default {defaults[name].default!r} with dataset "
                               f"{cfg.dataset!r}: each site folder is one site and the sites' own split is kept")  # fmt: skip
    if not cfg.test_data:
        raise _field_error("test-data", "", f"a site-layout folder, a MedMNIST-layout .npz or {FEDERATED_EVALUATION!r} "
                           f"with dataset {cfg.dataset!r} (the site folders hold no test split for the server)")  # fmt: skip


def _check_dp(cfg: RunConfig) -> None:
    if cfg.dp.mode == "off":
        return
    method = method_of(cfg)
    if method.fednca_model and cfg.fednca.control_variates:
        # The mean gradients go to the server outside Flower's DP wrappers, which clip and noise the model update only.
        raise _field_error("fednca.control-variates", True, f"false with dp.mode = {cfg.dp.mode!r} (each site's mean "
                           "gradient would reach the server unclipped and without noise)")
    if not method.weight_averaging:
        raise _field_error("dp.mode", cfg.dp.mode, f"off for method {cfg.method!r} (dp.* covers {', '.join(methods_where(weight_averaging=True))}; factory's generators take factory.dp-noise-multiplier)")
    if cfg.dp.mode != "local" and cfg.aggregation != "unweighted":
        # The noise is calibrated to clipping-norm / sites: a weighted average gives one site more influence.
        raise _field_error("aggregation", cfg.aggregation, f"unweighted with dp.mode = {cfg.dp.mode!r}")
    if cfg.dp.mode == "local" and cfg.dp.clipping == "adaptive":
        raise _field_error("dp.clipping", "adaptive", "fixed with dp.mode = 'local' (Flower's LocalDpMod clips at a fixed norm)")


def label_kind_conflicts(cfg: RunConfig, kind: str) -> list[str]:
    """What in `cfg` cannot run on `kind` ("multi" | "single") labels: checked on the config when it
    decides the kind, else when the data is loaded (`check_label_kind`)."""
    problems = []
    # Site folders keep their own split: the partition keys stay at their defaults and say nothing about it.
    partitioned = sites_dir(cfg.dataset) is None
    if cfg.labels != "auto" and cfg.labels != kind:
        problems.append(f"key 'labels' = {cfg.labels!r} is invalid; valid: {kind!r} or 'auto' ({kind}-label data)")
    labels = method_of(cfg).labels
    if labels == "multi" and kind == "single":
        problems.append(
            f"key 'method' = {cfg.method!r} is invalid; valid: a multi-label dataset (set mosaic-grid to 2-4, or "
            "use multi-label data: a multi-hot npz, '|'-joined labels.csv rows, medmnist:chestmnist)"
        )
    if labels == "single" and kind == "multi":
        problems.append(
            f"key 'method' = {cfg.method!r} is invalid; valid: single-label data (mosaic-grid = 0 and a single-label "
            "dataset): FederatedFactory's generators and classifier model one class per image"
        )
    if partitioned and cfg.partition == "multilabel-skew" and kind == "single":
        problems.append(
            f"key 'partition' = {cfg.partition!r} is invalid; valid: iid, dirichlet or classes-per-site for "
            "single-label data (or set mosaic-grid to 2-4 for multi-label data)"
        )
    if partitioned and cfg.partition in ("dirichlet", "classes-per-site") and kind == "multi":
        problems.append(
            f"key 'partition' = {cfg.partition!r} is invalid; valid: iid or multilabel-skew for multi-label data"
        )
    return problems


def check_label_kind(cfg: RunConfig, multilabel: bool, source: str) -> str:
    """The label kind of data read from `source`, once the data tells it; ConfigError when the run
    config cannot run on it (names the source, its kind and the keys to change)."""
    kind = "multi" if multilabel else "single"
    problems = label_kind_conflicts(cfg, kind)
    if problems:
        raise ConfigError(f"{source} holds {kind}-label data, which this run config cannot use: " + "; ".join(problems))
    return kind


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


def markdown_table() -> str:
    """Markdown table of every run-config key, generated for docs/configuration.md."""
    rows = ["| key | default | valid | meaning |", "|---|---|---|---|"]
    for key, info, default in _iter_fields(RunConfig):
        rows.append(f"| `{key}` | `{_toml_value(default)}` | {_range_text(info)} | {info.description or ''} |")
    return "\n".join(rows) + "\n"


CONFIG_PAGE = Path("docs") / "configuration.md"
CONFIG_PAGE_MARKERS = ("<!-- config-table:start -->\n", "<!-- config-table:end -->")
PYPROJECT_MARKERS = ("[tool.flwr.app.config]\n", "\n[tool.pytest")


def _replace_between(text: str, markers: tuple[str, str], body: str, where: str) -> str:
    start, end = markers
    if start not in text or end not in text:
        raise ValueError(f"{where} lacks the markers {start.strip()!r} ... {end.strip()!r}")
    head, rest = text.split(start, 1)
    return head + start + body + end + rest.split(end, 1)[1]


def generated_files(root: Path) -> dict[Path, str]:
    """pyproject.toml and docs/configuration.md as they must read with the current config model."""
    pyproject, page = root / "pyproject.toml", root / CONFIG_PAGE
    note = "# Generated from fedskew/config.py (python -m fedskew.config --write); a test fails when stale.\n"
    return {
        pyproject: _replace_between(pyproject.read_text(), PYPROJECT_MARKERS, note + toml_table(), str(pyproject)),
        page: _replace_between(page.read_text(), CONFIG_PAGE_MARKERS, markdown_table(), str(page)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate (or check) the config tables in pyproject.toml and docs/configuration.md.")
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
