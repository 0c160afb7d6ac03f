"""Differentially private generators for FederatedFactory (run-config keys `factory.dp-*`): DP-SGD
(Abadi et al. 2016) inside a site's EDM2 training, and the guarantee of each generator.

Every step draws a Poisson sample of the class's images (each image independently with probability
q = batch / images), takes every sampled image's gradient on its own (torch.func: functional_call +
grad + vmap, in chunks that bound memory), clips each to L2 norm `dp-clipping-norm` over all
parameters, sums them, adds Gaussian noise of std noise-multiplier x clipping-norm and divides by the
expected batch q x images. Adam, the learning-rate schedule, EDM2's forced weight normalisation (in
the forward pass, so each gradient is taken at normalised weights) and the EMA are the ordinary
step's: they only post-process the noised gradients. The steps, q and the multiplier are fixed by the
run config and the class size before training, so the guarantee is known (and checked against
`factory.max-epsilon`) before any image is touched: `steps` Poisson-subsampled Gaussian mechanisms,
composed in dp-accounting's RDP accountant (fedskew.accountant.epsilon_of). Unit of privacy: one
training image (add or remove). The sampling and the noise draw from OS entropy, never from the run's
seed, which the server knows: a known noise or batch sequence voids the guarantee.
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from torch.func import functional_call, grad_and_value, vmap

from fedskew.accountant import epsilon_of
from fedskew.config import FactorySection
from fedskew.models.edm2 import GeneratorConfig, Precond, elementwise_loss, training_noise

ACCOUNTANT = "dp-accounting RDP, Poisson-subsampled Gaussian"
# Per-image gradients are taken in chunks holding at most this many gradient values (256 MiB in fp32).
CHUNK_GRADIENT_VALUES = 1 << 26
# Added to a gradient's norm before dividing by it (as Opacus does): a zero gradient stays zero.
NORM_EPS = 1e-6


def sample_rate(batch_size: int, n_images: int) -> float:
    """Poisson sampling probability of each image: the expected batch is the generator's batch size."""
    return min(1.0, batch_size / n_images)


@functools.lru_cache(maxsize=1024)  # the server and every site derive it for every module they check
def generator_epsilon(noise_multiplier: float, rate: float, steps: int, delta: float) -> float:
    """Epsilon at `delta` of `steps` DP-SGD steps with Poisson sampling at `rate`."""
    event = SelfComposedDpEvent(PoissonSampledDpEvent(rate, GaussianDpEvent(noise_multiplier)), steps)
    return epsilon_of([event], delta)


def generator_privacy(factory: FactorySection, config: GeneratorConfig, n_images: int) -> dict | None:
    """The guarantee of a generator of `n_images` trained with `config` under the run's factory.dp-* keys
    (its manifest entry); None when DP is off. The server derives the same from the site's survey."""
    if factory.dp_noise_multiplier == 0:
        return None
    rate = sample_rate(config.batch_size, n_images)
    delta = factory.dp_delta or 1.0 / n_images
    return {
        "epsilon": generator_epsilon(factory.dp_noise_multiplier, rate, config.total_steps, delta),
        "delta": delta,
        "noise-multiplier": factory.dp_noise_multiplier,
        "clipping-norm": factory.dp_clipping_norm,
        "sample-rate": rate,
        "steps": config.total_steps,
        "accountant": ACCOUNTANT,
        "unit": "one training image",
    }


@contextmanager
def _vmappable(net: Precond):
    """vmap cannot keep the UNet's channels-last activations; the default layout while it runs."""
    net.unet.memory_format = torch.contiguous_format
    try:
        yield
    finally:
        del net.unet.memory_format


def per_image_gradients(
    net: Precond, images: torch.Tensor, labels: torch.Tensor | None, sigma: torch.Tensor, noise: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each image's gradient of its own EDM2 loss (parameter name -> (B, *shape)) and the losses (B,),
    at the network's current weights, in its current mode (training: forced weight normalisation)."""
    params = {name: p.detach() for name, p in net.named_parameters()}
    buffers = dict(net.named_buffers())

    def loss_of_one(weights, image, label, image_sigma, image_noise):
        def denoiser(*args, **kwargs):
            return functional_call(net, (weights, buffers), args, kwargs)

        one_label = None if label is None else label[None]
        return elementwise_loss(denoiser, image[None], one_label, image_sigma[None], image_noise[None]).sum()

    label_dim = None if labels is None else 0
    per_image = vmap(grad_and_value(loss_of_one), in_dims=(None, 0, label_dim, 0, 0), randomness="different")
    with _vmappable(net):
        return per_image(params, images, labels, sigma, noise)


def clipped_sum(grads: dict[str, torch.Tensor], clipping_norm: float) -> dict[str, torch.Tensor]:
    """The sum over images of each image's gradient scaled to L2 norm (over all parameters) at most
    `clipping_norm`; non-finite entries count as 0, as in the ordinary step."""
    grads = {name: torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for name, g in grads.items()}
    norms = torch.sqrt(sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values()))
    scale = (clipping_norm / (norms + NORM_EPS)).clamp(max=1.0)
    return {name: torch.einsum("b,b...->...", scale, g) for name, g in grads.items()}


class DpSgd:
    """DP-SGD's batches and gradients for one generator (edm2.train_generator's `private`)."""

    def __init__(self, noise_multiplier: float, clipping_norm: float, batch_size: int, n_images: int,
                 secret_seed: int | None = None):  # fmt: skip
        if noise_multiplier < 0 or not clipping_norm > 0:
            raise ValueError(f"DP-SGD needs noise multiplier >= 0 and clipping norm > 0, got {noise_multiplier}, {clipping_norm}")
        self.noise_multiplier, self.clipping_norm, self.n_images = noise_multiplier, clipping_norm, n_images
        self.rate = sample_rate(batch_size, n_images)
        self.expected_batch = self.rate * n_images
        # Only tests pass a seed (to repeat a step); a run draws the sampling and the noise from OS entropy.
        seed = secrets.randbits(63) if secret_seed is None else secret_seed
        sampling_seed, self._noise_seed = np.random.SeedSequence(seed).generate_state(2, np.uint64) >> np.uint64(1)
        self._sampling = np.random.default_rng(int(sampling_seed))
        self._noise: torch.Generator | None = None

    def batches(self, n: int) -> Iterator[np.ndarray]:
        """Poisson sampling: every image joins each step's batch with probability `rate`."""
        if n != self.n_images:
            raise ValueError(f"DP-SGD was accounted for {self.n_images} images, got {n}")
        while True:
            yield np.flatnonzero(self._sampling.random(n) < self.rate)

    def gradients(self, net: Precond, images: torch.Tensor, labels: torch.Tensor | None, config: GeneratorConfig,
                  generator: torch.Generator) -> torch.Tensor:  # fmt: skip
        """Sets each parameter's .grad to the noised mean of the clipped per-image gradients; returns the
        batch's mean loss (NaN for an empty batch; it stays at the site)."""
        sigma, noise = training_noise(images, config.P_mean, config.P_std, generator)
        params = dict(net.named_parameters())
        total = {name: torch.zeros_like(p) for name, p in params.items()}
        chunk = max(1, CHUNK_GRADIENT_VALUES // sum(p.numel() for p in params.values()))
        losses = []
        for start in range(0, images.shape[0], chunk):
            part = slice(start, start + chunk)
            grads, loss = per_image_gradients(net, images[part], None if labels is None else labels[part], sigma[part], noise[part])
            for name, g in clipped_sum(grads, self.clipping_norm).items():
                total[name] += g
            losses.append(loss.detach())
        for name, p in params.items():
            if self.noise_multiplier > 0:
                total[name] += torch.randn(p.shape, generator=self._noise_generator(p.device), device=p.device) * (
                    self.noise_multiplier * self.clipping_norm
                )
            p.grad = total[name] / self.expected_batch
        return torch.cat(losses).mean() if losses else torch.tensor(math.nan)

    def _noise_generator(self, device: torch.device) -> torch.Generator:
        if self._noise is None:
            self._noise = torch.Generator(device=device).manual_seed(int(self._noise_seed))
        return self._noise
