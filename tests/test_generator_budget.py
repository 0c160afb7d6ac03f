"""Generator budget in images seen: the lr schedule reaches its reference value at every class size,
and the CPU preset grows with the image instead of reusing the 8 px architecture."""

from __future__ import annotations

import dataclasses

import pytest

from fedskew.config import RunConfig
from fedskew.factory.site import generator_config
from fedskew.models.edm2 import CPU_PRESET, GPU_PRESET_32PX, build_generator, learning_rate


def lr_at_step(config, step: int) -> float:
    """The lr train_generator sets before `step` (1-based; it counts the current batch)."""
    return learning_rate(step * config.batch_size, config.ref_lr, config.t_ref, config.t_rampup)


def peak_lr(config) -> float:
    """The schedule rises until the ramp-up ends and never rises after it, so the peak is at the first
    step whose images seen reach t_rampup (or at the last step when the run ends first)."""
    ramp_end = max(1, -(-config.t_rampup // config.batch_size))
    return lr_at_step(config, min(ramp_end, config.total_steps))


@pytest.mark.parametrize(("class_size", "batch"), [(50, 32), (1000, 512), (10_000, 4096)])
def test_gpu_preset_sees_25m_images_and_reaches_the_reference_lr_at_every_class_size(class_size, batch):
    factory = RunConfig.from_run_config({"factory.generator": "gpu-32px"}).factory
    config = generator_config(factory, (3, 32, 32), label_dim=0, n_images=class_size, seed=0)
    assert config.batch_size == batch
    # Budget in images seen: 25 M whatever the batch, at most one batch more.
    assert 25_000_000 <= config.total_steps * config.batch_size < 25_000_000 + batch
    assert peak_lr(config) == pytest.approx(GPU_PRESET_32PX.ref_lr, rel=1e-12)


def test_a_budget_in_images_is_kept_when_the_batch_changes():
    factory = RunConfig.from_run_config({"factory.generator-images": 64_000}).factory
    small, large = (generator_config(factory, (1, 8, 8), 0, n, 0) for n in (40, 1000))
    assert (small.batch_size, large.batch_size) == (32, 64)
    assert small.total_steps * 32 == large.total_steps * 64 == 64_000
    for config in (small, large):
        assert peak_lr(config) == pytest.approx(CPU_PRESET.ref_lr)


@pytest.mark.parametrize(("side", "mult", "attention"), [(8, (1, 2), (4,)), (28, (1, 2, 2), (7,)), (32, (1, 2, 2), (8,)), (64, (1, 2, 2, 2), (8,))])
def test_cpu_preset_adds_levels_until_the_deepest_is_at_most_8_px(side, mult, attention):
    factory = RunConfig.from_run_config({}).factory
    config = generator_config(factory, (1, side, side), 0, 360, 0)
    assert (config.channel_mult, config.attn_resolutions) == (mult, attention)
    levels_added = len(mult) - len(CPU_PRESET.channel_mult)
    assert config.total_images == CPU_PRESET.total_images + levels_added * 200 * CPU_PRESET.batch_size
    if side == 8:  # the 8 px defaults are unchanged
        assert config == generator_config(factory, (1, 8, 8), 0, 360, 0) and config.num_blocks == CPU_PRESET.num_blocks
    build_generator(config)  # a valid architecture at that size


@pytest.mark.parametrize(("preset", "channels", "expected"), [("cpu", 0, 16), ("cpu", 32, 32), ("gpu-32px", 0, 128), ("gpu-32px", 64, 64)])
def test_generator_width_is_the_presets_unless_set(preset, channels, expected):
    factory = RunConfig.from_run_config({"factory.generator": preset, "factory.generator-channels": channels}).factory
    config = generator_config(factory, (3, 32, 32), 0, 180, 0)
    assert config.model_channels == expected
    narrow = generator_config(RunConfig.from_run_config({"factory.generator": preset}).factory, (3, 32, 32), 0, 180, 0)
    assert dataclasses.replace(config, model_channels=narrow.model_channels) == narrow  # nothing else changes
    weights = sum(p.numel() for p in build_generator(config, "meta").parameters())
    narrow_weights = sum(p.numel() for p in build_generator(narrow, "meta").parameters())
    # Every conv's weights grow with in x out channels: the count scales as the width's square, within the
    # few per-channel terms (gains, biases) that grow linearly.
    assert weights / narrow_weights == pytest.approx((expected / narrow.model_channels) ** 2, rel=0.05)


@pytest.mark.parametrize(("preset", "lr", "expected"), [("cpu", 0.0, 0.04), ("cpu", 0.01, 0.01), ("gpu-32px", 0.0, 0.01), ("gpu-32px", 0.02, 0.02)])
def test_generator_lr_is_the_presets_unless_set(preset, lr, expected):
    factory = RunConfig.from_run_config({"factory.generator": preset, "factory.generator-lr": lr}).factory
    config = generator_config(factory, (3, 32, 32), 0, 180, 0)
    default = generator_config(RunConfig.from_run_config({"factory.generator": preset}).factory, (3, 32, 32), 0, 180, 0)
    assert config.ref_lr == expected
    assert dataclasses.replace(config, ref_lr=default.ref_lr) == default  # nothing else changes
    # The schedule reaches the set lr: after the ramp-up and before the decay it is exactly ref_lr.
    assert learning_rate(config.t_rampup, config.ref_lr, config.t_ref, config.t_rampup) == pytest.approx(expected)
