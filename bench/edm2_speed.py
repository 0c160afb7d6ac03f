"""EDM2 training-step time: fedskew's generator against its un-optimised path, interleaved in one process.

    python -m bench.edm2_speed --steps 6 --repeats 5

Both sides run the real training loop (`train_generator`: loss, backward, Adam, EMA) on the same config,
weights and data; they differ only in the attention kernel and the activations' memory format. The
un-optimised path is EDM2's attention written as two einsums and a softmax (kept here, as the baseline)
on channels-first activations. The sides alternate in short bursts, so load from other processes on a
shared machine hits both alike; each side's figure is the median step time over all
its bursts, the first step of every burst (warm-up) excluded. Prints both times and their ratio, in CPU
seconds (the step's own work with one thread, robust to other load) and in wall seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from contextlib import contextmanager, nullcontext
from unittest import mock

import numpy as np
import torch

from fedskew.models import edm2
from fedskew.models.edm2 import CPU_PRESET, Block, GeneratorConfig, normalize, train_generator

# The setting compared in the docs: 16 px, 1 channel, C 32, mult [1, 2, 2], 2 blocks, attention at 4 px,
# batch 64.
BENCH_CONFIG = dataclasses.replace(
    CPU_PRESET, img_resolution=16, img_channels=1, model_channels=32, channel_mult=(1, 2, 2), num_blocks=2,
    attn_resolutions=(4,), batch_size=64,
)  # fmt: skip


def einsum_attention(block: Block, x: torch.Tensor) -> torch.Tensor:
    """EDM2's cosine attention as two einsums and a softmax: the un-optimised path."""
    batch, channels, height, width = x.shape
    head_channels = channels // block.num_heads
    qkv = block.attn_qkv(x).reshape(batch, block.num_heads, head_channels, 3, height * width)
    q, k, v = normalize(qkv, dim=2).unbind(3)
    weights = torch.einsum("nhcq,nhck->nhqk", q, k / math.sqrt(head_channels)).softmax(dim=3)
    y = torch.einsum("nhqk,nhck->nhcq", weights, v)
    return block.attn_proj(y.reshape(batch, channels, height, width))


@contextmanager
def unoptimised():
    """Context in which EDM2 runs un-optimised: attention through `einsum_attention`, activations in the
    default (channels-first) memory format."""
    with mock.patch.object(Block, "_attention", einsum_attention), \
            mock.patch.object(edm2, "MEMORY_FORMAT", torch.contiguous_format):  # fmt: skip
        yield


def step_seconds(images: np.ndarray, config: GeneratorConfig, steps: int) -> tuple[list[float], list[float]]:
    """(wall, CPU) seconds of each training step after the first, from the loop's own per-step callback.
    CPU seconds of this process: with one torch thread they are the step's own work, whatever the load."""
    stamps = []
    train_generator(images, None, dataclasses.replace(config, total_images=steps * config.batch_size),
                    progress=lambda *_: stamps.append((time.perf_counter(), time.process_time())),
                    device=torch.device("cpu"))  # fmt: skip
    wall, cpu = np.diff(np.array(stamps), axis=0).T
    return list(wall), list(cpu)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="training steps per burst (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=5, help="bursts per side, alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the setting of the docs)")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        raise SystemExit("--steps must be >= 2 and --repeats >= 1")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shape = (256, BENCH_CONFIG.img_channels, BENCH_CONFIG.img_resolution, BENCH_CONFIG.img_resolution)
    images = rng.random(shape, dtype=np.float32)
    sides = {"un-optimised": unoptimised, "fedskew": nullcontext}
    times = {name: ([], []) for name in sides}
    for _ in range(args.repeats):
        for name, context in sides.items():
            with context():
                wall, cpu = step_seconds(images, BENCH_CONFIG, args.steps)
            times[name][0].extend(wall)
            times[name][1].extend(cpu)
    for index, kind in enumerate(("wall", "CPU")):
        medians = {name: statistics.median(values[index]) for name, values in times.items()}
        for name, value in medians.items():
            print(f"{name}: {1000 * value:.1f} ms {kind} per step (median of {len(times[name][index])})")
        print(f"ratio fedskew / un-optimised, {kind} time: {medians['fedskew'] / medians['un-optimised']:.3f}")


if __name__ == "__main__":
    main()
