"""An EDM2 generator's configuration: the architecture and training settings, their validation (a config
may come from another site), the presets, and the class-size rules that adapt a preset to one class.

Counts of training images (total_images, t_ref, t_rampup) follow EDM2 (Karras et al., CVPR 2024,
"Analyzing and Improving the Training Dynamics of Diffusion Models"), which counts training time in
images seen.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

CHANNELS_PER_HEAD = 64


@dataclass(frozen=True)
class GeneratorConfig:
    """Architecture and training settings of one EDM2 generator (plain, JSON-able data).

    t_ref and t_rampup are counted in training images, like total_images.
    label_dim 0 means an unconditional generator.
    """

    img_resolution: int
    img_channels: int
    label_dim: int
    model_channels: int
    channel_mult: tuple[int, ...]
    num_blocks: int
    attn_resolutions: tuple[int, ...]
    dropout: float
    batch_size: int
    total_images: int
    ref_lr: float
    t_ref: int
    t_rampup: int
    sigma_rel: float
    P_mean: float
    P_std: float
    augment_flip: bool
    augment_rot90: bool
    seed: int

    def __post_init__(self) -> None:
        # Lists arrive from JSON; tuples keep the frozen config hashable and comparable.
        for name in ("channel_mult", "attn_resolutions"):
            _require(isinstance(getattr(self, name), (list, tuple)), f"{name} must be a list, got {getattr(self, name)!r}")
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _validate_config(self)

    @property
    def level_resolutions(self) -> tuple[int, ...]:
        return tuple(self.img_resolution >> level for level in range(len(self.channel_mult)))

    @property
    def total_steps(self) -> int:
        # Round up so a run never sees fewer images than asked for.
        return math.ceil(self.total_images / self.batch_size)

    def to_dict(self) -> dict:
        as_dict = dataclasses.asdict(self)
        as_dict["channel_mult"] = list(self.channel_mult)
        as_dict["attn_resolutions"] = list(self.attn_resolutions)
        return as_dict

    @classmethod
    def from_dict(cls, data: dict) -> GeneratorConfig:
        if not isinstance(data, dict):
            raise ValueError(f"generator config must be a dict, got {type(data).__name__}")
        expected = {field.name for field in dataclasses.fields(cls)}
        missing = sorted(expected - data.keys())
        unknown = sorted(data.keys() - expected)
        if missing or unknown:
            raise ValueError(
                f"generator config keys do not match: missing {missing}, unknown {unknown}; "
                f"expected exactly {sorted(expected)}"
            )
        return cls(**data)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def is_int(value) -> bool:
    """An int, and not a bool (which Python counts as one): settings and counts from JSON or callers."""
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_resolution_levels(img_resolution: int, channel_mult: tuple[int, ...]) -> None:
    levels = len(channel_mult)
    divisor = 2 ** (levels - 1)
    if img_resolution % divisor == 0:
        return
    chain = " -> ".join(f"{img_resolution / 2**level:g}" for level in range(levels))
    max_levels = 1
    while img_resolution % (2**max_levels) == 0:
        max_levels += 1
    raise ValueError(
        f"img_resolution {img_resolution} does not halve cleanly across {levels} levels "
        f"(channel_mult {list(channel_mult)}: {chain}); with {levels} levels the resolution must be "
        f"a multiple of {divisor}, and {img_resolution} px allows at most {max_levels} level(s)"
    )


def attention_heads(channels: int) -> int:
    """Heads for an attention layer; at least one so that narrow CPU-scale models keep attention."""
    return max(1, channels // CHANNELS_PER_HEAD)


# Upper bounds of every int field: far above any real generator (the paper's is 128 channels, 4 levels,
# 3 blocks), low enough that a config received from another site builds (on the meta device) in well
# under a second and its sizes fit every integer type they meet (torch seeds, shapes, schedules).
INT_FIELD_RANGES = {
    "img_resolution": (1, 1024), "img_channels": (1, 16), "model_channels": (1, 1024), "num_blocks": (1, 16),
    "batch_size": (1, 1 << 20), "total_images": (1, 1 << 48), "t_ref": (1, 1 << 48),
    "label_dim": (0, 100_000), "t_rampup": (0, 1 << 48), "seed": (0, (1 << 63) - 1),
}
MAX_LEVELS = 8
MAX_CHANNEL_MULT = 16
FLOAT_FIELDS = ("dropout", "ref_lr", "sigma_rel", "P_mean", "P_std")


def _validate_config(config: GeneratorConfig) -> None:
    for name, (low, high) in INT_FIELD_RANGES.items():
        value = getattr(config, name)
        _require(is_int(value) and low <= value <= high, f"{name} must be an int in {low}..{high}, got {value!r}")
    for name in FLOAT_FIELDS:
        value = getattr(config, name)
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            f"{name} must be a finite number, got {value!r}",
        )
    _require(
        1 <= len(config.channel_mult) <= MAX_LEVELS
        and all(is_int(m) and 1 <= m <= MAX_CHANNEL_MULT for m in config.channel_mult),
        f"channel_mult must be a list of 1..{MAX_LEVELS} ints in 1..{MAX_CHANNEL_MULT}, got {list(config.channel_mult)[:10]}",
    )
    _require(
        len(config.attn_resolutions) <= MAX_LEVELS and all(is_int(r) for r in config.attn_resolutions),
        f"attn_resolutions must be a list of at most {MAX_LEVELS} ints, got {list(config.attn_resolutions)[:10]}",
    )
    _validate_resolution_levels(config.img_resolution, config.channel_mult)
    levels = config.level_resolutions
    bad_attn = [r for r in config.attn_resolutions if r not in levels]
    _require(
        not bad_attn,
        f"attn_resolutions {list(config.attn_resolutions)} include {bad_attn}, which are not level "
        f"resolutions; valid values are {list(levels)}",
    )
    # The deepest decoder level always has attention, so check it too.
    for level, resolution in enumerate(levels):
        if resolution in config.attn_resolutions or level == len(levels) - 1:
            channels = config.model_channels * config.channel_mult[level]
            heads = attention_heads(channels)
            _require(
                channels % heads == 0,
                f"attention at {resolution} px has {channels} channels, not divisible into "
                f"{heads} heads of ~{CHANNELS_PER_HEAD}; use a multiple of {CHANNELS_PER_HEAD}",
            )
    _require(0.0 <= config.dropout < 1.0, f"dropout must be in [0, 1), got {config.dropout!r}")
    _require(
        config.total_images >= config.batch_size,
        f"total_images {config.total_images} must be >= batch_size {config.batch_size}",
    )
    _require(config.ref_lr > 0, f"ref_lr must be > 0, got {config.ref_lr!r}")
    # gamma > 0 needs 12 - sigma_rel^-2 < 0 in the EMA cubic (training.ema_gamma, EDM2 Eq. 126).
    _require(
        0.0 < config.sigma_rel < 1.0 / math.sqrt(12.0),
        f"sigma_rel must be in (0, {1 / math.sqrt(12):.4f}), got {config.sigma_rel!r}",
    )
    _require(config.P_std > 0, f"P_std must be > 0, got {config.P_std!r}")
    for name in ("augment_flip", "augment_rot90"):
        value = getattr(config, name)
        _require(isinstance(value, bool), f"{name} must be a bool, got {value!r}")


# FederatedFactory's 32 px generator (Moleri et al., arXiv:2603.16370, their generator settings). Batch 4096 is the
# ceiling; a class with fewer images uses the largest power of two <= its size (min 32).
GPU_PRESET_32PX = GeneratorConfig(
    img_resolution=32,
    img_channels=3,
    label_dim=0,
    model_channels=128,
    channel_mult=(1, 2, 2, 2),
    num_blocks=3,
    attn_resolutions=(16, 8),
    dropout=0.3,
    batch_size=4096,
    total_images=25_000_000,
    ref_lr=0.01,
    t_ref=35_000 * 4096,
    t_rampup=10_000_000,
    sigma_rel=0.05,
    P_mean=-0.8,
    P_std=1.6,
    augment_flip=True,
    augment_rot90=False,
    seed=0,
)

# One class of sklearn's 8 px digits in about a minute on a laptop CPU. The ramp-up and t_ref are
# scaled to the 400-step run (the published 10 M-image ramp-up would never finish).
# cpu_preset(resolution) scales it to larger images.
CPU_PRESET = GeneratorConfig(
    img_resolution=8,
    img_channels=1,
    label_dim=0,
    model_channels=16,
    channel_mult=(1, 2),
    num_blocks=2,
    attn_resolutions=(4,),
    dropout=0.0,
    batch_size=64,
    total_images=400 * 64,
    # EDM2's 0.01 is set for millions of images; in a few hundred steps 0.04 draws closer images on
    # 8 px and 28 px digits and 16 px textured shapes alike (bench/factory_search.py, docs/benchmarks-factory.md).
    ref_lr=0.04,
    t_ref=100 * 64,
    t_rampup=40 * 64,
    sigma_rel=0.05,
    P_mean=-0.8,
    P_std=1.6,
    augment_flip=False,
    augment_rot90=False,
    seed=0,
)

# The CPU preset's deepest level works at 4-8 px whatever the image size, so its receptive field
# covers the whole image (the 8 px preset's two levels at 28 px see 14 px patches and draw strokes
# without a digit's global shape).
CPU_DEEPEST_SIDE = 8


def cpu_preset(resolution: int) -> GeneratorConfig:
    """CPU_PRESET for `resolution` px images: one more UNet level (2x channels, at most 32) per halving
    until the deepest side is <= CPU_DEEPEST_SIDE, attention at the deepest level only, and the
    image budget grown with the levels (every extra level adds 200 steps' worth of images)."""
    mult = [1, 2]
    side = resolution >> 1
    while side > CPU_DEEPEST_SIDE and side % 2 == 0:
        mult.append(2)
        side >>= 1
    extra_levels = len(mult) - len(CPU_PRESET.channel_mult)
    total_images = CPU_PRESET.total_images + extra_levels * 200 * CPU_PRESET.batch_size
    return dataclasses.replace(
        CPU_PRESET,
        img_resolution=resolution,
        channel_mult=tuple(mult),
        num_blocks=CPU_PRESET.num_blocks if extra_levels == 0 else 1,
        attn_resolutions=(side,),
        total_images=total_images,
        t_ref=round(CPU_PRESET.t_ref * total_images / CPU_PRESET.total_images),
        t_rampup=round(CPU_PRESET.t_rampup * total_images / CPU_PRESET.total_images),
    )


def with_batch_for_class_size(config: GeneratorConfig, n_images: int, min_batch: int = 32) -> GeneratorConfig:
    """FederatedFactory's batch rule: the largest power of two <= n_images, at least min_batch, at most
    config.batch_size. t_ref scales with the batch because the paper counts it in batches."""
    if not is_int(n_images) or n_images < 1:
        raise ValueError(f"n_images must be an int >= 1, got {n_images!r}")
    power_of_two = 1 << (n_images.bit_length() - 1)
    batch = min(config.batch_size, max(min_batch, power_of_two))
    t_ref = max(1, round(config.t_ref * batch / config.batch_size))
    return dataclasses.replace(config, batch_size=batch, t_ref=t_ref)


def budgeted_for_class(config: GeneratorConfig, n_images: int, total_images: int | None = None) -> GeneratorConfig:
    """`config` for a class of `n_images`, trained on a budget of `total_images` images seen (default:
    the config's own), whatever batch the class size gives: the batch rule above, steps =
    total_images / batch, and the ramp-up kept at the config's share of the run but ending no later
    than the lr decay starts (t_ref, counted in batches, shrinks with the batch), so the lr reaches
    ref_lr in every run. Without that cap a class of 50 images at the 32 px preset (batch 32, decay
    from 1.1 M images) would peak at ref_lr / 3 at the end of a 10 M-image ramp-up."""
    total = config.total_images if total_images is None else total_images
    if not is_int(total) or total < 1:
        raise ValueError(f"total_images must be an int >= 1, got {total!r}")
    sized = with_batch_for_class_size(config, n_images)
    rampup_share = config.t_rampup / config.total_images
    t_rampup = min(round(rampup_share * total), sized.t_ref)
    return dataclasses.replace(sized, total_images=max(total, sized.batch_size), t_rampup=t_rampup)


def check_conditioning(labels_given: bool, label_dim: int) -> None:
    """Class ids exactly when the generator is conditional (label_dim > 0); the network and the sampler both ask."""
    if label_dim == 0 and labels_given:
        raise ValueError("this generator is unconditional (label_dim 0); pass labels=None")
    if label_dim and not labels_given:
        raise ValueError(f"this generator is conditional (label_dim {label_dim}); pass class ids")


def check_class_ids(labels: np.ndarray, n: int, label_dim: int) -> None:
    """`labels` must be n int class ids of a conditional generator with `label_dim` classes."""
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be {n} int class ids, got dtype {labels.dtype} shape {labels.shape}")
    if labels.min() < 0 or labels.max() >= label_dim:
        raise ValueError(f"labels must lie in [0, {label_dim}), got range [{labels.min()}, {labels.max()}]")
