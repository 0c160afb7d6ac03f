"""DP-SGD for FederatedFactory's generators: per-image gradients against per-example autograd, the
clipping bound, the epsilon against dp-accounting driven independently, the DP step without noise
or clipping against the ordinary step, and max-epsilon at the site and at the server. The real
`flwr run` with DP generators is tests/test_factory.py's factory run."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent
from dp_accounting.rdp import RdpAccountant

from fedskew.config import ConfigError, RunConfig
from fedskew.data.sites import simulated_site
from fedskew.factory.dp_sgd import DpSgd, clipped_sum, generator_privacy, per_image_gradients
from fedskew.factory.library import GeneratorModule, UploadRejected, validate_modules, validate_upload
from fedskew.factory.site import EpsilonRefusal, planned_module, planned_modules, train_site_generators
from fedskew.models.edm2 import (
    CPU_PRESET,
    PowerFunctionEMA,
    build_generator,
    edm2_loss,
    elementwise_loss,
    training_noise,
)
from fedskew.models.generator_io import state_dict_checksum

TINY = dataclasses.replace(
    CPU_PRESET, model_channels=8, num_blocks=1, batch_size=4, total_images=8, t_ref=8, t_rampup=0
)
# Two float32 evaluations of the same gradient that differ only in reduction order agree to about
# (terms summed) x float32 epsilon relative to the largest entry: sums here run over at most ~10^3
# terms, 10^3 x 1.2e-7 ~ 1e-4.
GRADIENT_RTOL = 1e-4


def _batch(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand((n, 1, 8, 8), generator=generator) * 2 - 1
    return images, torch.Generator().manual_seed(seed + 1)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=0, atol=GRADIENT_RTOL * max(b.abs().max().item(), 1e-12)))


@pytest.mark.parametrize("label_dim", [0, 3])
def test_per_image_gradients_equal_per_example_autograd(label_dim):
    config = dataclasses.replace(TINY, label_dim=label_dim)
    net = build_generator(config).train()
    images, rng = _batch(3)
    labels = torch.tensor([0, 2, 1]) if label_dim else None
    sigma, noise = training_noise(images, config.P_mean, config.P_std, rng)
    grads, losses = per_image_gradients(net, images, labels, sigma, noise)
    for i in range(3):
        net.zero_grad(set_to_none=True)
        one_label = None if labels is None else labels[i : i + 1]
        loss = elementwise_loss(net, images[i : i + 1], one_label, sigma[i : i + 1], noise[i : i + 1]).sum()
        loss.backward()
        assert losses[i].item() == pytest.approx(loss.item(), rel=GRADIENT_RTOL)
        for name, p in net.named_parameters():
            expected = p.grad if p.grad is not None else torch.zeros_like(p)
            assert _close(grads[name][i], expected), name


def test_clipping_bounds_each_gradient_norm_and_leaves_small_ones_alone():
    net = build_generator(TINY).train()
    images, rng = _batch(4)
    sigma, noise = training_noise(images, TINY.P_mean, TINY.P_std, rng)
    grads, _ = per_image_gradients(net, images, None, sigma, noise)
    norms = torch.sqrt(sum(g.reshape(4, -1).pow(2).sum(1) for g in grads.values()))
    clip = float(norms.median())  # some images above, some below the bound
    for i in range(4):
        one = clipped_sum({name: g[i : i + 1] for name, g in grads.items()}, clip)
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in one.values()))
        assert norm <= clip * (1 + 1e-5)
        if norms[i] <= clip:  # below the bound: scaled by clip / (norm + 1e-6) capped at 1, i.e. unchanged
            assert all(_close(one[name], grads[name][i]) for name in grads)
        else:
            assert norm == pytest.approx(clip, rel=1e-5)


def test_epsilon_is_dp_accounting_of_what_runs_poisson_sampling_at_the_batch_rate():
    cfg = RunConfig.from_run_config(
        {"method": "factory", "mosaic-grid": 0, "partition": "classes-per-site", "classes-per-site": 1,
         "factory.dp-noise-multiplier": 2.0, "factory.dp-clipping-norm": 0.5, "factory.generator-steps": 30}
    )  # fmt: skip
    (planned,) = planned_modules(cfg, 0, [0, 0, 0, 130] + [0] * 6, (1, 8, 8))
    privacy = planned.privacy
    # Independently: 30 steps, each a Poisson sample at rate batch / images.
    rate = planned.config.batch_size / 130
    accountant = RdpAccountant()
    accountant.compose(PoissonSampledDpEvent(rate, GaussianDpEvent(2.0)), 30)
    assert planned.config.total_steps == privacy["steps"] == 30
    assert privacy["sample-rate"] == rate and privacy["delta"] == 1 / 130 and privacy["clipping-norm"] == 0.5
    assert privacy["epsilon"] == pytest.approx(accountant.get_epsilon(1 / 130), rel=1e-9)
    # The batches DP-SGD draws are that Poisson sample: mean size rate x images within 5 binomial sd.
    dp = DpSgd(2.0, 0.5, planned.config.batch_size, 130, secret_seed=0)
    sizes = [len(next(batches)) for batches in [dp.batches(130)] for _ in range(400)]
    sd = math.sqrt(130 * rate * (1 - rate) / 400)
    assert abs(np.mean(sizes) - rate * 130) < 5 * sd
    assert generator_privacy(cfg.factory.model_copy(update={"dp_noise_multiplier": 0.0}), planned.config, 130) is None


def test_dp_step_without_noise_and_clipping_is_the_ordinary_step():
    images, _ = _batch(4)
    nets, emas, grads = [], [], []
    for private in (False, True):
        net = build_generator(TINY).train()
        ema = PowerFunctionEMA(net, TINY.sigma_rel)
        optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
        rng = torch.Generator().manual_seed(5)
        if private:  # rate 1 over 4 images: the expected batch is the batch
            DpSgd(0.0, math.inf, 4, 4, secret_seed=0).gradients(net, images, None, TINY, rng)
        else:
            edm2_loss(net, images, None, TINY.P_mean, TINY.P_std, rng).backward()
        grads.append({name: p.grad.clone() for name, p in net.named_parameters()})
        optimizer.step()
        ema.update(net, 4, 4)
        nets.append(net)
        emas.append(ema.model)
    for (name, a), b, e_a, e_b in zip(
        nets[0].state_dict().items(), nets[1].state_dict().values(), emas[0].state_dict().values(), emas[1].state_dict().values()
    ):
        assert _close(b, a) and _close(e_b, e_a), name
    # Adam's first step hardly depends on the gradient's scale, so the gradients themselves are compared too.
    assert all(_close(grads[1][name], g) for name, g in grads[0].items())


DP = {"method": "factory", "mosaic-grid": 0, "partition": "classes-per-site", "classes-per-site": 2,
      "factory.dp-noise-multiplier": 1.0, "factory.generator-steps": 50}  # fmt: skip


def test_max_epsilon_needs_dp_generators():
    with pytest.raises(ConfigError, match="key 'factory.max-epsilon' = 5.0 is invalid"):
        RunConfig.from_run_config({"factory.max-epsilon": 5.0})


def test_a_site_refuses_to_train_generators_above_max_epsilon():
    cfg = RunConfig.from_run_config({**DP, "factory.max-epsilon": 1.0})
    site = simulated_site(cfg, 0, 5)
    with pytest.raises(EpsilonRefusal, match=r"factory.max-epsilon = 1.0 is exceeded: site0-class\d+: epsilon \d"):
        train_site_generators(cfg, site, torch.device("cpu"))  # refused before any step: the test takes no time


def _upload(planned, privacy):
    state = {k: v.clone() for k, v in build_generator(planned.config).state_dict().items()}
    module = GeneratorModule(planned.module_id, 0, planned.classes, planned.image_counts, planned.config,
                             state_dict_checksum(state), 0.0, state, privacy)  # fmt: skip
    return {"site-id": 0, "image-shape": [1, 8, 8], "modules": [module.metadata()]}, {module.module_id: state}


@pytest.mark.parametrize(
    ("declared", "max_epsilon", "reason"),
    [
        (None, 100.0, "declares no DP epsilon; factory.max-epsilon 100.0"),
        ("planned", 1.0, "exceeds factory.max-epsilon 1.0"),
        ({"epsilon": 0.5}, 100.0, "differs from the server's"),  # forged: a smaller epsilon than the run's
        ("planned", 100.0, None),
    ],
)
def test_the_server_rejects_generators_without_or_above_max_epsilon(declared, max_epsilon, reason):
    cfg = RunConfig.from_run_config(DP)
    (planned,) = planned_modules(cfg, 0, [120] + [0] * 9, (1, 8, 8))
    privacy = planned.privacy if declared == "planned" else declared and {**planned.privacy, **declared}
    meta, states = _upload(planned, privacy)
    check = dict(site_id=0, plan=[planned], image_shape=(1, 8, 8), max_epsilon=max_epsilon)
    if reason is None:
        (module,) = validate_upload(meta, states, **check)
        assert module.privacy == planned.privacy and module.metadata()["privacy"]["epsilon"] == planned.privacy["epsilon"]
    else:
        with pytest.raises(UploadRejected, match=reason):
            validate_upload(meta, states, **check)


def test_a_relayed_library_must_carry_the_privacy_the_run_config_gives():
    cfg = RunConfig.from_run_config(DP)
    (planned,) = planned_modules(cfg, 0, [120] + [0] * 9, (1, 8, 8))
    meta, states = _upload(planned, planned.privacy)
    relayed = meta["modules"]

    def plan(site_id, classes, counts):
        return planned_module(cfg, site_id, classes, counts, (1, 8, 8), 10)

    (module,) = validate_modules(relayed, states, num_classes=10, image_shape=(1, 8, 8), planned=plan)
    assert module.privacy == planned.privacy
    forged = [{**relayed[0], "privacy": {**planned.privacy, "noise-multiplier": 9.0}}]
    with pytest.raises(UploadRejected, match="declared privacy .* differs"):
        validate_modules(forged, states, num_classes=10, image_shape=(1, 8, 8), planned=plan)
