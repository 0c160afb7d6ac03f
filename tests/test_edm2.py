import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from fedskew.models.edm2 import (
    CPU_PRESET,
    GPU_PRESET_32PX,
    Block,
    GeneratorConfig,
    Guidance,
    MPConv,
    MPFourier,
    PowerFunctionEMA,
    augment,
    build_generator,
    count_parameters,
    edm2_loss,
    ema_gamma,
    learning_rate,
    mp_cat,
    mp_silu,
    mp_sum,
    normalize,
    preconditioning,
    resample,
    sample,
    sigma_steps,
    train_generator,
    with_batch_for_class_size,
)
from fedskew.models.generator_io import (
    GeneratorFileError,
    generator_from_arrays,
    load_generator,
    save_generator,
    state_dict_checksum,
    state_dict_to_arrays,
)

TINY = dataclasses.replace(
    CPU_PRESET,
    model_channels=8,
    num_blocks=1,
    batch_size=16,
    total_images=16 * 60,
    t_ref=16 * 20,
    t_rampup=16 * 5,
    sigma_rel=0.1,
)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    # These tensors are tiny: on a shared 2-core machine thread hand-offs cost more than they save.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rms(x: torch.Tensor) -> float:
    return x.pow(2).mean().sqrt().item()


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def blob_images(n: int, seed: int = 0) -> np.ndarray:
    """A centred blob with small seeded jitter: an easy 8 px 'class' to learn."""
    grid = np.linspace(-1, 1, 8)
    blob = np.exp(-(grid[:, None] ** 2 + grid[None, :] ** 2) / 0.3)
    jitter = np.random.default_rng(seed).uniform(0.8, 1.0, (n, 1, 1, 1))
    return (blob[None, None] * jitter).astype(np.float32)


# ---- MP primitives ---------------------------------------------------------------------------


def test_normalize_scales_every_slice_to_unit_rms():
    x = torch.randn(5, 3, 4, 4, generator=seeded()) * torch.arange(1, 6).reshape(5, 1, 1, 1)
    per_sample = normalize(x).pow(2).mean(dim=(1, 2, 3)).sqrt()
    assert torch.allclose(per_sample, torch.ones(5), atol=1e-3)
    per_pixel = normalize(x, dim=1).pow(2).mean(dim=1).sqrt()
    assert torch.allclose(per_pixel, torch.ones(5, 4, 4), atol=1e-3)


@pytest.mark.parametrize("kernel", [(), (1, 1), (3, 3)])
def test_mpconv_preserves_unit_magnitude(kernel):
    conv = MPConv(48, 32, kernel, seeded())
    x = torch.randn(256, 48, generator=seeded(1)) if kernel == () else torch.randn(32, 48, 8, 8, generator=seeded(1))
    assert rms(conv(x)) == pytest.approx(1.0, abs=0.1)


def test_mp_silu_sum_cat_preserve_unit_magnitude():
    a = torch.randn(400_000, generator=seeded(1))
    b = torch.randn(400_000, generator=seeded(2))
    assert rms(mp_silu(a)) == pytest.approx(1.0, abs=0.01)
    assert rms(mp_sum(a, b, 0.3)) == pytest.approx(1.0, abs=0.01)
    wide, narrow = a.reshape(1000, 400), b.reshape(1000, 400)[:, :40]
    joined = mp_cat(wide, narrow, t=0.5)
    assert joined.shape == (1000, 440)
    assert rms(joined) == pytest.approx(1.0, abs=0.01)
    # Balance t=0.5 gives both inputs equal total energy regardless of width.
    assert joined[:, :400].pow(2).sum().item() == pytest.approx(joined[:, 400:].pow(2).sum().item(), rel=0.02)


def test_mp_fourier_is_seeded_and_unit_magnitude():
    a, b = MPFourier(256, seeded(3)), MPFourier(256, seeded(3))
    x = torch.linspace(-3, 3, 100)
    assert torch.equal(a(x), b(x))
    assert rms(a(x)) == pytest.approx(1.0, abs=0.1)


def test_resample_box_down_and_nearest_up():
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    assert torch.equal(resample(x, "down"), torch.tensor([[[[2.5, 4.5], [10.5, 12.5]]]]))
    assert torch.equal(resample(resample(x, "down"), "up")[0, 0, :2, :2], torch.full((2, 2), 2.5))
    with pytest.raises(ValueError, match="resample mode"):
        resample(x, "sideways")


@pytest.mark.parametrize("flavor", ["enc", "dec"])
@pytest.mark.parametrize("attention", [False, True])
def test_block_preserves_magnitude_at_init(flavor, attention):
    x, emb = torch.randn(16, 64, 8, 8, generator=seeded(1)), torch.randn(16, 32, generator=seeded(2))
    # The same seed draws the same residual weights; attention only adds its branch after them.
    residual = rms(Block(64, 64, 32, flavor, "keep", False, 0.0, seeded())(x, emb))
    assert residual == pytest.approx(1.0, abs=0.1)
    if not attention:
        return
    out = rms(Block(64, 64, 32, flavor, "keep", True, 0.0, seeded())(x, emb))
    # The attention branch averages unit-RMS values over n = 64 positions with softmax weights of logits
    # cos(q, k) * sqrt(64) ~ N(0, 1), so its mean square is E[sum w^2] = E[e^2z] / (n E[e^z]^2) = e / n.
    # mp_sum(x, a, t) of uncorrelated x and a has mean square ((1-t)^2 rms(x)^2 + t^2 rms(a)^2) / ((1-t)^2 + t^2).
    t, n = 0.3, 64
    expected = math.sqrt(((1 - t) ** 2 * residual**2 + t**2 * math.e / n) / ((1 - t) ** 2 + t**2))
    # 0.01 covers rms(a)^2 off by half (0.002) and a correlation of x and a up to 0.05 (0.007).
    assert out == pytest.approx(expected, abs=0.01)


def test_forced_weight_normalisation_restores_unit_rows_after_optimiser_step():
    conv = MPConv(16, 8, (3, 3), seeded()).train()
    optimizer = torch.optim.Adam(conv.parameters(), lr=0.5)
    x = torch.randn(4, 16, 6, 6, generator=seeded(1))
    conv(x).square().mean().backward()
    optimizer.step()
    row_rms = conv.weight.detach().flatten(1).pow(2).mean(dim=1).sqrt()
    assert not torch.allclose(row_rms, torch.ones(8), atol=1e-2)  # the step did move the norms
    conv(x)
    row_rms = conv.weight.detach().flatten(1).pow(2).mean(dim=1).sqrt()
    assert torch.allclose(row_rms, torch.ones(8), atol=1e-3)


def test_eval_forward_leaves_weights_untouched():
    conv = MPConv(4, 4, (), seeded()).eval()
    before = conv.weight.detach().clone() * 3
    with torch.no_grad():
        conv.weight.copy_(before)
    conv(torch.randn(2, 4))
    assert torch.equal(conv.weight.detach(), before)


# ---- config ----------------------------------------------------------------------------------


def test_gpu_preset_has_the_papers_parameter_count():
    assert count_parameters(build_generator(GPU_PRESET_32PX, "meta")) == pytest.approx(50.7e6, rel=0.005)


def reference_state_dict_shapes(config: GeneratorConfig) -> dict[str, tuple[int, ...]]:
    """The EDM2 reference UNet's tensors, enumerated from its published structure: the encoder's
    resampling blocks and the deepest decoder level's second entry block (in1) carry no attention;
    in0 always does; every other block attends iff its resolution is in attn_resolutions."""
    shapes: dict[str, tuple[int, ...]] = {}
    level_channels = [config.model_channels * m for m in config.channel_mult]
    emb = max(level_channels)

    def block(prefix: str, cin: int, cout: int, enc: bool, attention: bool) -> int:
        shapes[f"{prefix}.emb_gain"] = ()
        shapes[f"{prefix}.conv_res0.weight"] = (cout, cout if enc else cin, 3, 3)
        shapes[f"{prefix}.emb_linear.weight"] = (cout, emb)
        shapes[f"{prefix}.conv_res1.weight"] = (cout, cout, 3, 3)
        if cin != cout:
            shapes[f"{prefix}.conv_skip.weight"] = (cout, cin, 1, 1)
        if attention:
            shapes[f"{prefix}.attn_qkv.weight"] = (3 * cout, cout, 1, 1)
            shapes[f"{prefix}.attn_proj.weight"] = (cout, cout, 1, 1)
        return cout

    shapes["unet.emb_fourier.freqs"] = shapes["unet.emb_fourier.phases"] = (level_channels[0],)
    shapes["unet.emb_noise.weight"] = (emb, level_channels[0])
    skips, cout = [], config.img_channels + 1
    for level, channels in enumerate(level_channels):
        res = config.img_resolution >> level
        if level == 0:
            shapes[f"unet.enc.{res}x{res}_conv.weight"] = (channels, cout, 3, 3)
            cout = channels
        else:
            cout = block(f"unet.enc.{res}x{res}_down", cout, cout, True, False)
        skips.append(cout)
        for idx in range(config.num_blocks):
            cout = block(f"unet.enc.{res}x{res}_block{idx}", cout, channels, True, res in config.attn_resolutions)
            skips.append(cout)
    for level, channels in reversed(list(enumerate(level_channels))):
        res = config.img_resolution >> level
        if level == len(level_channels) - 1:
            block(f"unet.dec.{res}x{res}_in0", cout, cout, False, True)
            block(f"unet.dec.{res}x{res}_in1", cout, cout, False, False)
        else:
            block(f"unet.dec.{res}x{res}_up", cout, cout, False, False)
        for idx in range(config.num_blocks + 1):
            cout = block(f"unet.dec.{res}x{res}_block{idx}", cout + skips.pop(), channels, False,
                         res in config.attn_resolutions)
    shapes["unet.out_conv.weight"] = (config.img_channels, cout, 3, 3)
    shapes["unet.out_gain"] = ()
    shapes["logvar_fourier.freqs"] = shapes["logvar_fourier.phases"] = (128,)
    shapes["logvar_linear.weight"] = (1, 128)
    return shapes


# Parameter counts (Fourier buffers excluded) of the reference structure above. CPU preset: the
# 4 px in1 block has no attention (32 channels: 3*32*32 + 32*32 = 4,096 parameters fewer than
# with it). GPU preset: 50,700,325, the "~50.7 M" FederatedFactory reports.
@pytest.mark.parametrize("config, parameters, tensors",
                         [(CPU_PRESET, 252_223, 84), (GPU_PRESET_32PX, 50_700_325, 200)],
                         ids=["cpu", "gpu-32px"])
def test_presets_have_the_reference_architecture(config, parameters, tensors):
    net = build_generator(config, "meta")
    expected = reference_state_dict_shapes(config)
    actual = {key: tuple(value.shape) for key, value in net.state_dict().items()}
    assert actual == expected
    assert len(actual) == tensors
    buffers = sum(math.prod(shape) for key, shape in expected.items() if key.endswith(("freqs", "phases")))
    assert sum(math.prod(shape) for shape in expected.values()) - buffers == parameters
    assert count_parameters(net) == parameters


def test_resolution_that_does_not_halve_is_refused():
    with pytest.raises(ValueError, match=r"img_resolution 28 .*4 levels.*multiple of 8.*at most 3 level"):
        dataclasses.replace(GPU_PRESET_32PX, img_resolution=28)
    assert dataclasses.replace(GPU_PRESET_32PX, img_resolution=28, channel_mult=(1, 2, 2), attn_resolutions=(14, 7))


def test_attention_resolution_must_be_a_level():
    with pytest.raises(ValueError, match=r"attn_resolutions.*\[12\].*valid values are \[32, 16, 8, 4\]"):
        dataclasses.replace(GPU_PRESET_32PX, attn_resolutions=(12,))


def test_batch_follows_class_size_as_federated_factory_did():
    small = with_batch_for_class_size(GPU_PRESET_32PX, 1000)
    assert small.batch_size == 512 and small.t_ref == 35_000 * 512
    assert with_batch_for_class_size(GPU_PRESET_32PX, 10).batch_size == 32
    assert with_batch_for_class_size(GPU_PRESET_32PX, 10**6).batch_size == 4096


def test_config_round_trips_through_json_and_rejects_unknown_keys():
    data = json.loads(json.dumps(GPU_PRESET_32PX.to_dict()))
    assert GeneratorConfig.from_dict(data) == GPU_PRESET_32PX
    with pytest.raises(ValueError, match="unknown \\['colour'\\]"):
        GeneratorConfig.from_dict({**data, "colour": 1})


# ---- preconditioning, loss, schedule, EMA ----------------------------------------------------


def test_preconditioning_coefficients_match_hand_computed_values():
    c = preconditioning(torch.tensor([0.5, 1.0], dtype=torch.float64))
    # sigma 0.5: s^2 + sd^2 = 0.5; sigma 1: 1.25
    assert torch.allclose(c["c_skip"], torch.tensor([0.5, 0.2], dtype=torch.float64))
    assert torch.allclose(c["c_out"], torch.tensor([0.25 / math.sqrt(0.5), 0.5 / math.sqrt(1.25)], dtype=torch.float64))
    assert torch.allclose(c["c_in"], torch.tensor([1 / math.sqrt(0.5), 1 / math.sqrt(1.25)], dtype=torch.float64))
    assert torch.allclose(c["c_noise"], torch.tensor([math.log(0.5) / 4, 0.0], dtype=torch.float64))


def test_denoiser_at_init_is_the_skip_path():
    # out_gain starts at 0, so F = 0 and D(x; s) = c_skip x exactly.
    net = build_generator(TINY).eval()
    x = torch.randn(3, 1, 8, 8, generator=seeded())
    sigma = torch.tensor([0.1, 1.0, 10.0])
    expected = x * (0.25 / (sigma**2 + 0.25)).reshape(-1, 1, 1, 1)
    assert torch.allclose(net(x, sigma), expected, atol=1e-6)


def test_learning_rate_ramps_up_then_decays_as_inverse_sqrt():
    assert learning_rate(50, 0.01, t_ref=400, t_rampup=100) == pytest.approx(0.005)
    assert learning_rate(400, 0.01, t_ref=400, t_rampup=100) == pytest.approx(0.01)
    assert learning_rate(1600, 0.01, t_ref=400, t_rampup=100) == pytest.approx(0.005)


def test_ema_gamma_matches_published_values():
    assert ema_gamma(0.05) == pytest.approx(16.97, abs=0.01)
    assert ema_gamma(0.10) == pytest.approx(6.94, abs=0.01)


def test_power_function_ema_update():
    net = torch.nn.Linear(2, 1)
    ema = PowerFunctionEMA(net, sigma_rel=0.1)
    with torch.no_grad():
        net.weight.fill_(1.0)
    ema.update(net, images_seen=10, batch_size=10)  # beta = 0: the first update copies the net
    assert torch.equal(ema.model.weight, net.weight.detach())
    with torch.no_grad():
        net.weight.fill_(3.0)
    ema.update(net, images_seen=20, batch_size=10)
    beta = 0.5 ** (ema_gamma(0.1) + 1)
    assert torch.allclose(ema.model.weight, torch.full((1, 2), beta * 1 + (1 - beta) * 3))


def test_training_steps_lower_the_loss():
    images = blob_images(32)
    batch = torch.from_numpy(np.repeat(images, 8, axis=0)) * 2 - 1

    def fixed_loss(net):
        with torch.no_grad():
            return edm2_loss(net.eval(), batch, None, TINY.P_mean, TINY.P_std, seeded(7)).item()

    before = fixed_loss(build_generator(TINY))
    model, stats = train_generator(images, None, TINY, progress=None, device=torch.device("cpu"))
    assert stats.steps == 60 and stats.images_seen == 960 and len(stats.loss_curve) == 60
    assert stats.images_per_s > 0 and stats.wall_time_s > 0
    assert fixed_loss(model) < 0.5 * before


def test_training_is_seeded_and_progress_is_reported():
    config = dataclasses.replace(TINY, total_images=32, dropout=0.2, augment_flip=True)
    images = blob_images(20)
    calls = []
    first, _ = train_generator(images, None, config, progress=lambda *a: calls.append(a), device=torch.device("cpu"))
    second, _ = train_generator(images, None, config, progress=None, device=torch.device("cpu"))
    assert [c[:2] for c in calls] == [(1, 2), (2, 2)]
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name


def test_training_input_is_validated():
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        train_generator(blob_images(4) * 2, None, TINY, progress=None)
    with pytest.raises(ValueError, match="shape"):
        train_generator(np.zeros((4, 3, 8, 8), np.float32), None, TINY, progress=None)
    with pytest.raises(ValueError, match="unconditional"):
        train_generator(blob_images(4), np.zeros(4, np.int64), TINY, progress=None)


def test_augment_produces_rotations_and_flips_of_each_image():
    image = torch.arange(16.0).reshape(1, 1, 4, 4)
    out = augment(image.repeat(64, 1, 1, 1), flip=True, rot90=True, rng=np.random.default_rng(0))
    variants = [torch.rot90(im, k, dims=(2, 3)) for im in (image, image.flip(3)) for k in range(4)]
    matches = [[torch.equal(o[None], v) for v in variants].index(True) for o in out]
    assert len(set(matches)) == 8  # all eight dihedral variants occur


# ---- sampler ---------------------------------------------------------------------------------


def test_sigma_schedule_endpoints():
    sigmas = sigma_steps(32)
    assert len(sigmas) == 33
    assert sigmas[0].item() == pytest.approx(80.0)
    assert sigmas[31].item() == pytest.approx(0.002)
    assert sigmas[32].item() == 0.0
    assert bool((sigmas[1:] < sigmas[:-1]).all())
    with pytest.raises(ValueError, match="steps"):
        sigma_steps(1)


class CountingNet(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net, self.config, self.calls = net, net.config, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.net(*args, **kwargs)


def test_heun_uses_2n_minus_1_evaluations_per_batch_also_with_guidance():
    net = CountingNet(build_generator(TINY))
    guide = CountingNet(build_generator(dataclasses.replace(TINY, seed=1)))
    sample(net, 6, steps=5, batch_size=3, guidance=Guidance(guide, 2.0))
    assert net.calls == 2 * 9 and guide.calls == 2 * 9


def test_sample_is_seeded_in_range_and_independent_of_batch_size():
    net = build_generator(TINY)
    with torch.no_grad():
        net.unet.out_gain.fill_(1.0)  # a non-trivial denoiser
    a = sample(net, 5, steps=4, seed=3, batch_size=5)
    b = sample(net, 5, steps=4, seed=3, batch_size=2)
    c = sample(net, 5, steps=4, seed=4, batch_size=5)
    assert a.shape == (5, 1, 8, 8) and a.dtype == np.float32
    assert a.min() >= 0 and a.max() <= 1
    assert np.allclose(a, b, atol=1e-5)
    assert not np.allclose(a, c)


def test_conditional_generator_trains_and_samples_requested_classes():
    config = dataclasses.replace(TINY, label_dim=3, total_images=32)
    images = blob_images(12)
    model, _ = train_generator(images, np.arange(12) % 3, config, progress=None, device=torch.device("cpu"))
    assert sample(model, 4, labels=np.array([0, 1, 2, 0]), steps=3).shape == (4, 1, 8, 8)
    assert sample(model, 2, labels=1, steps=3).shape == (2, 1, 8, 8)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        sample(model, 2, labels=3, steps=3)
    with pytest.raises(ValueError, match="conditional"):
        sample(model, 2, labels=None, steps=3)


# ---- save / load -----------------------------------------------------------------------------


@pytest.fixture
def saved_generator(tmp_path):
    net = build_generator(TINY)
    with torch.no_grad():
        net.unet.out_gain.fill_(1.0)
    stem = tmp_path / "gen"
    save_generator(net, TINY, stem, extra_meta={"class_id": 3, "num_images": 17})
    return net, stem


def test_save_then_load_gives_identical_samples(saved_generator):
    net, stem = saved_generator
    loaded, extra = load_generator(stem, torch.device("cpu"))
    assert extra == {"class_id": 3, "num_images": 17}
    assert loaded.config == TINY
    assert np.array_equal(sample(net, 4, steps=4, seed=9), sample(loaded, 4, steps=4, seed=9))


def test_flipped_byte_in_weights_is_refused(saved_generator):
    _, stem = saved_generator
    weights = stem.with_name("gen.safetensors")
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(GeneratorFileError, match="sha256.*altered"):
        load_generator(stem, torch.device("cpu"))


def test_changed_config_is_refused(saved_generator):
    _, stem = saved_generator
    meta_path = stem.with_name("gen.json")
    meta = json.loads(meta_path.read_text())
    meta["config"]["model_channels"] = 16
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(GeneratorFileError, match="has shape .* the config's model needs"):
        load_generator(stem, torch.device("cpu"))
    meta["config"]["img_resolution"] = 7
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(GeneratorFileError, match="invalid generator config.*img_resolution 7"):
        load_generator(stem, torch.device("cpu"))


def test_arrays_round_trip_with_checksum_and_tampering_is_refused():
    net = build_generator(TINY)
    arrays = state_dict_to_arrays(net)
    checksum = state_dict_checksum(arrays)
    assert checksum == state_dict_checksum(dict(reversed(list(arrays.items()))))  # order-independent
    rebuilt = generator_from_arrays(TINY, arrays, checksum)
    assert state_dict_checksum(rebuilt.state_dict()) == checksum
    name = next(iter(arrays))
    tampered = {**arrays, name: arrays[name] + 1e-3}
    with pytest.raises(GeneratorFileError, match="checksum mismatch"):
        generator_from_arrays(TINY, tampered, checksum)


def test_bf16_autocast_training_tracks_fp32_and_auto_is_fp32_on_cpu():
    config = dataclasses.replace(CPU_PRESET, total_images=3 * CPU_PRESET.batch_size)
    images = np.random.default_rng(0).random((70, 1, 8, 8), dtype=np.float32)
    curves = {p: train_generator(images, None, config, progress=None, device=torch.device("cpu"), precision=p)[1].loss_curve
              for p in ("fp32", "bf16", "auto")}
    assert curves["auto"] == curves["fp32"]
    # bf16 keeps 8 mantissa bits (relative rounding 2^-9 per op); a few % after 3 steps is plenty
    assert curves["bf16"] != curves["fp32"]
    assert np.allclose(curves["bf16"], curves["fp32"], rtol=0.02)
    with pytest.raises(ValueError, match=r"precision must be one of \('auto', 'fp32', 'bf16'\), got 'fp16'"):
        train_generator(images, None, config, progress=None, device=torch.device("cpu"), precision="fp16")


# ---- optimised path -------------------------------------------------------------------------


def test_optimised_path_matches_the_published_block_on_shared_weights():
    """fedskew's block (fused attention, channels-last, constants folded into the convolutions' gains,
    reciprocal-multiply normalisation, hardtanh clip) against EDM2's block as published on channels-first
    activations (bench.edm2_speed.unoptimised): they differ only in the order and rounding of float32
    operations. Bound (Higham): a length-n dot product is off by at most gamma_n = n u / (1 - n u) of
    |x|.|w|, u = 2^-24; with magnitude-preserving layers (unit-RMS activations, unit-norm weight rows)
    that is an error of gamma_n per layer, and at most one per MPConv layer along any path: depth x
    gamma_n of the output scale. The folding and the reciprocal add a few u per layer, far inside gamma_n.
    Checked in eval mode and in training mode (forced weight normalisation in the forward pass)."""
    from bench.edm2_speed import unoptimised

    # Two heads at 4 px (128 channels) so the head split is exercised too.
    config = dataclasses.replace(CPU_PRESET, model_channels=64, seed=3)
    net = build_generator(config).eval()
    with torch.no_grad():  # the zero-initialised gains would hide the UNet (and its attention) from the output
        for gain in (p for p in net.parameters() if p.ndim == 0):
            gain.fill_(1.0)
    x = torch.randn(8, 1, 8, 8, generator=seeded(1))
    sigma = torch.logspace(-2, 1.5, 8)
    convs = [m for m in net.unet.modules() if isinstance(m, MPConv)]
    u = 2.0**-24
    n = max(m.weight[0].numel() for m in convs)
    for training in (False, True):
        fast_net, published_net = copy.deepcopy(net).train(training), copy.deepcopy(net).train(training)
        with torch.no_grad():
            fast = fast_net(x, sigma)
            with unoptimised():
                reference = published_net(x, sigma)
        tolerance = len(convs) * n * u / (1 - n * u) * max(1.0, reference.abs().max().item())
        assert (fast - reference).abs().max().item() <= tolerance

    # A wrong kernel must fail the bound: keys not normalised (plain dot-product attention).
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr("fedskew.models.edm2.network.normalize", lambda qkv, dim=None: qkv.clone() if dim == 4 else normalize(qkv, dim))
        wrong = copy.deepcopy(net).train()(x, sigma)
    assert (wrong - reference).abs().max().item() > tolerance
