"""Drawing images from an EDM2 generator: EDM's deterministic second-order Heun sampler, optionally guided.

Equations are those of EDM (Karras et al., NeurIPS 2022, "Elucidating the Design Space of Diffusion-Based
Generative Models"). Samples leave as float32 numpy arrays (n, C, H, W) in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedskew.models.edm2.config import check_class_ids, check_conditioning, is_int
from fedskew.models.edm2.network import Precond

SAMPLER_SIGMA_MIN = 0.002
SAMPLER_SIGMA_MAX = 80.0
SAMPLER_RHO = 7.0


@dataclass(frozen=True)
class Guidance:
    """D = net_g(x) + weight * (net(x) - net_g(x)); net_g unconditional (classifier-free guidance) or a smaller,
    less trained model of the same data (autoguidance: Karras et al. 2024, "Guiding a Diffusion Model with a
    Bad Version of Itself")."""

    net: Precond
    weight: float


def sigma_steps(steps: int, sigma_min: float = SAMPLER_SIGMA_MIN, sigma_max: float = SAMPLER_SIGMA_MAX,
                rho: float = SAMPLER_RHO) -> torch.Tensor:
    """EDM noise levels: `steps` values from sigma_max to sigma_min,
    (sigma_max^(1/rho) + i / (steps - 1) (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho, then a final 0 (EDM Eq. 5),
    in float64."""
    if not is_int(steps) or steps < 2:
        raise ValueError(f"steps must be an int >= 2, got {steps!r}")
    i = torch.arange(steps, dtype=torch.float64)
    inv_rho = 1 / rho
    sigmas = (sigma_max**inv_rho + i / (steps - 1) * (sigma_min**inv_rho - sigma_max**inv_rho)) ** rho
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float64)])


def heun_sample(net: Precond, noise: torch.Tensor, labels: torch.Tensor | None, steps: int,
                guidance: Guidance | None = None) -> torch.Tensor:
    """EDM's deterministic sampler (EDM Algorithm 1): the probability-flow ODE dx/dsigma = (x - D(x; sigma)) / sigma
    integrated from unit noise by Euler steps, each but the last corrected by Heun's second-order rule;
    2 * steps - 1 denoiser evaluations. Returns [-1, 1]-range x."""
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
    check_conditioning(labels is not None, label_dim)
    if labels is None:
        return None
    ids = np.full(n, labels, dtype=np.int64) if np.isscalar(labels) else np.asarray(labels)
    check_class_ids(ids, n, label_dim)
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
    if not is_int(n) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not is_int(batch_size) or batch_size < 1:
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

