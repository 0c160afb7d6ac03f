"""Does a FederatedFactory generator learn one class of a dataset at all, and what would it take?

    python -m bench.generator_probe --dataset shapes --image-size 16 --class-id 2 --steps 400,1600 --channels 16,32 --out OUT
    python -m bench.generator_probe --dataset shapes --image-size 16 --class-id 2 --steps 400 --channels 16 --grey --out OUT

Trains the CPU preset's generator for `--image-size` on one class's real training images (as one site
holding that class would: the first `--images` of them), for every combination of `--steps` and
`--channels` (the UNet's first-level channels; the preset has 16), draws 64 images with the
16-step sampler and writes OUT/<dataset>-<side>px-class<id>-<steps>steps-<channels>ch[-grey].png (synthetic
images left, real ones right) and a line in OUT/probe.jsonl: training seconds, and the class's FD
against its real test images in the features of a small CNN trained on the real training split, beside
the floor (real training images against the same test images). `--grey` averages the colour channels
first (is it colour or texture the generator misses?); `--dataset flat` is the control: 180 images of
one random colour each, which any working generator reproduces. (`bench.generator` is the 8 px digits
benchmark of the preset itself, with a pixel-space classifier and a memorisation check; this probe asks
what budget another dataset and image size need.)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedskew.data.pixels import unit_float  # noqa: E402
from fedskew.data.sources import load_source  # noqa: E402
from fedskew.factory.library import tile  # noqa: E402
from fedskew.fidelity import class_fidelity, classifier_features  # noqa: E402
from fedskew.models.edm2 import budgeted_for_class, cpu_preset, sample, train_generator  # noqa: E402
from fedskew.training import pick_device  # noqa: E402

SAMPLES = 64
SAMPLER_STEPS = 16


def flat_colours(count: int, side: int, seed: int) -> np.ndarray:
    """The control set: `count` RGB images, each one uniform random colour."""
    colours = np.random.default_rng(seed).uniform(0.1, 0.9, (count, 3, 1, 1))
    return np.broadcast_to(colours, (count, 3, side, side)).astype(np.float32).copy()


def probe(class_images: np.ndarray, side: int, steps: int, channels: int, overrides: dict[str, float],
          seed: int) -> tuple[np.ndarray, float]:
    """(64 synthetic images, training seconds) of the preset generator widened to `channels`, trained `steps` steps,
    with the GeneratorConfig fields in `overrides` (P_mean: its training noise levels centred on exp(P_mean);
    ref_lr: its reference learning rate) replaced."""
    config = dataclasses.replace(cpu_preset(side), img_channels=class_images.shape[1], model_channels=channels, seed=seed,
                                 **overrides)
    config = budgeted_for_class(config, len(class_images), steps * config.batch_size)
    start = time.perf_counter()
    net, _ = train_generator(class_images, None, config, progress=None)
    seconds = time.perf_counter() - start
    return sample(net, SAMPLES, steps=SAMPLER_STEPS, seed=seed + 1), seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True, help="a generated or bundled dataset name, or 'flat' (the control)")
    parser.add_argument("--image-size", type=int, required=True)
    parser.add_argument("--class-id", type=int, default=0)
    parser.add_argument("--images", type=int, default=180, help="real training images of the class (a site's holding)")
    parser.add_argument("--steps", default="400", help="comma-separated generator steps (batch 64)")
    parser.add_argument("--channels", default="16", help="comma-separated first-level UNet channels")
    parser.add_argument("--p-mean", default="", help="comma-separated log-sigma centres of the training noise "
                        "(EDM2's P_mean; empty: the preset's); higher spends more steps on coarse structure")
    parser.add_argument("--ref-lr", default="", help="comma-separated reference learning rates (empty: the preset's "
                        "0.01); the lr ramps up to it and decays as 1/sqrt(t) after t_ref as in EDM2")
    parser.add_argument("--grey", action="store_true", help="average the colour channels first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    device = pick_device("auto")
    if args.dataset == "flat":
        class_images, real, name = flat_colours(args.images, args.image_size, args.seed), None, f"flat-{args.image_size}px"
    else:
        real = load_source(args.dataset, data_root="", image_size=args.image_size, allow_download=False, seed=args.seed)
        real = dataclasses.replace(real, train_images=unit_float(real.train_images), test_images=unit_float(real.test_images))
        if args.grey:
            real = dataclasses.replace(real, train_images=real.train_images.mean(1, keepdims=True),
                                       test_images=real.test_images.mean(1, keepdims=True))
        class_images = real.train_images[real.train_labels == args.class_id][: args.images]
        name = f"{args.dataset}-{args.image_size}px-class{args.class_id}"
    if len(class_images) < 2:
        parser.error(f"--class-id {args.class_id}: {len(class_images)} training images in {args.dataset}; need >= 2")
    features = None if real is None else classifier_features(
        real.train_images, real.train_labels, int(real.train_labels.max()) + 1, args.seed, device)
    swept = {field: [float(v) for v in values.split(",")] for field, values in (("P_mean", args.p_mean), ("ref_lr", args.ref_lr))
             if values}
    override_sets = [dict(zip(swept, values)) for values in itertools.product(*swept.values())]
    preset = cpu_preset(args.image_size)
    args.out.mkdir(parents=True, exist_ok=True)
    for steps in (int(s) for s in args.steps.split(",")):
        for channels, overrides in itertools.product((int(c) for c in args.channels.split(",")), override_sets):
            synthetic, seconds = probe(class_images, args.image_size, steps, channels, overrides, args.seed)
            label = (f"{name}-{steps}steps-{channels}ch" + ("" if "P_mean" not in overrides else f"-pmean{overrides['P_mean']:g}")
                     + ("" if "ref_lr" not in overrides else f"-lr{overrides['ref_lr']:g}") + ("-grey" if args.grey else ""))
            grid = np.concatenate([tile(synthetic, columns=8), tile(class_images[:SAMPLES], columns=8)], axis=1)
            plt.imsave(args.out / f"{label}.png", grid.clip(0, 1), cmap="gray", vmin=0, vmax=1)
            record = {"probe": label, "dataset": args.dataset, "image_size": args.image_size, "class_id": args.class_id,
                      "grey": args.grey, "steps": steps, "channels": channels,
                      "P_mean": overrides.get("P_mean", preset.P_mean), "ref_lr": overrides.get("ref_lr", preset.ref_lr), "train_seconds": round(seconds, 1),
                      "within_image_std": {"synthetic": float(synthetic.std(axis=(2, 3)).mean()),
                                           "real": float(class_images.std(axis=(2, 3)).mean())}}
            if features is not None:
                test = real.test_images[real.test_labels == args.class_id]
                fid = class_fidelity(features, synthetic, class_images, test, args.seed)
                record.update(fd=fid.get("fd"), fd_floor=fid.get("fd_floor"))
            with open(args.out / "probe.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record))


if __name__ == "__main__":
    main()
