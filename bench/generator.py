"""Benchmark: train the CPU-preset EDM2 generator on one sklearn `digits` class and judge its samples.

    python -m bench.generator [--digit 3 [5 ...]] [--seed 0] [--steps 400] [--samples 1000] [--out DIR]

Per digit it reports
  (1) the share of samples that a logistic-regression classifier trained on real digits assigns to that digit;
  (2) the Frechet distance in that classifier's 10-d decision-function space between samples and the real
      held-out images of the digit, next to real-train vs real-held-out (the floor a perfect generator
      would reach with these set sizes);
  (2b) FD and KID in the pooled penultimate features of a small CNN trained on the real training digits, and
      with --inception-weights also in Inception-v3 features (FID/KID), each next to its real-vs-real floor
      (a real training subset of the same size against the same held-out images; fedskew.fidelity);
  (3) memorisation: the share of samples whose nearest training image is closer than 1/3 of the distance
      to the nearest held-out image (pixel space, L2);
  (4) training and sampling throughput; (5) peak resident memory of the process; (6) a sample grid PNG.
It also reports the parameter count of the 32 px GPU preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split

from fedskew.fidelity import class_fidelity, classifier_features, frechet_distance, inception_features
from fedskew.models.edm2 import CPU_PRESET, GPU_PRESET_32PX, build_generator, count_parameters, sample, train_generator

MEMORISATION_RATIO = 1 / 3
SAMPLER_STEPS = 32
DEFAULT_OUT = Path("bench/results/generator")


def load_digit_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """sklearn digits as (N, 1, 8, 8) float32 in [0, 1], seeded stratified 80/20 split."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    return train_test_split(images, digits.target, test_size=0.2, stratify=digits.target, random_state=seed)


def nearest_distances(queries: np.ndarray, references: np.ndarray) -> np.ndarray:
    q, r = queries.reshape(len(queries), -1), references.reshape(len(references), -1)
    squared = (q**2).sum(1)[:, None] + (r**2).sum(1)[None, :] - 2 * q @ r.T
    return np.sqrt(np.maximum(squared, 0).min(axis=1))


def save_grid(samples: np.ndarray, real: np.ndarray, digit: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def tile(images: np.ndarray, columns: int) -> np.ndarray:
        rows = len(images) // columns
        grid = images[: rows * columns, 0].reshape(rows, columns, 8, 8)
        return np.pad(grid, ((0, 0), (0, 0), (1, 1), (1, 1))).transpose(0, 2, 1, 3).reshape(rows * 10, columns * 10)

    figure, axes = plt.subplots(1, 2, figsize=(9, 4.8))
    for axis, images, title in ((axes[0], real[:40], "real (train)"), (axes[1], samples[:100], "generated")):
        axis.imshow(tile(images, 10 if len(images) >= 100 else 8), cmap="gray_r", vmin=0, vmax=1)
        axis.set_title(f"digit {digit}: {title}")
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def benchmark_digit(digit: int, steps: int, n_samples: int, seed: int, split, classifier, feature_spaces: dict,
                    out: Path) -> dict:
    x_train, x_test, y_train, y_test = split
    class_train, class_test = x_train[y_train == digit], x_test[y_test == digit]
    config = dataclasses.replace(CPU_PRESET, total_images=steps * CPU_PRESET.batch_size, seed=seed)
    print(f"digit {digit}: training on {len(class_train)} images for {config.total_steps} steps", flush=True)
    model, stats = train_generator(class_train, None, config, device=torch.device("cpu"))

    start = time.perf_counter()
    samples = sample(model, n_samples, steps=SAMPLER_STEPS, seed=seed, batch_size=n_samples)
    sample_seconds = time.perf_counter() - start

    def features(images: np.ndarray) -> np.ndarray:
        return classifier.decision_function(images.reshape(len(images), -1))

    def share(images: np.ndarray) -> float:
        return float((classifier.predict(images.reshape(len(images), -1)) == digit).mean())

    ratio = nearest_distances(samples, class_train) / nearest_distances(samples, class_test)
    grid_path = out / f"samples_digit{digit}.png"
    save_grid(samples, class_train, digit, grid_path)
    return {
        "digit": digit,
        "train_images": len(class_train),
        "heldout_images": len(class_test),
        "steps": stats.steps,
        "images_seen": stats.images_seen,
        "train_seconds": stats.wall_time_s,
        "train_images_per_s": stats.images_per_s,
        "samples": n_samples,
        "sampler_steps": SAMPLER_STEPS,
        "sample_seconds": sample_seconds,
        "sample_images_per_s": n_samples / sample_seconds,
        "class_share_samples": share(samples),
        "class_share_real_heldout": share(class_test),
        "frechet_samples_vs_heldout": frechet_distance(features(samples), features(class_test)),
        "frechet_train_vs_heldout": frechet_distance(features(class_train), features(class_test)),
        **{f"{space}_{key}": value for space, feature_fn in feature_spaces.items()
           for key, value in class_fidelity(feature_fn, samples, class_train, class_test, seed).items()},
        "memorised_share": float((ratio < MEMORISATION_RATIO).mean()),
        "median_nearest_ratio": float(np.median(ratio)),
        "final_loss_mean_last_10pct": float(np.mean(stats.loss_curve[-max(len(stats.loss_curve) // 10, 1):])),
        "grid_png": grid_path.name,
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| digit | train imgs | steps | class share (samples) | class share (real held-out) | FD samples vs held-out"
        " | FD train vs held-out (floor) | CNN FD (floor) | CNN KID (floor) | memorised | median NN ratio | train s"
        " | train img/s | sample img/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['digit']} | {r['train_images']} | {r['steps']} | {100 * r['class_share_samples']:.1f}% "
            f"| {100 * r['class_share_real_heldout']:.1f}% | {r['frechet_samples_vs_heldout']:.2f} "
            f"| {r['frechet_train_vs_heldout']:.2f} | {r['classifier_fd']:.3g} ({r['classifier_fd_floor']:.3g}) "
            f"| {r['classifier_kid']:.3g} ({r['classifier_kid_floor']:.3g}) | {100 * r['memorised_share']:.1f}% "
            f"| {r['median_nearest_ratio']:.2f} | {r['train_seconds']:.0f} | {r['train_images_per_s']:.0f} "
            f"| {r['sample_images_per_s']:.1f} |"
        )
    return "\n".join(lines)


def readme_section(command: str, results: dict, table: str) -> str:
    return f"""### EDM2 generator benchmark (CPU preset, sklearn digits)

Trains `CPU_PRESET` (8 px, 16 channels, mult [1, 2], 2 blocks, attention at 4 px, batch 64) from scratch on
the training images of one digit class (seeded stratified 80/20 split of sklearn `digits`), then draws
{results['samples']} samples with the {SAMPLER_STEPS}-step deterministic Heun sampler.

    {command}

{table}

- class share: fraction of samples that a logistic-regression classifier trained on all real training digits
  (held-out accuracy {100 * results['classifier_heldout_accuracy']:.1f}%) assigns to the digit; target >= 90%.
- FD: Frechet distance in that classifier's 10-d decision-function space against the real held-out images of
  the digit; "floor" is the same distance for the real training images, which a perfect generator would match.
- CNN FD / KID: Frechet distance and KID in the pooled penultimate features of a small CNN trained on the real
  training digits (10 epochs), samples vs the held-out images of the digit; in brackets the floor, a real
  training subset of the same size against the same held-out images.
- memorised: share of samples whose nearest training image (pixel L2) is closer than 1/3 of the distance to
  the nearest held-out image; median NN ratio = median of nearest-train / nearest-held-out distance.
- peak memory (ru_maxrss, whole process): {results['peak_rss_mb']:.0f} MB; torch threads: {results['torch_threads']}.
- throughput depends on what else runs: this run's 1-minute load average was {results['load_average_1min'][0]:.1f}
  at the start and {results['load_average_1min'][1]:.1f} at the end ({results['cpu_count']} CPUs).
- GPU preset (`GPU_PRESET_32PX`, 3 x 32 px, C 128, mult [1,2,2,2], 3 blocks, attention at 16 and 8):
  {results['gpu_preset_parameters']:,} parameters ({results['gpu_preset_parameters'] * 4 / 1e6:.1f} MB fp32).
"""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--digit", type=int, nargs="+", default=[3], help="digit class(es) 0-9")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=CPU_PRESET.total_steps, help="training steps of batch 64")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 on a shared machine)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--inception-weights", default="", help="local FID Inception-v3 weights file: adds Inception FID/KID")
    args = parser.parse_args(argv)
    if any(not 0 <= d <= 9 for d in args.digit):
        parser.error(f"--digit must be in 0-9, got {args.digit}")

    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    split = load_digit_split(args.seed)
    x_train, x_test, y_train, y_test = split
    classifier = LogisticRegression(max_iter=5000).fit(x_train.reshape(len(x_train), -1), y_train)
    heldout_accuracy = float(classifier.score(x_test.reshape(len(x_test), -1), y_test))
    print(f"logistic regression on real digits: held-out accuracy {100 * heldout_accuracy:.1f}%", flush=True)

    feature_spaces = {"classifier": classifier_features(x_train, y_train, 10, args.seed, torch.device("cpu"))}
    if args.inception_weights:
        feature_spaces["inception"] = inception_features(args.inception_weights, torch.device("cpu"))
    rows = [benchmark_digit(d, args.steps, args.samples, args.seed, split, classifier, feature_spaces, args.out)
            for d in args.digit]
    command = "python -m bench.generator " + " ".join(
        [f"--digit {' '.join(map(str, args.digit))}", f"--seed {args.seed}", f"--steps {args.steps}",
         f"--samples {args.samples}", f"--threads {args.threads}"]
    )
    results = {
        "command": command,
        "seed": args.seed,
        "samples": args.samples,
        "torch_threads": args.threads,
        "classifier": "LogisticRegression(max_iter=5000) on 64 raw pixels, real training split",
        "classifier_heldout_accuracy": heldout_accuracy,
        "memorisation_rule": f"nearest-train distance < {MEMORISATION_RATIO:.3f} x nearest-held-out distance",
        "load_average_1min": [load_at_start, os.getloadavg()[0]],
        "cpu_count": os.cpu_count(),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gpu_preset_parameters": count_parameters(build_generator(GPU_PRESET_32PX, "meta")),
        "per_digit": rows,
    }
    table = markdown_table(rows)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text(table + "\n")
    (args.out / "README-section.md").write_text(readme_section(command, results, table))
    print(table)
    print(f"peak RSS {results['peak_rss_mb']:.0f} MB; GPU preset {results['gpu_preset_parameters']:,} parameters")
    print(f"wrote {args.out}/results.json, results.md, README-section.md and the sample grid(s)")
    return results


if __name__ == "__main__":
    main()
