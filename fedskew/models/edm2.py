"""EDM2 diffusion generator (Karras et al., CVPR 2024), as described in docs/factory.md.

One module holds the whole generator: magnitude-preserving (MP) primitives, the UNet, the
preconditioning wrapper with its uncertainty (logvar) head, the loss, the learning-rate schedule,
the power-function EMA, the deterministic Heun sampler and the training loop.

Training images enter as numpy arrays (N, C, H, W), float32 in [0, 1] or uint8 0-255
(fedskew.data.pixels); samples leave as float32 in [0, 1]. The network works in [-1, 1]
(sigma_data = 0.5 is stated for that range).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.data.pixels import unit_float

SIGMA_DATA = 0.5
SAMPLER_SIGMA_MIN = 0.002
SAMPLER_SIGMA_MAX = 80.0
SAMPLER_RHO = 7.0
CHANNELS_PER_HEAD = 64
LOGVAR_CHANNELS = 128
ADAM_BETAS = (0.9, 0.99)
ADAM_EPS = 1e-8
# Channels-last: the CPU (oneDNN) and GPU convolution kernels are faster in it; every layer keeps it.
MEMORY_FORMAT = torch.channels_last


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


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


def _is_int(value) -> bool:
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
        _require(_is_int(value) and low <= value <= high, f"{name} must be an int in {low}..{high}, got {value!r}")
    for name in FLOAT_FIELDS:
        value = getattr(config, name)
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            f"{name} must be a finite number, got {value!r}",
        )
    _require(
        1 <= len(config.channel_mult) <= MAX_LEVELS
        and all(_is_int(m) and 1 <= m <= MAX_CHANNEL_MULT for m in config.channel_mult),
        f"channel_mult must be a list of 1..{MAX_LEVELS} ints in 1..{MAX_CHANNEL_MULT}, got {list(config.channel_mult)[:10]}",
    )
    _require(
        len(config.attn_resolutions) <= MAX_LEVELS and all(_is_int(r) for r in config.attn_resolutions),
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
    # gamma > 0 needs 12 - sigma_rel^-2 < 0 in the EMA cubic.
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
    if not _is_int(n_images) or n_images < 1:
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
    if not _is_int(total) or total < 1:
        raise ValueError(f"total_images must be an int >= 1, got {total!r}")
    sized = with_batch_for_class_size(config, n_images)
    rampup_share = config.t_rampup / config.total_images
    t_rampup = min(round(rampup_share * total), sized.t_ref)
    return dataclasses.replace(sized, total_images=max(total, sized.batch_size), t_rampup=t_rampup)


# --------------------------------------------------------------------------------------------
# Magnitude-preserving primitives
# --------------------------------------------------------------------------------------------


def normalize(x: torch.Tensor, dim: int | Sequence[int] | None = None, eps: float = 1e-4) -> torch.Tensor:
    """Scale every slice along `dim` (default: all but the first axis) to unit RMS."""
    if dim is None:
        dim = list(range(1, x.ndim))
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float32)
    slice_numel = norm.numel() / x.numel()
    norm = eps + norm * math.sqrt(slice_numel)
    # One reciprocal of the (small) norm tensor and a product: a division over every element costs about
    # twice as much on the CPU, forward and backward.
    return x * norm.reciprocal().to(x.dtype)


def pixel_norm(x: torch.Tensor) -> torch.Tensor:
    """Unit RMS across channels at every pixel."""
    return normalize(x, dim=1)


# The RMS of silu(z) for z ~ N(0, 1).
SILU_RMS = 0.596


def mp_silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) * (1 / SILU_RMS)


def mp_sum_weights(t: float) -> tuple[float, float]:
    """The weights of a and b in mp_sum(a, b, t): (1 - t) and t, scaled to keep unit magnitude."""
    scale = math.sqrt((1 - t) ** 2 + t**2)
    return (1 - t) / scale, t / scale


def mp_sum(a: torch.Tensor, b: torch.Tensor, t: float = 0.5) -> torch.Tensor:
    weight_a, weight_b = mp_sum_weights(t)
    return torch.add(b * weight_b, a, alpha=weight_a)


def mp_cat(a: torch.Tensor, b: torch.Tensor, t: float = 0.5, dim: int = 1) -> torch.Tensor:
    channels_a, channels_b = a.shape[dim], b.shape[dim]
    scale = math.sqrt((channels_a + channels_b) / ((1 - t) ** 2 + t**2))
    wa = scale / math.sqrt(channels_a) * (1 - t)
    wb = scale / math.sqrt(channels_b) * t
    return torch.cat([wa * a, wb * b], dim=dim)


def resample(x: torch.Tensor, mode: str) -> torch.Tensor:
    """'keep', 'down' (2x2 box average, stride 2) or 'up' (nearest neighbour x2)."""
    if mode == "keep":
        return x
    if mode == "down":
        return F.avg_pool2d(x, kernel_size=2, stride=2)
    if mode == "up":
        return F.interpolate(x, scale_factor=2, mode="nearest")
    raise ValueError(f"resample mode must be 'keep', 'down' or 'up', got {mode!r}")


class MPFourier(nn.Module):
    """Random Fourier features of a scalar; fixed (seeded) frequencies and phases."""

    def __init__(self, num_channels: int, generator: torch.Generator):
        super().__init__()
        freqs = torch.empty(num_channels).normal_(generator=generator) * (2 * math.pi)
        phases = torch.empty(num_channels).uniform_(generator=generator) * (2 * math.pi)
        self.register_buffer("freqs", freqs)
        self.register_buffer("phases", phases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(torch.float32).outer(self.freqs.to(torch.float32)) + self.phases.to(torch.float32)
        return (y.cos() * math.sqrt(2)).to(x.dtype)


class MPConv(nn.Module):
    """Weight-normalised convolution without bias; kernel () makes it a linear layer."""

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple[int, ...], generator: torch.Generator):
        super().__init__()
        self.out_channels = out_channels
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, *kernel).normal_(generator=generator))

    def forward(self, x: torch.Tensor, gain: float | torch.Tensor = 1.0) -> torch.Tensor:
        w = self.weight.to(torch.float32)
        if self.training:
            # Forced weight normalisation: Adam updates cannot grow the stored weights, which
            # keeps the effective learning rate from decaying as norms drift.
            with torch.no_grad():
                self.weight.copy_(normalize(w))
        fan_in = w[0].numel()
        w = normalize(w) * (gain / math.sqrt(fan_in))
        w = w.to(x.dtype)
        if w.ndim == 2:
            return x @ w.t()
        return F.conv2d(x, w, padding=w.shape[-1] // 2)


# --------------------------------------------------------------------------------------------
# Network
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    """UNet block; 'enc' flavour normalises its input, 'dec' flavour skips with a 1x1 conv after the residual."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        emb_channels: int,
        flavor: str,
        resample_mode: str,
        attention: bool,
        dropout: float,
        generator: torch.Generator,
        res_balance: float = 0.3,
        attn_balance: float = 0.3,
        clip_act: float = 256.0,
    ):
        super().__init__()
        if flavor not in ("enc", "dec"):
            raise ValueError(f"Block flavor must be 'enc' or 'dec', got {flavor!r}")
        self.out_channels = out_channels
        self.flavor = flavor
        self.resample_mode = resample_mode
        self.num_heads = attention_heads(out_channels) if attention else 0
        self.dropout = dropout
        self.res_balance = res_balance
        self.attn_balance = attn_balance
        self.clip_act = clip_act
        self.emb_gain = nn.Parameter(torch.zeros([]))
        self.conv_res0 = MPConv(out_channels if flavor == "enc" else in_channels, out_channels, (3, 3), generator)
        self.emb_linear = MPConv(emb_channels, out_channels, (), generator)
        self.conv_res1 = MPConv(out_channels, out_channels, (3, 3), generator)
        self.conv_skip = MPConv(in_channels, out_channels, (1, 1), generator) if in_channels != out_channels else None
        self.attn_qkv = MPConv(out_channels, out_channels * 3, (1, 1), generator) if self.num_heads else None
        self.attn_proj = MPConv(out_channels, out_channels, (1, 1), generator) if self.num_heads else None

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        # EDM2's block with its constant factors moved into the gains of the convolutions they feed (a
        # convolution is linear, and its gain only scales the small weight tensor): mp_silu's 1/0.596 before
        # conv_res0 and conv_res1, and mp_sum's branch weights onto conv_res1 and attn_proj, leaving one
        # add-with-scale for each mp_sum. The same function with fewer passes over the activations.
        x = resample(x, self.resample_mode)
        if self.flavor == "enc":
            if self.conv_skip is not None:
                x = self.conv_skip(x)
            x = pixel_norm(x)

        y = self.conv_res0(F.silu(x), gain=1 / SILU_RMS)
        scale = self.emb_linear(emb, gain=self.emb_gain) + 1
        y = F.silu(y * scale[:, :, None, None].to(y.dtype))
        if self.training and self.dropout > 0:
            y = F.dropout(y, p=self.dropout)
        main_weight, branch_weight = mp_sum_weights(self.res_balance)
        y = self.conv_res1(y, gain=branch_weight / SILU_RMS)

        if self.flavor == "dec" and self.conv_skip is not None:
            x = self.conv_skip(x)
        x = torch.add(y, x, alpha=main_weight)

        if self.num_heads:
            main_weight, branch_weight = mp_sum_weights(self.attn_balance)
            x = torch.add(self._attention(x, branch_weight), x, alpha=main_weight)
        # hardtanh is clamp with a one-kernel backward (clamp's compares twice, then selects); the two
        # differ only in the gradient at exactly +-clip_act.
        return F.hardtanh(x, -self.clip_act, self.clip_act)

    def _attention(self, x: torch.Tensor, gain: float) -> torch.Tensor:
        """Cosine self-attention of x, its output projection scaled by `gain`."""
        batch, channels, height, width = x.shape
        head_channels = channels // self.num_heads
        qkv = self.attn_qkv(x).reshape(batch, self.num_heads, head_channels, 3, height * width)
        # (batch, heads, 3, pixels, head_channels) in memory: the normalisation below then reduces over
        # contiguous elements and the kernel gets contiguous q, k, v (a strided reduction costs several times more).
        qkv = qkv.permute(0, 1, 3, 4, 2).contiguous()
        # Cosine attention: unit-RMS q, k, v; the fused kernel's default 1/sqrt(head_channels) scale is EDM2's.
        q, k, v = normalize(qkv, dim=4).unbind(2)  # (batch, heads, pixels, head_channels)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.attn_proj(y.transpose(2, 3).reshape(batch, channels, height, width), gain=gain)


class UNet(nn.Module):
    """EDM2 UNet: F(x; c_noise, label), conditional when config.label_dim > 0."""

    # Layout of the activations; per-image gradients under torch.func.vmap need the default one.
    memory_format = MEMORY_FORMAT

    def __init__(self, config: GeneratorConfig, generator: torch.Generator,
                 label_balance: float = 0.5, concat_balance: float = 0.5):
        super().__init__()
        self.label_dim = config.label_dim
        self.label_balance = label_balance
        self.concat_balance = concat_balance
        level_channels = [config.model_channels * m for m in config.channel_mult]
        noise_channels = level_channels[0]
        emb_channels = max(level_channels)
        attn = set(config.attn_resolutions)

        self.emb_fourier = MPFourier(noise_channels, generator)
        self.emb_noise = MPConv(noise_channels, emb_channels, (), generator)
        self.emb_label = MPConv(config.label_dim, emb_channels, (), generator) if config.label_dim else None

        def block(cin: int, cout: int, flavor: str, mode: str, attention: bool) -> Block:
            return Block(cin, cout, emb_channels, flavor, mode, attention, config.dropout, generator)

        # Resampling blocks carry no attention: with it the 32 px preset would have 51.55 M
        # parameters instead of the 50.7 M that the FederatedFactory paper reports.
        self.enc = nn.ModuleDict()
        out_channels = config.img_channels + 1  # + the constant ones channel
        for level, channels in enumerate(level_channels):
            res = config.img_resolution >> level
            if level == 0:
                self.enc[f"{res}x{res}_conv"] = MPConv(out_channels, channels, (3, 3), generator)
                out_channels = channels
            else:
                self.enc[f"{res}x{res}_down"] = block(out_channels, out_channels, "enc", "down", False)
            for idx in range(config.num_blocks):
                self.enc[f"{res}x{res}_block{idx}"] = block(out_channels, channels, "enc", "keep", res in attn)
                out_channels = channels

        skip_channels = [module.out_channels for module in self.enc.values()]
        self.dec = nn.ModuleDict()
        deepest = len(level_channels) - 1
        for level, channels in reversed(list(enumerate(level_channels))):
            res = config.img_resolution >> level
            if level == deepest:
                # Only the first of the two entry blocks attends, whatever attn_resolutions says.
                self.dec[f"{res}x{res}_in0"] = block(out_channels, out_channels, "dec", "keep", True)
                self.dec[f"{res}x{res}_in1"] = block(out_channels, out_channels, "dec", "keep", False)
            else:
                self.dec[f"{res}x{res}_up"] = block(out_channels, out_channels, "dec", "up", False)
            for idx in range(config.num_blocks + 1):
                in_channels = out_channels + skip_channels.pop()
                self.dec[f"{res}x{res}_block{idx}"] = block(in_channels, channels, "dec", "keep", res in attn)
                out_channels = channels
        self.out_conv = MPConv(out_channels, config.img_channels, (3, 3), generator)
        self.out_gain = nn.Parameter(torch.zeros([]))

    def forward(self, x: torch.Tensor, noise_labels: torch.Tensor, class_onehot: torch.Tensor | None) -> torch.Tensor:
        emb = self.emb_noise(self.emb_fourier(noise_labels))
        if self.emb_label is not None:
            emb = mp_sum(emb, self.emb_label(class_onehot * math.sqrt(self.label_dim)), t=self.label_balance)
        emb = mp_silu(emb)

        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1).contiguous(memory_format=self.memory_format)
        skips = []
        for name, module in self.enc.items():
            x = module(x) if name.endswith("_conv") else module(x, emb)
            skips.append(x)
        for name, module in self.dec.items():
            if "_block" in name:
                x = mp_cat(x, skips.pop(), t=self.concat_balance)
            x = module(x, emb)
        return self.out_conv(x, gain=self.out_gain)


def preconditioning(sigma: torch.Tensor, sigma_data: float = SIGMA_DATA) -> dict[str, torch.Tensor]:
    """EDM coefficients c_skip, c_out, c_in, c_noise for noise level(s) sigma."""
    total = sigma**2 + sigma_data**2
    return {
        "c_skip": sigma_data**2 / total,
        "c_out": sigma * sigma_data / total.sqrt(),
        "c_in": 1 / total.sqrt(),
        "c_noise": sigma.log() / 4,
    }


class Precond(nn.Module):
    """Denoiser D(x; sigma, label) = c_skip x + c_out F(c_in x; c_noise, label), plus the logvar head.

    Class labels are int class ids (B,) for a conditional model (config.label_dim > 0), else None.
    """

    def __init__(self, config: GeneratorConfig):
        super().__init__()
        self.config = config
        generator = torch.Generator().manual_seed(config.seed)
        self.unet = UNet(config, generator)
        self.logvar_fourier = MPFourier(LOGVAR_CHANNELS, generator)
        self.logvar_linear = MPConv(LOGVAR_CHANNELS, 1, (), generator)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor | None = None,
                return_logvar: bool = False):
        x = x.to(torch.float32)
        sigma = sigma.to(torch.float32).reshape(-1, 1, 1, 1)
        coeffs = preconditioning(sigma)
        c_noise = coeffs["c_noise"].flatten()
        f_x = self.unet(coeffs["c_in"] * x, c_noise, self._onehot(labels, x.shape[0], x.device))
        denoised = coeffs["c_skip"] * x + coeffs["c_out"] * f_x.to(torch.float32)
        if not return_logvar:
            return denoised
        logvar = self.logvar_linear(self.logvar_fourier(c_noise)).reshape(-1, 1, 1, 1)
        return denoised, logvar

    def _onehot(self, labels: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor | None:
        label_dim = self.config.label_dim
        if label_dim == 0:
            if labels is not None:
                raise ValueError("this generator is unconditional (label_dim 0); pass labels=None")
            return None
        if labels is None:
            raise ValueError(f"this generator is conditional (label_dim {label_dim}); pass class ids")
        if labels.shape != (batch,):
            raise ValueError(f"labels must have shape ({batch},), got {tuple(labels.shape)}")
        # A comparison, not F.one_hot, whose range check DP-SGD's vmap cannot run (callers validate the ids).
        classes = torch.arange(label_dim, device=device)
        return (labels.to(device=device, dtype=torch.long)[:, None] == classes).to(torch.float32)


def build_generator(config: GeneratorConfig, device: torch.device | str | None = None) -> Precond:
    """A freshly initialised generator, seeded by config.seed; device 'meta' allocates nothing.

    Weights are drawn on the CPU and then moved, so every device gets the same initial weights.
    """
    device = torch.device(device or "cpu")
    if device.type == "meta":
        with device:
            return Precond(config)
    return Precond(config).to(device)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Loss, schedule, EMA
# --------------------------------------------------------------------------------------------


def training_noise(images: torch.Tensor, P_mean: float, P_std: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's noise level sigma (B, 1, 1, 1), log-normal, and its noise (the images' shape) scaled by it."""
    draw = torch.randn((images.shape[0], 1, 1, 1), generator=generator, device=images.device)
    sigma = (draw * P_std + P_mean).exp()
    return sigma, torch.randn(images.shape, generator=generator, device=images.device) * sigma


def elementwise_loss(net: Callable, images: torch.Tensor, labels: torch.Tensor | None,
                     sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Uncertainty-weighted EDM2 loss of every element of images in [-1, 1] noised by `training_noise`;
    `net` is the denoiser (or a functional call of it: DP-SGD takes per-image gradients through this)."""
    weight = (sigma**2 + SIGMA_DATA**2) / (sigma * SIGMA_DATA) ** 2
    denoised, logvar = net(images + noise, sigma, labels, return_logvar=True)
    # Under bf16 autocast the network's outputs may be bf16; the loss itself is summed in float32.
    denoised, logvar = denoised.to(torch.float32), logvar.to(torch.float32)
    return weight / logvar.exp() * (denoised - images) ** 2 + logvar


def edm2_loss(net: Precond, images: torch.Tensor, labels: torch.Tensor | None,
              P_mean: float, P_std: float, generator: torch.Generator) -> torch.Tensor:
    """Uncertainty-weighted EDM2 loss on images in [-1, 1]: summed over elements, averaged over the batch."""
    sigma, noise = training_noise(images, P_mean, P_std, generator)
    return elementwise_loss(net, images, labels, sigma, noise).sum() / images.shape[0]


def learning_rate(images_seen: int, ref_lr: float, t_ref: int, t_rampup: int) -> float:
    """Inverse-square-root decay after t_ref images, linear ramp-up over the first t_rampup images."""
    lr = ref_lr / math.sqrt(max(images_seen / t_ref, 1.0))
    if t_rampup > 0:
        lr *= min(images_seen / t_rampup, 1.0)
    return lr


def ema_gamma(sigma_rel: float) -> float:
    """Power-function EMA exponent: largest real root of g^3 + 7g^2 + (16 - s^-2) g + (12 - s^-2)."""
    inv_sq = sigma_rel**-2
    roots = np.roots([1.0, 7.0, 16.0 - inv_sq, 12.0 - inv_sq])
    real = roots.real[np.abs(roots.imag) < 1e-9]
    return float(real.max())


class PowerFunctionEMA:
    """EMA whose averaging window grows with training length (beta = (1 - batch / t)^(gamma + 1))."""

    def __init__(self, net: nn.Module, sigma_rel: float):
        self.gamma = ema_gamma(sigma_rel)
        self.model = copy.deepcopy(net).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, net: nn.Module, images_seen: int, batch_size: int) -> None:
        beta = (1 - batch_size / images_seen) ** (self.gamma + 1)
        for ema_tensor, net_tensor in zip(self.model.state_dict().values(), net.state_dict().values()):
            ema_tensor.lerp_(net_tensor.detach().to(ema_tensor.dtype), 1 - beta)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainStats:
    loss_curve: list[float]
    images_seen: int
    steps: int
    wall_time_s: float
    images_per_s: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


ProgressFn = Callable[[int, int, float], None]


class PrivateGradients(Protocol):
    """DP-SGD in place of the ordinary step (fedskew.factory.dp_sgd): which images each step sees, and the
    step's gradients (set on the parameters; the batch's mean loss returned)."""

    def batches(self, n: int) -> Iterator[np.ndarray]: ...

    def gradients(self, net: Precond, images: torch.Tensor, labels: torch.Tensor | None, config: GeneratorConfig,
                  generator: torch.Generator) -> torch.Tensor: ...


def print_progress(step: int, total: int, loss: float) -> None:
    """Default progress: one line at every ~10% of the run."""
    if step == total or step % max(total // 10, 1) == 0:
        print(f"edm2 step {step}/{total} ({100 * step / total:.0f}%) loss {loss:.4f}", flush=True)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _validate_training_data(images: np.ndarray, labels: np.ndarray | None, config: GeneratorConfig) -> None:
    expected = (config.img_channels, config.img_resolution, config.img_resolution)
    if not isinstance(images, np.ndarray) or images.dtype not in (np.float32, np.uint8) or images.ndim != 4:
        raise ValueError(
            f"images must be a float32 (values in [0, 1]) or uint8 (0-255) numpy array (N, C, H, W), got "
            f"{type(images).__name__} {getattr(images, 'dtype', None)} {getattr(images, 'shape', None)}"
        )
    if images.shape[0] == 0 or images.shape[1:] != expected:
        channels, height, width = expected
        raise ValueError(f"images must have shape (N>0, {channels}, {height}, {width}), got {images.shape}")
    if images.dtype == np.float32 and (not np.isfinite(images).all() or images.min() < 0 or images.max() > 1):
        raise ValueError(f"float32 image values must be finite and in [0, 1], got range [{images.min()}, {images.max()}]")
    if config.label_dim == 0:
        if labels is not None:
            raise ValueError("config.label_dim is 0 (unconditional); pass labels=None")
        return
    if labels is None:
        raise ValueError(f"config.label_dim is {config.label_dim} (conditional); pass int class ids")
    _validate_class_ids(np.asarray(labels), images.shape[0], config.label_dim)


def _validate_class_ids(labels: np.ndarray, n: int, label_dim: int) -> None:
    if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be {n} int class ids, got dtype {labels.dtype} shape {labels.shape}")
    if labels.min() < 0 or labels.max() >= label_dim:
        raise ValueError(f"labels must lie in [0, {label_dim}), got range [{labels.min()}, {labels.max()}]")


def _index_stream(n: int, batch_size: int, rng: np.random.Generator):
    """Batches of indices from back-to-back shuffled epochs (works even when n < batch_size)."""
    pending = np.empty(0, dtype=np.int64)
    while True:
        while pending.size < batch_size:
            pending = np.concatenate([pending, rng.permutation(n)])
        yield pending[:batch_size]
        pending = pending[batch_size:]


def augment(images: torch.Tensor, flip: bool, rot90: bool, rng: np.random.Generator) -> torch.Tensor:
    """Per-image random horizontal flip and/or rotation by a multiple of 90 degrees."""
    if flip:
        mask = torch.as_tensor(rng.random(images.shape[0]) < 0.5, device=images.device)
        images = torch.where(mask[:, None, None, None], images.flip(3), images)
    if rot90:
        turns = torch.as_tensor(rng.integers(0, 4, images.shape[0]), device=images.device)
        rotated = images.clone()
        for k in (1, 2, 3):
            chosen = turns == k
            rotated[chosen] = torch.rot90(images[chosen], k, dims=(2, 3))
        images = rotated
    return images


PRECISIONS = ("auto", "fp32", "bf16")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 for 'bf16', and for 'auto' on CUDA (the weights, optimiser state, EMA and loss stay fp32);
    None (plain fp32) otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def train_generator(
    images: np.ndarray,
    labels: np.ndarray | None,
    config: GeneratorConfig,
    progress: ProgressFn | None = print_progress,
    device: torch.device | None = None,
    precision: str = "auto",
    private: PrivateGradients | None = None,
) -> tuple[Precond, TrainStats]:
    """Train an EDM2 generator from scratch; returns the EMA model (eval mode) and training stats.

    images: (N, C, H, W), float32 in [0, 1] or uint8 0-255 (kept so on the device, scaled per batch).
    labels: int class ids (N,) for a conditional config, None for an unconditional one
    (FederatedFactory trains one unconditional model per class).
    progress(step, total, loss) is called after every step; None silences it. precision: the
    forward and backward passes under bf16 autocast ('bf16'; 'auto' = bf16 on CUDA) or in fp32.
    private: DP-SGD's batches and gradients (always fp32) instead of shuffled epochs and backprop; the
    schedule, forced weight normalisation (in the forward pass), Adam and the EMA stay as they are.
    """
    _validate_training_data(images, labels, config)
    device = torch.device(device) if device is not None else default_device()
    mixed = autocast_dtype(precision, device)
    rng = np.random.default_rng(config.seed)
    torch_rng = torch.Generator(device=device).manual_seed(config.seed)
    # The class stays in its storage type on the device (uint8: a quarter of float32's memory); each
    # batch is scaled to the network's [-1, 1] when it is drawn.
    data = torch.from_numpy(images).to(device)
    class_ids = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(device) if labels is not None else None

    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        # Dropout draws from torch's global RNG; seed it without disturbing the caller's state.
        torch.manual_seed(config.seed)
        net = build_generator(config, device).train()
        ema = PowerFunctionEMA(net, config.sigma_rel)
        # The fused kernel updates every tensor in one pass (about a third of the per-tensor loop's time on the CPU).
        optimizer = torch.optim.Adam(net.parameters(), lr=config.ref_lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                     fused=device.type in ("cpu", "cuda"))
        batches = _index_stream(images.shape[0], config.batch_size, rng) if private is None else private.batches(images.shape[0])
        total = config.total_steps
        losses: list[float] = []
        images_seen = 0
        start = time.perf_counter()
        for step in range(1, total + 1):
            index = torch.from_numpy(next(batches)).to(device)
            batch = augment(unit_float(data[index]) * 2 - 1, config.augment_flip, config.augment_rot90, rng)
            batch_labels = class_ids[index] if class_ids is not None else None
            if private is None:
                with torch.autocast(device.type, dtype=mixed or torch.float32, enabled=mixed is not None):
                    loss = edm2_loss(net, batch, batch_labels, config.P_mean, config.P_std, torch_rng)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            else:
                loss = private.gradients(net, batch, batch_labels, config, torch_rng)
            for param in net.parameters():
                if param.grad is not None:
                    torch.nan_to_num(param.grad, nan=0.0, posinf=0.0, neginf=0.0, out=param.grad)
            images_seen += config.batch_size
            # Count the current batch so the first step does not run at lr 0.
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(images_seen, config.ref_lr, config.t_ref, config.t_rampup)
            optimizer.step()
            ema.update(net, images_seen, config.batch_size)
            losses.append(loss.item())
            if progress is not None:
                progress(step, total, losses[-1])
        wall = time.perf_counter() - start
    stats = TrainStats(
        loss_curve=losses,
        images_seen=images_seen,
        steps=total,
        wall_time_s=wall,
        images_per_s=images_seen / wall,
    )
    return ema.model, stats


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Guidance:
    """D = net_g(x) + weight * (net(x) - net_g(x)); net_g unconditional (CFG) or smaller (autoguidance)."""

    net: Precond
    weight: float


def sigma_steps(steps: int, sigma_min: float = SAMPLER_SIGMA_MIN, sigma_max: float = SAMPLER_SIGMA_MAX,
                rho: float = SAMPLER_RHO) -> torch.Tensor:
    """EDM noise levels: `steps` values from sigma_max to sigma_min (rho spacing), then a final 0 (float64)."""
    if not _is_int(steps) or steps < 2:
        raise ValueError(f"steps must be an int >= 2, got {steps!r}")
    i = torch.arange(steps, dtype=torch.float64)
    inv_rho = 1 / rho
    sigmas = (sigma_max**inv_rho + i / (steps - 1) * (sigma_min**inv_rho - sigma_max**inv_rho)) ** rho
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float64)])


def heun_sample(net: Precond, noise: torch.Tensor, labels: torch.Tensor | None, steps: int,
                guidance: Guidance | None = None) -> torch.Tensor:
    """Deterministic 2nd-order Heun from unit noise; 2 * steps - 1 denoiser evaluations. Returns [-1, 1]-range x."""
    # The ODE state is kept in float64 where the device has it (MPS does not).
    state_dtype = torch.float32 if noise.device.type == "mps" else torch.float64
    sigmas = sigma_steps(steps).to(noise.device, state_dtype)

    def denoise(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        sigma_batch = sigma.to(torch.float32).expand(x.shape[0])
        d = net(x, sigma_batch, labels).to(state_dtype)
        if guidance is not None:
            guide_labels = labels if guidance.net.config.label_dim else None
            g = guidance.net(x, sigma_batch, guide_labels).to(state_dtype)
            d = g + guidance.weight * (d - g)
        return d

    x_next = noise.to(state_dtype) * sigmas[0]
    for i in range(steps):
        t_cur, t_next = sigmas[i], sigmas[i + 1]
        x_cur = x_next
        slope = (x_cur - denoise(x_cur, t_cur)) / t_cur
        x_next = x_cur + (t_next - t_cur) * slope
        if i < steps - 1:
            slope_next = (x_next - denoise(x_next, t_next)) / t_next
            x_next = x_cur + (t_next - t_cur) * (0.5 * slope + 0.5 * slope_next)
    return x_next


def _sample_labels(labels, n: int, label_dim: int) -> torch.Tensor | None:
    if label_dim == 0:
        if labels is not None:
            raise ValueError("the model is unconditional (label_dim 0); pass labels=None")
        return None
    if labels is None:
        raise ValueError(f"the model is conditional (label_dim {label_dim}); pass a class id or n class ids")
    ids = np.full(n, labels, dtype=np.int64) if np.isscalar(labels) else np.asarray(labels)
    _validate_class_ids(ids, n, label_dim)
    return torch.from_numpy(ids.astype(np.int64))


@torch.no_grad()
def sample(
    model: Precond,
    n: int,
    labels: int | np.ndarray | None = None,
    steps: int = 32,
    seed: int = 0,
    batch_size: int = 256,
    device: torch.device | None = None,
    guidance: Guidance | None = None,
) -> np.ndarray:
    """n images, float32 (n, C, H, W) in [0, 1], from the deterministic Heun sampler.

    The noise for all n images is drawn up front from `seed`, so the output does not depend on
    batch_size. The model (and guidance net) are moved to `device` (default: where the model is)
    and put in eval mode, in place.
    """
    if not _is_int(n) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    config = model.config
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(device).eval()
    if guidance is not None:
        guidance.net.to(device).eval()
    class_ids = _sample_labels(labels, n, config.label_dim)
    shape = (n, config.img_channels, config.img_resolution, config.img_resolution)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    out = np.empty(shape, dtype=np.float32)
    for start in range(0, n, batch_size):
        stop = min(start + batch_size, n)
        batch_labels = class_ids[start:stop].to(device) if class_ids is not None else None
        x = heun_sample(model, noise[start:stop].to(device), batch_labels, steps, guidance)
        # The sampler can overshoot [-1, 1] slightly; images are defined on [0, 1].
        out[start:stop] = ((x + 1) / 2).clamp(0, 1).to(torch.float32).cpu().numpy()
    return out
