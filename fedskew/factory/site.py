"""What a FederatedFactory site does, as plain functions: train generators on its own images only,
audit them for memorisation before anything leaves the site, and (P2P) train its own expert on
its real images plus synthetic images of the classes it lacks."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from fedskew.config import AUTO_GUIDE_STEPS, AUTO_GUIDE_STEPS_WIDE, FactorySection, RunConfig
from fedskew.data.pixels import unit_float
from fedskew.data.site_folder import DeployedSite
from fedskew.data.sites import SiteData
from fedskew.factory.classifier import ClassifierRecipe, train_classifier
from fedskew.factory.dp_sgd import DpSgd, generator_privacy
from fedskew.factory.parallel import run_side_by_side, worker_count
from fedskew.factory.timing import Elapsed, timed
from fedskew.progress import ProgressReporter
from fedskew.methods import method_of
from fedskew.factory.library import (
    GeneratorModule,
    Library,
    PlannedModule,
    SyntheticSet,
    derived_seed,
    module_id_for,
    sampling_plan,
    synthesise,
)
from fedskew.models.edm2 import (
    CPU_PRESET,
    GPU_PRESET_32PX,
    GeneratorConfig,
    Precond,
    budgeted_for_class,
    build_generator,
    cpu_preset,
    sample,
    train_generator,
    with_batch_for_class_size,
)
from fedskew.models.generator_io import state_dict_checksum
from fedskew.protocol import packed_size_limit


def generator_preset(name: str, resolution: int) -> GeneratorConfig:
    """The named preset for `resolution` px images (the CPU one grows its levels with the image)."""
    return cpu_preset(resolution) if name == "cpu" else GPU_PRESET_32PX


def reference_lr(factory: FactorySection) -> float:
    """The generators' reference learning rate: factory.generator-lr, or the preset's when it is 0."""
    return factory.generator_lr or (CPU_PRESET if factory.generator == "cpu" else GPU_PRESET_32PX).ref_lr


# A sample closer to a training image than this share of its distance to the nearest held-out image
# counts as memorised (the rule bench/generator.py reports).
MEMORIZATION_RATIO = 1 / 3


class UploadRefusal(ValueError):
    """The site will not upload its generators (a deliberate refusal, reported to the server, not a crash)."""


class MemorizationRefusal(UploadRefusal):
    """The site will not upload: every generator's audit is above factory.max-memorization or impossible."""


class EpsilonRefusal(UploadRefusal):
    """The site will not train or upload: a generator's DP epsilon would exceed factory.max-epsilon."""


def generator_config(
    factory: FactorySection, image_shape: tuple[int, int, int], label_dim: int, n_images: int, seed: int
) -> GeneratorConfig:
    """The preset adapted to the data: image size and channels, its width (factory.generator-channels) and
    reference lr (factory.generator-lr),
    attention at the same levels, the paper's batch rule for the class size, and a budget in images seen
    (factory.generator-images, or factory.generator-steps x the batch) whatever the batch; t_ref and the
    ramp-up scale with the budget (as EDM2 does for short runs), and the ramp-up ends before the decay so
    the lr reaches its reference."""
    channels, height, width = image_shape
    if height != width:
        raise ValueError(f"generators need square images, got {height} x {width}; set run-config image-size")
    preset = generator_preset(factory.generator, height)
    # Attention stays at the same UNet levels as in the preset (level k works at side >> k).
    attn = tuple(height >> preset.level_resolutions.index(r) for r in preset.attn_resolutions)
    batch = with_batch_for_class_size(preset, n_images).batch_size
    total = factory.generator_steps * batch if factory.generator_steps else factory.generator_images or preset.total_images
    scale = total / preset.total_images
    config = dataclasses.replace(
        preset,
        img_resolution=height,
        img_channels=channels,
        label_dim=label_dim,
        model_channels=factory.generator_channels or preset.model_channels,
        ref_lr=reference_lr(factory),
        attn_resolutions=attn,
        total_images=max(total, preset.batch_size),
        t_ref=max(1, round(preset.t_ref * scale)),
        t_rampup=round(preset.t_rampup * scale),
        augment_flip=factory.augment != "none",
        augment_rot90=factory.augment == "flip-rot90",
        seed=seed,
    )
    return budgeted_for_class(config, n_images, total)


def nearest_distances(queries: np.ndarray, references: np.ndarray) -> np.ndarray:
    """L2 distance (pixel space) from each query image to its nearest reference image."""
    q, r = queries.reshape(len(queries), -1).astype(np.float64), references.reshape(len(references), -1).astype(np.float64)
    squared = (q**2).sum(1)[:, None] + (r**2).sum(1)[None, :] - 2 * q @ r.T
    return np.sqrt(np.maximum(squared, 0).min(axis=1))


def memorization_share(samples: np.ndarray, train: np.ndarray, heldout: np.ndarray) -> float:
    """Share of samples whose nearest training image is closer than MEMORIZATION_RATIO x the distance
    to their nearest held-out image; NaN when there is no held-out image to compare with."""
    if len(heldout) == 0:
        return float("nan")
    ratio = nearest_distances(samples, train) / np.maximum(nearest_distances(samples, heldout), 1e-12)
    return float((ratio < MEMORIZATION_RATIO).mean())


def audit_generator(
    model: Precond, class_ids: list[int], site: SiteData, factory: FactorySection, seed: int, device: torch.device
) -> float:
    """The module's memorisation score: the worst class's share (a conditional module models several)."""
    shares = []
    for class_id in class_ids:
        samples = sample(
            model, factory.audit_samples, labels=class_id if model.config.label_dim else None,
            steps=factory.sampler_steps, seed=derived_seed(seed, class_id), batch_size=factory.sample_batch_size,
            device=device,
        )  # fmt: skip
        train = unit_float(site.train_images[site.train_labels == class_id])
        heldout = unit_float(site.val_images[site.val_labels == class_id])
        shares.append(memorization_share(samples, train, heldout))
    return float("nan") if any(np.isnan(shares)) else max(shares)


def check_memorization(modules: list[GeneratorModule], max_memorization: float) -> tuple[list[GeneratorModule], list[dict]]:
    """(the modules to upload, the withheld ones: module id and why) under factory.max-memorization (0 = off:
    every module is uploaded). A module above the limit, or without a held-out image to audit against, is
    withheld on its own: a generator models one class of the site, so the others may still leave it (under
    label skew the few images of a site's rare class are what a generator memorises). Raises
    MemorizationRefusal naming every module when none is left."""
    if max_memorization <= 0:
        return list(modules), []
    withheld = [
        {"module-id": m.module_id, "reason": f"no held-out image of class(es) {list(m.classes)} to audit against (raise val-fraction)"}
        if np.isnan(m.memorization)
        else {"module-id": m.module_id, "reason": f"{m.memorization:.3f} of audit samples memorised"}
        for m in modules
        if not m.memorization <= max_memorization
    ]
    kept = [m for m in modules if m.memorization <= max_memorization]
    if not kept:
        raise MemorizationRefusal(
            f"site refuses to upload: factory.max-memorization = {max_memorization} is exceeded by every generator: "
            + "; ".join(f"{w['module-id']}: {w['reason']}" for w in withheld)
        )
    return kept, withheld


def check_epsilon(plan: list[PlannedModule], max_epsilon: float) -> None:
    """Raise EpsilonRefusal naming every planned generator whose DP epsilon exceeds the limit (0 = none);
    the epsilon follows from the run config and the class sizes, so this runs before any training."""
    if max_epsilon <= 0:
        return
    problems = [f"{p.module_id}: epsilon {p.privacy['epsilon']:.4g}" for p in plan if p.privacy["epsilon"] > max_epsilon]
    if problems:
        raise EpsilonRefusal(
            f"site refuses to train and upload: factory.max-epsilon = {max_epsilon} is exceeded: " + "; ".join(problems)
            + " (raise factory.dp-noise-multiplier, or lower factory.generator-images / factory.generator-steps)"
        )


def planned_module(
    cfg: RunConfig, site_id: int, classes: tuple[int, ...], image_counts: tuple[int, ...],
    image_shape: tuple[int, int, int], num_classes: int,
) -> PlannedModule:
    """The generator of `classes` at site `site_id` (one class: unconditional; else conditional), its
    config and seed determined by the run config and the images it trains on."""
    conditional = cfg.factory.conditional
    # Purpose tag 0 = generators; class id + 1 per unconditional module, 0 for the conditional one.
    seed = derived_seed(cfg.seed, site_id, 0, 0 if conditional else classes[0] + 1)
    config = generator_config(cfg.factory, image_shape, num_classes if conditional else 0, sum(image_counts), seed)
    return PlannedModule(
        module_id_for(site_id, None if conditional else classes[0]), classes, image_counts, config,
        generator_privacy(cfg.factory, config, sum(image_counts)),
    )  # fmt: skip


def planned_modules(
    cfg: RunConfig, site_id: int, label_counts: list[int], image_shape: tuple[int, int, int]
) -> list[PlannedModule]:
    """The generators a site with these training label counts trains: one unconditional module per class
    with at least factory.min-class-images images (or one conditional module of them all). The server
    derives the same plan from the site's survey to check its upload."""
    classes = [c for c, n in enumerate(label_counts) if n >= cfg.factory.min_class_images]
    groups = ([classes] if classes else []) if cfg.factory.conditional else [[c] for c in classes]
    return [
        planned_module(cfg, site_id, tuple(g), tuple(int(label_counts[c]) for c in g), image_shape, len(label_counts))
        for g in groups
    ]


def generator_payload_limit(cfg: RunConfig, image_shape: tuple[int, int, int], num_classes: int) -> int:
    """The most bytes one packed generator of this run takes: its architecture follows from the run config
    and the image shape alone, so the limit is known before any upload arrives."""
    classes = tuple(range(num_classes)) if cfg.factory.conditional else (0,)
    probe = planned_module(cfg, 0, classes, (1,) * len(classes), image_shape, num_classes)
    return packed_size_limit(build_generator(probe.config, "meta").state_dict())


def classes_only(site: SiteData, classes: tuple[int, ...]) -> SiteData:
    """The site's training and validation images of these classes: all that one generator's training and
    audit read (and all a worker process is sent)."""
    train, val = np.isin(site.train_labels, classes), np.isin(site.val_labels, classes)
    return dataclasses.replace(
        site, train_images=site.train_images[train], train_labels=site.train_labels[train],
        val_images=site.val_images[val], val_labels=site.val_labels[val],
    )  # fmt: skip


def train_audited_module(
    cfg: RunConfig, site: SiteData, planned: PlannedModule, position: str, device: torch.device, kind: str = "generator"
) -> tuple[GeneratorModule, Elapsed, Elapsed]:
    """Train the planned generator on the site's images of its classes and audit it for memorisation;
    returns the module (EMA weights) and the training's and the audit's time. `kind` ("generator" or
    "guide") and `position` ("k/n") label its progress lines."""
    factory = cfg.factory
    chosen = np.isin(site.train_labels, planned.classes)
    private = None if planned.privacy is None else DpSgd(
        factory.dp_noise_multiplier, factory.dp_clipping_norm, planned.config.batch_size, int(chosen.sum())
    )  # fmt: skip
    training, audit = Elapsed(), Elapsed()
    with timed(training):
        model, stats = train_generator(
            site.train_images[chosen], site.train_labels[chosen] if planned.conditional else None,
            planned.config, device=device,
            progress=ProgressReporter(f"site {site.site_id}: {kind} {position} {planned.module_id}", planned.config.batch_size),
            private=private,
        )  # fmt: skip
    with timed(audit):
        score = audit_generator(model, list(planned.classes), site, factory, planned.config.seed, device)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    dp = "" if planned.privacy is None else f", DP epsilon {planned.privacy['epsilon']:.3g} at delta {planned.privacy['delta']:.3g}"
    print(
        f"site {site.site_id}: {kind} {planned.module_id} on {int(chosen.sum())} images, {stats.steps} steps, "
        f"{stats.wall_time_s:.0f} s, memorised share {score:.3f}{dp}",
        flush=True,
    )
    module = GeneratorModule(
        planned.module_id, site.site_id, planned.classes, planned.image_counts, planned.config,
        state_dict_checksum(state), score, state, planned.privacy,
    )  # fmt: skip
    return module, training, audit


def label_counts(site: SiteData) -> list[int]:
    return np.bincount(site.train_labels, minlength=site.num_classes).tolist()


def uploaded_modules(cfg: RunConfig, site: SiteData, modules: list[GeneratorModule], what: str = "") -> tuple[list[GeneratorModule], list[dict]]:
    """`check_memorization` at the site's limit (factory.max-memorization; by default 0.05 at a deployed
    site, off in simulation), each withheld generator printed with its reason (`what` prefixes it: "its
    guide: ")."""
    limit = cfg.factory.memorization_limit(deployed=isinstance(site, DeployedSite))
    kept, withheld = check_memorization(modules, limit)
    withheld = [{**entry, "reason": what + entry["reason"]} for entry in withheld]
    for entry in withheld:
        print(f"site {site.site_id}: withholds {entry['module-id']} (factory.max-memorization = {limit}): {entry['reason']}", flush=True)
    return kept, withheld


def trained_guides(
    cfg: RunConfig, site: SiteData, modules: list[GeneratorModule], withheld: list[dict], device: torch.device
) -> tuple[list[GeneratorModule], list[GeneratorModule], list[dict], dict]:
    """factory.guide-steps: a guide for each generator the site will upload, audited like it; a generator
    whose guide is withheld is withheld with it. Returns (generators, their guides, withheld, guide timing
    metrics)."""
    guides, metrics = train_site_generators(guide_config(cfg), site, device, only=[m.module_id for m in modules], kind="guide")
    try:
        guides, guides_withheld = uploaded_modules(cfg, site, guides, what="its guide: ")
    except MemorizationRefusal as err:
        raise MemorizationRefusal(f"{err} (the guides of factory.guide-steps)") from None
    kept = {g.module_id for g in guides}
    return [m for m in modules if m.module_id in kept], guides, withheld + guides_withheld, {f"guide_{k}": v for k, v in metrics.items()}


def site_plan(cfg: RunConfig, site: SiteData) -> list[PlannedModule]:
    """The generators `site` trains (empty when it holds no class with factory.min-class-images images)."""
    return planned_modules(cfg, site.site_id, label_counts(site), tuple(site.train_images.shape[1:]))


def guide_steps(cfg: RunConfig) -> int:
    """The steps of each autoguidance guide (0 = unguided): factory.guide-steps, or where it is -1 (the
    default) AUTO_GUIDE_STEPS_WIDE for method factory when its generators are wider than the CPU preset
    (factory.generator-channels above 16, or the gpu-32px preset), else none. That is what the runs
    measured (docs/benchmarks-factory.md): guides of the CPU preset under generators of the same width
    moved accuracy by -0.8 to +0.9 points (8 px and 28 px digits, 32 px shapes) at 1.5-2 times the run's
    time; under 32-channel generators, 200-step guides added 3.5-10.5 points on textured shapes at 16 and
    32 px. factory-p2p and DP-SGD runs draw unguided."""
    factory = cfg.factory
    if factory.guide_steps != AUTO_GUIDE_STEPS:
        return factory.guide_steps
    wider = factory.generator == "gpu-32px" or factory.generator_channels > CPU_PRESET.model_channels
    if not wider or not method_of(cfg).autoguided or factory.dp_noise_multiplier > 0:
        return 0
    return AUTO_GUIDE_STEPS_WIDE


def guide_config(cfg: RunConfig) -> RunConfig | None:
    """The run config a site's autoguidance guides train under (None when `guide_steps` is 0): the CPU
    preset at its own width for `guide_steps` steps, everything else as for the generators. A guide is
    planned like its generator, so it has the generator's module id, classes and seed (the runs that
    measured autoguidance trained their guides so)."""
    steps = guide_steps(cfg)
    if not steps:
        return None
    factory = cfg.factory.model_copy(update={"generator": "cpu", "generator_channels": 0, "generator_steps": steps, "generator_images": 0})
    return cfg.model_copy(update={"factory": factory})


def train_site_generators(
    cfg: RunConfig, site: SiteData, device: torch.device, only: Sequence[str] | None = None, kind: str = "generator"
) -> tuple[list[GeneratorModule], dict]:
    """One unconditional generator per class held (or one conditional one; with `only`, those of the
    plan's module ids), each audited, in factory.parallel-generators worker processes side by side; returns
    the modules (EMA weights, in plan order, each with its audit share) and timing metrics (seconds summed
    over the generators). What may leave the site is decided on upload (`check_memorization`)."""
    factory = cfg.factory
    plan = [p for p in site_plan(cfg, site) if only is None or p.module_id in only]
    if not plan:
        raise ValueError(
            f"site {site.site_id} holds no class with >= factory.min-class-images = {factory.min_class_images} "
            f"training images (counts: {label_counts(site)})"
        )
    check_epsilon(plan, factory.max_epsilon)
    workers = worker_count(factory.parallel_generators, len(plan), device)
    jobs = [(cfg, classes_only(site, planned.classes), planned, f"{k}/{len(plan)}", device, kind) for k, planned in enumerate(plan, 1)]
    modules, training, audit = [], Elapsed(), Elapsed()
    for module, module_training, module_audit in run_side_by_side(train_audited_module, jobs, workers):
        modules.append(module)
        training.add(module_training)
        audit.add(module_audit)
    return modules, {
        **training.as_metrics("generator"), **audit.as_metrics("audit"), "modules": len(modules), "generator_workers": workers,
    }


def lacking_classes(site: SiteData, library: Library) -> list[int]:
    """Classes the library covers that none of this site's own modules model."""
    own = {c for m in library.modules if m.site_id == site.site_id for c in m.classes}
    return [c for c in library.covered_classes() if c not in own]


def p2p_samples_per_class(site: SiteData, factory: FactorySection) -> int:
    """Synthetic images per lacking class: the configured count, or (0) by image side from the real images
    of the site's largest class, so its expert trains on a class-balanced set (under label skew the mean
    over the classes held counts classes of one or two images and starved the experts)."""
    return factory.expert_samples_per_class(site.train_images.shape[-1], max(1, *label_counts(site)))


def lacking_class_images(cfg: RunConfig, site: SiteData, library: Library, device: torch.device) -> SyntheticSet | None:
    """P2P: synthetic images of the classes the site lacks, drawn from the relayed library (None when it
    lacks none)."""
    lacking = lacking_classes(site, library)
    if not lacking:
        return None
    factory = cfg.factory
    plan = sampling_plan(library, p2p_samples_per_class(site, factory), derived_seed(cfg.seed, site.site_id, 1), classes=lacking)
    return synthesise(
        library, plan, steps=factory.sampler_steps, batch_size=factory.sample_batch_size, device=device,
        parallel=factory.parallel_generators, progress=False,
    )  # fmt: skip


def train_site_expert(
    cfg: RunConfig, site: SiteData, library: Library, device: torch.device, synthetic: SyntheticSet | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """P2P: train the site's own classifier on its real training images plus synthetic images of the
    classes it lacks (`synthetic`, else drawn here by lacking_class_images); return its weights and metrics."""
    factory = cfg.factory
    images, labels = site.train_images, site.train_labels
    synthesis, training = Elapsed(), Elapsed()
    if synthetic is None:
        with timed(synthesis):
            synthetic = lacking_class_images(cfg, site, library, device)
    if synthetic is not None:
        # One array for the classifier: the synthetic images are float, so the real ones join them in [0, 1]
        # (uint8 real images without synthetic ones stay uint8; the loader scales them per batch).
        images, labels = np.concatenate([unit_float(images), synthetic.images]), np.concatenate([labels, synthetic.labels])
    recipe = dataclasses.replace(ClassifierRecipe.from_config(cfg), epochs=factory.expert_epochs())
    with timed(training):
        model, stats = train_classifier(
            images, labels, site.num_classes, recipe,
            val_fraction=factory.p2p_val_fraction, seed=derived_seed(cfg.seed, site.site_id, 2), device=device,
        )  # fmt: skip
    metrics = {
        "num-examples": len(labels),
        "real_images": len(site.train_labels),
        "synthetic_images": len(labels) - len(site.train_labels),
        "lacking_classes": len(lacking_classes(site, library)),
        **synthesis.as_metrics("synthesis"),
        **training.as_metrics("classifier"),
        **{k: v for k, v in stats.items() if isinstance(v, (int, float))},
    }
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, metrics
