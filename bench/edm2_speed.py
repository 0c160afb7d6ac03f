"""EDM2 training-step time: fedskew's generator against its un-optimised path and, optionally, the NVlabs
reference implementation and a torch.compile'd network, interleaved in one process.

    python -m bench.edm2_speed --steps 6 --repeats 5
    python -m bench.edm2_speed --reference-dir ../edm2     # a checkout of github.com/NVlabs/edm2
    python -m bench.edm2_speed --cpu-preset 28 --compile

fedskew's side runs the real training loop (`train_generator`: loss, backward, Adam, EMA). The
un-optimised side runs the same loop with EDM2's block as published (kept here as the baseline) on
channels-first activations. The reference side runs the reference's own network, loss, schedule, Adam
and EMA, imported from the user's checkout (never shipped with fedskew: its licence is non-commercial),
on fedskew's initial weights. All sides use the same config, weights and data and alternate in short
bursts, so load from other processes on a shared machine hits them alike; each side's figure is the
median step time over all its bursts, the first step of every burst (warm-up, compile) excluded and
printed on its own. Prints the times and their ratios, in CPU seconds (the step's own work with one
thread, robust to other load) and in wall seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

from fedskew.models.edm2 import network as edm2_network, training as edm2_training
from fedskew.models.edm2 import (
    ADAM_BETAS, ADAM_EPS, CHANNELS_PER_HEAD, CPU_PRESET, SIGMA_DATA, SILU_RMS, Block, GeneratorConfig, build_generator,
    UNet, cpu_preset, resample, train_generator,
)  # fmt: skip

# The setting compared in the docs: 16 px, 1 channel, C 32, mult [1, 2, 2], 2 blocks, attention at 4 px,
# batch 64.
BENCH_CONFIG = dataclasses.replace(
    CPU_PRESET, img_resolution=16, img_channels=1, model_channels=32, channel_mult=(1, 2, 2), num_blocks=2,
    attn_resolutions=(4,), batch_size=64,
)  # fmt: skip


# The un-optimised path: EDM2's block as published (division-based normalisation and magnitude-preserving
# ops, einsum attention, clamp), on channels-first activations. fedskew's Block computes the same function.


def published_normalize(x: torch.Tensor, dim=None, eps: float = 1e-4) -> torch.Tensor:
    if dim is None:
        dim = list(range(1, x.ndim))
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.float32)
    return x / (eps + norm * math.sqrt(norm.numel() / x.numel())).to(x.dtype)


def published_mp_silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) / SILU_RMS


def published_mp_sum(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    return a.lerp(b, t) / math.sqrt((1 - t) ** 2 + t**2)


def einsum_attention(block: Block, x: torch.Tensor) -> torch.Tensor:
    """EDM2's cosine attention as two einsums and a softmax."""
    batch, channels, height, width = x.shape
    head_channels = channels // block.num_heads
    qkv = block.attn_qkv(x).reshape(batch, block.num_heads, head_channels, 3, height * width)
    q, k, v = published_normalize(qkv, dim=2).unbind(3)
    weights = torch.einsum("nhcq,nhck->nhqk", q, k / math.sqrt(head_channels)).softmax(dim=3)
    y = torch.einsum("nhqk,nhck->nhcq", weights, v)
    return block.attn_proj(y.reshape(batch, channels, height, width))


def published_block_forward(block: Block, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    x = resample(x, block.resample_mode)
    if block.flavor == "enc":
        if block.conv_skip is not None:
            x = block.conv_skip(x)
        x = published_normalize(x, dim=1)
    y = block.conv_res0(published_mp_silu(x))
    scale = block.emb_linear(emb, gain=block.emb_gain) + 1
    y = published_mp_silu(y * scale[:, :, None, None])
    if block.training and block.dropout > 0:
        y = F.dropout(y, p=block.dropout)
    y = block.conv_res1(y)
    if block.flavor == "dec" and block.conv_skip is not None:
        x = block.conv_skip(x)
    x = published_mp_sum(x, y, block.res_balance)
    if block.num_heads:
        x = published_mp_sum(x, einsum_attention(block, x), block.attn_balance)
    return x.clamp(-block.clip_act, block.clip_act)


@contextmanager
def unoptimised():
    """Context in which EDM2 runs un-optimised: `published_block_forward` and `published_normalize` in
    every layer, activations in the default (channels-first) memory format."""
    with mock.patch.object(Block, "forward", published_block_forward), \
            mock.patch.object(edm2_network, "normalize", published_normalize), \
            mock.patch.object(UNet, "memory_format", torch.contiguous_format):  # fmt: skip
        yield


@contextmanager
def compiled(cache_dir: str):
    """Context in which the training loop runs the network through `torch.compile` (default inductor
    backend), compiled at its first step, with the compile cache in `cache_dir` (empty at the first run:
    a cold compile; later runs of the same config reuse the compiled code). The compile workers run in
    this process (compile_threads 1) so that their CPU time counts."""
    import torch._inductor.config  # only here: importing the compiler takes seconds

    cache = {}
    loss = edm2_training.edm2_loss

    def compiled_loss(net, *args):
        if net not in cache:
            cache[net] = torch.compile(net)
        return loss(cache[net], *args)

    with mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": cache_dir}), \
            mock.patch.object(torch._inductor.config, "compile_threads", 1), \
            mock.patch.object(edm2_training, "edm2_loss", compiled_loss):  # fmt: skip
        yield


def clocks() -> tuple[float, float]:
    """(wall, CPU) seconds; CPU of this process and of its finished child processes (the compiler's)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), time.process_time() + children.ru_utime + children.ru_stime


@dataclasses.dataclass
class Timings:
    """Per-step (wall, CPU) seconds of one burst, and its first step's (set-up, warm-up, compile)."""

    wall: list[float]
    cpu: list[float]
    first_wall: float
    first_cpu: float


def per_step(stamps: list[tuple[float, float]]) -> Timings:
    """The first step's (wall, CPU) seconds, set-up included, and those of every later step, from
    (wall, CPU) stamps taken before the run and after every step."""
    wall, cpu = np.diff(np.array(stamps), axis=0).T
    return Timings(list(wall[1:]), list(cpu[1:]), wall[0], cpu[0])


def step_seconds(images: np.ndarray, config: GeneratorConfig, steps: int) -> Timings:
    """Step times of fedskew's training loop, from its own per-step callback. With one torch thread, a
    step's CPU seconds are its own work, whatever the load."""
    stamps = [clocks()]
    train_generator(images, None, dataclasses.replace(config, total_images=steps * config.batch_size),
                    progress=lambda *_: stamps.append(clocks()), device=torch.device("cpu"))  # fmt: skip
    return per_step(stamps)


@dataclasses.dataclass(frozen=True)
class Reference:
    """The NVlabs EDM2 reference (github.com/NVlabs/edm2, its own non-commercial licence, not part of fedskew),
    imported at run time from a user's checkout: its network, loss, learning-rate schedule and EMA modules."""

    networks: ModuleType
    loop: ModuleType
    phema: ModuleType


def load_reference(path: Path) -> Reference:
    if not (path / "training" / "networks_edm2.py").is_file():
        raise SystemExit(f"--reference-dir {path}: no training/networks_edm2.py there; pass a checkout of "
                         f"https://github.com/NVlabs/edm2")  # fmt: skip
    sys.path.insert(0, str(path.resolve()))
    try:
        modules = [importlib.import_module(f"training.{name}") for name in ("networks_edm2", "training_loop", "phema")]
    except ImportError as error:
        raise SystemExit(f"--reference-dir {path}: importing the reference failed ({error}); install what it "
                         f"imports (its training loop needs psutil and requests: pip install psutil requests)") from error
    return Reference(*modules)


def reference_network(reference: Reference, config: GeneratorConfig) -> torch.nn.Module:
    """The reference's Precond for `config` (fp32), holding fedskew's initial weights for that config."""
    if config.label_dim or config.dropout:
        raise SystemExit("the reference side is set up for unconditional configs without dropout")
    net = reference.networks.Precond(
        img_resolution=config.img_resolution, img_channels=config.img_channels, label_dim=0, use_fp16=False,
        model_channels=config.model_channels, channel_mult=list(config.channel_mult), num_blocks=config.num_blocks,
        attn_resolutions=list(config.attn_resolutions), channels_per_head=CHANNELS_PER_HEAD,
    )  # fmt: skip
    ours = build_generator(config).state_dict()
    theirs = net.state_dict()
    mismatched = sorted(set(ours) ^ set(theirs)) + [name for name in ours if name in theirs and ours[name].shape != theirs[name].shape]
    if mismatched:
        # E.g. fewer than 64 channels at an attention level: the reference has no head there, fedskew has one.
        raise SystemExit(f"the reference's parameters differ from fedskew's for this config ({mismatched[:4]}...): "
                         f"no side-by-side comparison on shared weights")  # fmt: skip
    net.load_state_dict(ours)
    return net


def max_output_difference(reference: Reference, config: GeneratorConfig) -> float:
    """Largest |difference| of the two denoisers (and logvar heads) on shared weights, a check that the
    reference side computes the same function. The zero-initialised gains are set to 1 so that the UNet
    reaches the output."""
    ours, theirs = build_generator(config).eval(), reference_network(reference, config).eval()
    generator = torch.Generator().manual_seed(1)
    shape = (8, config.img_channels, config.img_resolution, config.img_resolution)
    x, sigma = torch.randn(shape, generator=generator), torch.logspace(-2, 1.5, 8)
    with torch.no_grad():
        for net in (ours, theirs):
            for gain in (p for p in net.parameters() if p.ndim == 0):
                gain.fill_(1.0)
        outputs = [torch.cat([d.flatten(), logvar.flatten()]) for d, logvar in
                   (net(x, sigma, return_logvar=True) for net in (ours, theirs))]  # fmt: skip
    return (outputs[0] - outputs[1]).abs().max().item()


def reference_step_seconds(reference: Reference, images: np.ndarray, config: GeneratorConfig, steps: int) -> Timings:
    """Step times of the reference's training iteration, as its training
    loop runs it, on fedskew's initial weights and images: loss (its EDM2Loss, summed over elements and
    divided by the batch), backward, its learning-rate schedule, NaN/Inf gradients zeroed, Adam, its
    power-function EMA at fedskew's one EMA width. Its per-step seeding, statistics and data loader are left out
    (fedskew's side draws batches from an in-memory tensor as well)."""
    torch.manual_seed(config.seed)
    net = reference_network(reference, config).train()
    loss_fn = reference.loop.EDM2Loss(P_mean=config.P_mean, P_std=config.P_std, sigma_data=SIGMA_DATA)
    optimizer = torch.optim.Adam(net.parameters(), lr=config.ref_lr, betas=ADAM_BETAS, eps=ADAM_EPS)
    ema = reference.phema.PowerFunctionEMA(net, stds=[config.sigma_rel])
    data = torch.from_numpy(images) * 2 - 1
    rng = np.random.default_rng(config.seed)
    stamps = [clocks()]
    for step in range(steps):
        images_seen = step * config.batch_size
        batch = data[torch.from_numpy(rng.permutation(len(data))[: config.batch_size])]
        optimizer.zero_grad(set_to_none=True)
        batch_loss = loss_fn(net=net, images=batch).sum().mul(1 / config.batch_size)
        batch_loss.backward()
        lr = reference.loop.learning_rate_schedule(
            cur_nimg=images_seen, batch_size=config.batch_size, ref_lr=config.ref_lr,
            ref_batches=config.t_ref / config.batch_size, rampup_Mimg=config.t_rampup / 1e6,
        )  # fmt: skip
        for group in optimizer.param_groups:
            group["lr"] = lr
        for param in net.parameters():
            if param.grad is not None:
                torch.nan_to_num(param.grad, nan=0, posinf=0, neginf=0, out=param.grad)
        optimizer.step()
        ema.update(cur_nimg=images_seen + config.batch_size, batch_size=config.batch_size)
        batch_loss.item()
        stamps.append(clocks())
    return per_step(stamps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="training steps per burst (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=5, help="bursts per side, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the setting of the docs)")
    parser.add_argument("--cpu-preset", type=int, metavar="PX",
                        help="time the CPU preset for PX-pixel images instead of the 16 px comparison config")
    parser.add_argument("--reference-dir", type=Path, metavar="PATH",
                        help="a checkout of github.com/NVlabs/edm2: adds its training step as a side")
    parser.add_argument("--compile", action="store_true",
                        help="adds fedskew's step with the network compiled by torch.compile as a side")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        raise SystemExit("--steps must be >= 2 and --repeats >= 1")
    torch.set_num_threads(args.threads)
    config = BENCH_CONFIG if args.cpu_preset is None else cpu_preset(args.cpu_preset)
    rng = np.random.default_rng(0)
    shape = (256, config.img_channels, config.img_resolution, config.img_resolution)
    images = rng.random(shape, dtype=np.float32)

    def fedskew_side(context):
        def side(steps):
            with context():
                return step_seconds(images, config, steps)
        return side

    sides = {"un-optimised": fedskew_side(unoptimised), "fedskew": fedskew_side(nullcontext)}
    if args.compile:
        compile_cache = tempfile.TemporaryDirectory(prefix="edm2_speed_")  # removed when the script ends
        sides["fedskew compiled"] = fedskew_side(functools.partial(compiled, compile_cache.name))
    if args.reference_dir is not None:
        reference = load_reference(args.reference_dir)
        print(f"reference vs fedskew denoiser on shared weights: max |difference| {max_output_difference(reference, config):.2e}")
        sides["reference"] = functools.partial(reference_step_seconds, reference, images, config)
    runs = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, side in sides.items():
            runs[name].append(side(args.steps))
    for name, timings in runs.items():
        first = ", ".join(f"{t.first_cpu:.1f}/{t.first_wall:.1f}" for t in timings)
        print(f"{name}: first step of each burst (set-up{' and compile' if 'compiled' in name else ''}), CPU/wall s: {first}")
    for kind in ("wall", "cpu"):
        medians = {name: statistics.median(t for run in timings for t in getattr(run, kind)) for name, timings in runs.items()}
        for name, value in medians.items():
            print(f"{name}: {1000 * value:.1f} ms {kind.replace('cpu', 'CPU')} per step (median of {args.repeats * (args.steps - 1)})")
        for side in [name for name in sides if name != "un-optimised" and name != "reference"]:
            for baseline in [name for name in ("un-optimised", "reference") if name in sides]:
                print(f"ratio {side} / {baseline}, {kind.replace('cpu', 'CPU')} time: {medians[side] / medians[baseline]:.3f}")

if __name__ == "__main__":
    main()
