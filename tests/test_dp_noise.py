"""The DP noise measured from both sides: DP-SGD's (FederatedFactory's generators) and central DP's
(Flower's wrapper as the app builds it). Each test compares the noised release with the same release
without noise and checks the spread of the difference against the std the guarantee is accounted for:
too little noise voids the guarantee, too much wastes accuracy while reporting the wrong epsilon.

The statistic: for D independent N(0, s^2) coordinates, mean(x^2) / s^2 is chi-square(D) / D, of mean 1
and standard deviation sqrt(2 / D); the mean of x has standard deviation s / sqrt(D). Both are held within
Z_BOUND standard deviations (a false alarm once in ~1.7 million runs), which at the D used here refuses a
noise std off by a few percent, and so a missing (ratio 0) or doubled (ratio 4) noise by far."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from test_privacy import _server_round, flower_identity  # noqa: F401 (a fixture)

from fedskew.config import RunConfig
from fedskew.factory.dp_sgd import DpSgd
from fedskew.models.edm2 import CPU_PRESET, build_generator

Z_BOUND = 5.0


def assert_gaussian_noise(noise: np.ndarray, std: float) -> None:
    """`noise` (D values) is zero-mean with per-coordinate std `std`, within Z_BOUND sds of both statistics."""
    noise = np.asarray(noise, dtype=np.float64).ravel()
    d = noise.size
    variance_ratio = float(np.mean(noise**2)) / std**2
    assert abs(variance_ratio - 1) <= Z_BOUND * math.sqrt(2 / d), (
        f"noise variance is {variance_ratio:.4f} x the accounted std^2 over {d} coordinates "
        f"(allowed 1 +- {Z_BOUND * math.sqrt(2 / d):.4f})"
    )
    assert abs(noise.mean()) <= Z_BOUND * std / math.sqrt(d), f"noise mean {noise.mean():.3g} with std {std:.3g}"


# A generator of ~45,000 parameters: enough coordinates to measure the std within 3.3% (5 sd).
TINY = dataclasses.replace(CPU_PRESET, model_channels=8, num_blocks=1, batch_size=4, total_images=8, t_ref=8, t_rampup=0)


def _dp_sgd_gradient(net, images, noise_multiplier: float, clipping_norm: float) -> torch.Tensor:
    """The flattened gradient DP-SGD sets for `images`, the training noise (sigma, n) drawn alike every call."""
    net.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    dp = DpSgd(noise_multiplier, clipping_norm, TINY.batch_size, n_images=8, secret_seed=1)  # rate 1/2: expected batch 4
    dp.gradients(net, images, None, TINY, torch.Generator().manual_seed(2))
    return torch.cat([p.grad.flatten() for p in net.parameters()]).double()


def test_dp_sgd_adds_noise_of_multiplier_times_clipping_norm_over_the_expected_batch():
    net = build_generator(TINY).train()
    images = torch.rand((5, 1, 8, 8), generator=torch.Generator().manual_seed(0)) * 2 - 1  # a Poisson batch of 5
    z, clip = 1.5, 0.5
    noised, clipped = _dp_sgd_gradient(net, images, z, clip), _dp_sgd_gradient(net, images, 0.0, clip)
    # Abadi et al.: (sum of clipped gradients + N(0, (z C)^2)) / expected batch; the divisor is the expected
    # batch q x n = 4, not the 5 images this step drew (that would change the variance by (4/5)^2).
    assert_gaussian_noise((noised - clipped).numpy(), z * clip / 4)


@pytest.mark.parametrize("mode", ["central-server-clipping", "central-client-clipping"])
def test_central_dp_noises_the_clipped_mean_with_multiplier_times_clipping_norm_over_the_sites(flower_identity, tmp_path, mode):  # noqa: F811
    np.random.seed(4)  # Flower draws the noise from numpy's global generator
    sites, dim, z, clip = 4, 20_000, 2.0, 1.5
    rng = np.random.default_rng(0)
    updates = rng.normal(size=(sites, dim))  # norm ~141: the server clips them to `clip`
    if mode == "central-client-clipping":  # the sites' mods have clipped them; the server only adds the noise
        updates *= clip / np.linalg.norm(updates, axis=1, keepdims=True)
    clipped = updates * np.minimum(1.0, clip / np.linalg.norm(updates, axis=1, keepdims=True))
    cfg = RunConfig.from_run_config({"method": "fedavg", "aggregation": "unweighted", "dp.mode": mode,
                                     "dp.noise-multiplier": z, "dp.clipping-norm": clip})  # fmt: skip
    sent = {"w": np.zeros(dim, np.float32)}
    arrays, privacy = _server_round(cfg, sites, sent, [{"w": u.astype(np.float32)} for u in updates], tmp_path)
    # McMahan et al.'s DP-FedAvg as Flower applies it: the unweighted mean of clipped updates plus
    # N(0, (z C / sites)^2) per coordinate, accounted as one Gaussian release of multiplier z.
    assert_gaussian_noise(arrays["w"].numpy() - clipped.mean(axis=0), z * clip / sites)
    assert privacy["noise_multipliers"] == [pytest.approx(z)]
