"""Training an EDM2 generator: the uncertainty-weighted loss, the learning-rate schedule, the power-function
EMA and the training loop (optionally with DP-SGD's gradients, fedskew.factory.dp_sgd).

Equations are those of EDM2 (Karras et al., CVPR 2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models", arXiv:2312.02696 with its appendix) and EDM (Karras et al., NeurIPS 2022, "Elucidating
the Design Space of Diffusion-Based Generative Models"). Training images enter as numpy arrays
(N, C, H, W), float32 in [0, 1] or uint8 0-255 (fedskew.data.pixels); the network sees them in [-1, 1].
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from fedskew.data.pixels import unit_float
from fedskew.models.edm2.config import GeneratorConfig, check_class_ids
from fedskew.models.edm2.network import SIGMA_DATA, Precond, build_generator

ADAM_BETAS = (0.9, 0.99)
ADAM_EPS = 1e-8


# --------------------------------------------------------------------------------------------
# Loss, schedule, EMA
# --------------------------------------------------------------------------------------------


def training_noise(images: torch.Tensor, P_mean: float, P_std: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's noise level sigma (B, 1, 1, 1), log-normal: ln(sigma) ~ N(P_mean, P_std^2) (EDM Table 1), and
    its noise (the images' shape) scaled by it."""
    draw = torch.randn((images.shape[0], 1, 1, 1), generator=generator, device=images.device)
    sigma = (draw * P_std + P_mean).exp()
    return sigma, torch.randn(images.shape, generator=generator, device=images.device) * sigma


def elementwise_loss(net: Callable, images: torch.Tensor, labels: torch.Tensor | None,
                     sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Uncertainty-weighted EDM2 loss of every element of images in [-1, 1] noised by `training_noise`:
    lambda(sigma) / exp(u(sigma)) (D(y + n; sigma) - y)^2 + u(sigma), with u the denoiser's logvar head (EDM2
    Eqs. 14-16, 21). `net` is the denoiser (or a functional call of it: DP-SGD takes per-image gradients
    through this)."""
    # EDM's loss weight lambda(sigma) = 1 / c_out(sigma)^2 (EDM Table 1): the network's own output error gets
    # unit weight at every noise level.
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
    """Inverse-square-root decay after t_ref images, ref_lr / sqrt(max(t / t_ref, 1)) (EDM2 Eq. 67), times a
    linear ramp-up over the first t_rampup images."""
    lr = ref_lr / math.sqrt(max(images_seen / t_ref, 1.0))
    if t_rampup > 0:
        lr *= min(images_seen / t_rampup, 1.0)
    return lr


def ema_gamma(sigma_rel: float) -> float:
    """Power-function EMA exponent gamma of relative width sigma_rel: the largest real root of
    g^3 + 7g^2 + (16 - s^-2) g + (12 - s^-2), which inverts s = sqrt((g + 1) / ((g + 2)^2 (g + 3))) (EDM2 Eq. 123,
    solved as in Eq. 126 and Algorithm 2)."""
    inv_sq = sigma_rel**-2
    roots = np.roots([1.0, 7.0, 16.0 - inv_sq, 12.0 - inv_sq])
    real = roots.real[np.abs(roots.imag) < 1e-9]
    return float(real.max())


class PowerFunctionEMA:
    """EMA whose averaging window grows with training length: after each step,
    ema = beta ema + (1 - beta) net with beta = (1 - batch / t)^(gamma + 1), t = images seen (EDM2 Eq. 127)."""

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
    check_class_ids(np.asarray(labels), images.shape[0], config.label_dim)


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

