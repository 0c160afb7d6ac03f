"""GPU readiness check: the paper-scale settings' throughput and memory on one device, one JSON.

    python -m bench.gpu_check --out bench/results/gpu_check.json          # one GPU, < 8 minutes
    python -m bench.gpu_check --smoke --out gpu_check.json                # CPU, tiny sizes, seconds (CI)

Measures
  - EDM2 `gpu-32px` (FederatedFactory's 50.7 M-parameter generator) training img/s at batch 256 and 512,
    in fp32 and in bf16 autocast, on random 32 px images;
  - the deterministic Heun sampler's img/s (50 steps, FederatedFactory's setting);
  - FedNCA-ML (ResNet-18, standard stem, 224 px, 10 labels, LADM + ETF, batch 32, AdamW) local steps/s;
  - peak device memory of each measurement.
Each throughput excludes the first steps (CUDA context, cuDNN autotuning). Every measurement runs
only while the --budget-s deadline allows; what did not fit is listed under "skipped".
With --smoke the same code runs on the CPU with a narrow EDM2, tiny batches and 32 px ResNet input,
so CI keeps the script working where no GPU is present.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from fedskew.config import RunConfig
from fedskew.models.build import build_model, server_etf
from fedskew.models.edm2 import GPU_PRESET_32PX, GeneratorConfig, build_generator, count_parameters, sample, train_generator
from fedskew.models.fednca import fednca_loss, fednca_optimizer


@dataclasses.dataclass(frozen=True)
class Sizes:
    generator: GeneratorConfig
    train_batches: tuple[int, ...]
    train_steps: int
    warmup_steps: int
    sampler_images: int
    sampler_steps: int
    nca_image_size: int
    nca_batch: int
    nca_steps: int


FULL = Sizes(GPU_PRESET_32PX, (256, 512), 25, 5, 512, 50, 224, 32, 40)
# The smoke run: the same code paths with a generator and inputs small enough for a CI CPU.
SMOKE = Sizes(
    dataclasses.replace(GPU_PRESET_32PX, model_channels=16, channel_mult=(1, 2), num_blocks=1, attn_resolutions=(16,)),
    (4, 8), 3, 1, 4, 3, 32, 2, 3,
)
NUM_LABELS = 10


class DeviceClock:
    """Wall time with the device drained first, and its peak memory since the last reset (GB; None on CPU)."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gb(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None


def steady_rate(step_times: list[float], warmup: int, per_step: float) -> float:
    """Items per second over the steps after `warmup` (step_times[i] = when step i+1 ended)."""
    if len(step_times) <= warmup + 1:
        raise ValueError(f"need more than {warmup + 1} timed steps, got {len(step_times)}")
    return per_step * (len(step_times) - 1 - warmup) / (step_times[-1] - step_times[warmup])


def edm2_training(sizes: Sizes, batch: int, precision: str, clock: DeviceClock) -> dict:
    config = dataclasses.replace(sizes.generator, batch_size=batch, total_images=batch * sizes.train_steps)
    images = np.random.default_rng(0).random((2 * batch, 3, 32, 32), dtype=np.float32)
    step_ends: list[float] = []
    clock.reset_peak()
    model, _stats = train_generator(images, None, config, progress=lambda *_: step_ends.append(clock.now()),
                                    device=clock.device, precision=precision)
    return {"batch": batch, "precision": precision, "steps": sizes.train_steps,
            "images_per_s": steady_rate(step_ends, sizes.warmup_steps, batch), "peak_memory_gb": clock.peak_gb(),
            "model": model}


def sampler(sizes: Sizes, model, clock: DeviceClock) -> dict:
    sample(model, 2, steps=2, device=clock.device)  # warm-up
    clock.reset_peak()
    start = clock.now()
    sample(model, sizes.sampler_images, steps=sizes.sampler_steps, batch_size=sizes.sampler_images, device=clock.device)
    seconds = clock.now() - start
    return {"images": sizes.sampler_images, "heun_steps": sizes.sampler_steps,
            "network_evaluations_per_image": 2 * sizes.sampler_steps - 1,
            "images_per_s": sizes.sampler_images / seconds, "peak_memory_gb": clock.peak_gb()}


def fednca_resnet18(sizes: Sizes, clock: DeviceClock) -> dict:
    cfg = RunConfig.from_run_config({"method": "fednca", "model": "resnet18"})
    shape = (3, sizes.nca_image_size, sizes.nca_image_size)
    torch.manual_seed(0)
    model = build_model(cfg, NUM_LABELS, shape, etf=server_etf(cfg, NUM_LABELS, shape)).to(clock.device).train()
    total = sizes.nca_steps + sizes.warmup_steps + 1
    optimizer, scheduler = fednca_optimizer(model, total_steps=total)
    x = torch.rand((sizes.nca_batch, *shape), device=clock.device)
    y = (torch.rand((sizes.nca_batch, NUM_LABELS), device=clock.device) < 0.3).float()
    step_ends = []
    clock.reset_peak()
    for _ in range(total):
        loss = fednca_loss(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        step_ends.append(clock.now())
    return {"image_size": sizes.nca_image_size, "batch": sizes.nca_batch, "steps": sizes.nca_steps,
            "parameters": count_parameters(model), "steps_per_s": steady_rate(step_ends, sizes.warmup_steps, 1.0),
            "peak_memory_gb": clock.peak_gb()}


def run_checks(sizes: Sizes, device: torch.device, budget_s: float) -> dict:
    clock = DeviceClock(device)
    deadline = time.monotonic() + budget_s
    results: dict = {"edm2_training": [], "skipped": []}

    def within_budget(name: str, job: Callable[[], dict]) -> dict | None:
        if time.monotonic() > deadline:
            results["skipped"].append(name)
            return None
        return job()

    trained = None
    for batch in sizes.train_batches:
        for precision in ("fp32", "bf16"):
            row = within_budget(f"edm2 batch {batch} {precision}", lambda: edm2_training(sizes, batch, precision, clock))
            if row is not None:
                trained = row.pop("model")
                results["edm2_training"].append(row)
    if trained is not None:
        results["sampler"] = within_budget("sampler", lambda: sampler(sizes, trained, clock))
    results["fednca_resnet18"] = within_budget("fednca resnet18", lambda: fednca_resnet18(sizes, clock))
    results["edm2_parameters"] = count_parameters(build_generator(sizes.generator, "meta"))
    return results


def device_description(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(name=properties.name, memory_gb=properties.total_memory / 2**30, cuda=torch.version.cuda,
                    bf16_supported=torch.cuda.is_bf16_supported())
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (seconds): keeps the script working in CI")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no new measurement after this many s")
    args = parser.parse_args(argv)
    if args.smoke:
        device, sizes = torch.device("cpu"), SMOKE
        torch.set_num_threads(1)  # tiny tensors: thread hand-offs cost more than they save on a shared CI machine
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), FULL
    else:
        parser.error("no CUDA device: the full check needs one GPU (use --smoke to exercise the script on the CPU)")
    start = time.perf_counter()
    report = {"mode": "smoke" if args.smoke else "full", **device_description(device),
              **run_checks(sizes, device, args.budget_s)}
    report["wall_s"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
