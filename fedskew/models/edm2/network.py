"""The EDM2 network and its preconditioning: magnitude-preserving (MP) primitives, the UNet with cosine
attention, and the denoiser D(x; sigma) with its uncertainty (logvar) head.

Equations are those of EDM2 (Karras et al., CVPR 2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models", arXiv:2312.02696 with its appendix) and EDM (Karras et al., NeurIPS 2022, "Elucidating
the Design Space of Diffusion-Based Generative Models"). The network works on images in [-1, 1], the range
sigma_data = 0.5 is stated for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedskew.models.edm2.config import GeneratorConfig, attention_heads, check_conditioning

SIGMA_DATA = 0.5
LOGVAR_CHANNELS = 128
# Channels-last: the CPU (oneDNN) and GPU convolution kernels are faster in it; every layer keeps it.
MEMORY_FORMAT = torch.channels_last


# --------------------------------------------------------------------------------------------
# Magnitude-preserving primitives
# --------------------------------------------------------------------------------------------


def normalize(x: torch.Tensor, dim: int | Sequence[int] | None = None, eps: float = 1e-4) -> torch.Tensor:
    """Scale every slice along `dim` (default: all but the first axis) to unit RMS: x / (eps + ||x|| /
    sqrt(numel)), the normalisation behind EDM2's magnitude-preserving layers (Eq. 47, Eq. 66)."""
    if dim is None:
        dim = list(range(1, x.ndim))
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float32)
    slice_numel = norm.numel() / x.numel()
    norm = eps + norm * math.sqrt(slice_numel)
    # One reciprocal of the (small) norm tensor and a product: a division over every element costs about
    # twice as much on the CPU, forward and backward.
    return x * norm.reciprocal().to(x.dtype)


def pixel_norm(x: torch.Tensor) -> torch.Tensor:
    """Unit RMS across channels at every pixel (EDM2's pixel normalisation, which replaces group norm)."""
    return normalize(x, dim=1)


# The RMS of silu(z) for z ~ N(0, 1).
SILU_RMS = 0.596


def mp_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU scaled back to unit magnitude (EDM2 Eq. 81)."""
    return F.silu(x) * (1 / SILU_RMS)


def mp_sum_weights(t: float) -> tuple[float, float]:
    """The weights of a and b in mp_sum(a, b, t): (1 - t) and t, scaled to keep unit magnitude (EDM2 Eq. 88)."""
    scale = math.sqrt((1 - t) ** 2 + t**2)
    return (1 - t) / scale, t / scale


def mp_sum(a: torch.Tensor, b: torch.Tensor, t: float = 0.5) -> torch.Tensor:
    """lerp(a, b, t) / sqrt((1 - t)^2 + t^2): a weighted sum of unit-magnitude inputs of unit magnitude (EDM2 Eq. 88)."""
    weight_a, weight_b = mp_sum_weights(t)
    return torch.add(b * weight_b, a, alpha=weight_a)


def mp_cat(a: torch.Tensor, b: torch.Tensor, t: float = 0.5, dim: int = 1) -> torch.Tensor:
    """Concatenation along `dim` with a and b weighted (1 - t) and t per channel, of unit magnitude overall
    (EDM2 Eq. 103)."""
    channels_a, channels_b = a.shape[dim], b.shape[dim]
    scale = math.sqrt((channels_a + channels_b) / ((1 - t) ** 2 + t**2))
    wa = scale / math.sqrt(channels_a) * (1 - t)
    wb = scale / math.sqrt(channels_b) * t
    return torch.cat([wa * a, wb * b], dim=dim)


def resample(x: torch.Tensor, mode: str) -> torch.Tensor:
    """'keep', 'down' (2x2 box average, stride 2) or 'up' (nearest neighbour x2), EDM2's resampling."""
    if mode == "keep":
        return x
    if mode == "down":
        return F.avg_pool2d(x, kernel_size=2, stride=2)
    if mode == "up":
        return F.interpolate(x, scale_factor=2, mode="nearest")
    raise ValueError(f"resample mode must be 'keep', 'down' or 'up', got {mode!r}")


class MPFourier(nn.Module):
    """Random Fourier features of a scalar, sqrt(2) cos(2 pi (f x + p)) with fixed (seeded) frequencies f ~ N(0, 1)
    and phases p ~ U(0, 1): unit magnitude (EDM2 Eq. 75)."""

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
    """Weight-normalised convolution without bias (EDM2 Eq. 47), its stored weights normalised in every training
    forward pass (forced weight normalisation, EDM2 Eq. 66); kernel () makes it a linear layer."""

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
# Network and preconditioning
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    """UNet block (EDM2 Fig. 21); 'enc' flavour normalises its input, 'dec' flavour skips with a 1x1 conv after
    the residual."""

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
        """Cosine self-attention of x (EDM2: q, k and v normalised per head before the dot product), its output
        projection scaled by `gain`."""
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
    """EDM2 UNet (EDM2 Fig. 21): F(x; c_noise, label), conditional when config.label_dim > 0."""

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
    """EDM's preconditioning coefficients c_skip, c_out, c_in, c_noise for noise level(s) sigma (EDM Table 1)."""
    total = sigma**2 + sigma_data**2
    return {
        "c_skip": sigma_data**2 / total,
        "c_out": sigma * sigma_data / total.sqrt(),
        "c_in": 1 / total.sqrt(),
        "c_noise": sigma.log() / 4,
    }


class Precond(nn.Module):
    """Denoiser D(x; sigma, label) = c_skip x + c_out F(c_in x; c_noise, label) (EDM Eq. 7), plus the logvar head
    u(sigma), a linear layer of Fourier features of c_noise, that weights the loss (training.elementwise_loss).

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
        check_conditioning(labels is not None, label_dim)
        if labels is None:
            return None
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

