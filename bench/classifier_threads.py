"""Does a FederatedFactory run's server classifier depend on the number of torch threads, and which epoch should it keep?

    python -m bench.classifier_threads --run RUN_DIR --threads 1,2
    python -m bench.classifier_threads --synthetic SET.safetensors --run-config "..." --threads 1 --by-epoch

Retrains the server classifier of a finished `factory` run (its `config.json` and the synthetic set it
stored, `synthetic.safetensors`) once per torch thread count, with the run's recipe and seed, and
prints the test accuracy, the lowest per-class recall, the best epoch, the final training loss and the
wall seconds per epoch trained of each. The same seed and data give the same model only at the same thread count: another count sums the
same gradients in another order, and the rounding grows over the epochs. This is how the in-process
search (`bench.factory_search`, one thread) and a Flower run (the server's threads) were found to part
on identical generators and synthetic sets.

`--synthetic` and `--run-config` name a stored synthetic set and its run config instead of a run folder
(`bench.factory_search` caches its sets beside its generators). `--by-epoch` also scores every epoch's
model on the sites' real validation splits (the union of the simulated sites' `val` images) and on the
test split, and prints which epoch each selection rule keeps: the first with the best held-out accuracy
(the rule before), the best accuracy then likelihood (`holdout_score`, the rule now), the likeliest of the
epochs within the hold-out's sampling error of the best accuracy, the lowest held-out loss, and the last
epoch. The real validation images judge the rules; the test split is only reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from safetensors.torch import load_file

import fedskew.factory.classifier as classifier_module
from bench.compare import parse_run_config
from fedskew.config import RunConfig, current_run_config
from fedskew.data.sites import load_task_dataset, simulated_site
from fedskew.factory.classifier import ClassifierRecipe, train_classifier
from fedskew.training import evaluate

SYNTHETIC_FILE = "synthetic.safetensors"


def retrain(cfg: RunConfig, images: torch.Tensor, labels: torch.Tensor, threads: int, by_epoch: bool = False,
            num_sites: int = 10) -> dict:
    """Test metrics of the run's classifier recipe trained on (images, labels) with `threads` torch threads;
    with `by_epoch`, every epoch's held-out score, real validation and test accuracy, and the rules' picks."""
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    num_classes = int(labels.max()) + 1
    test = load_task_dataset(cfg)
    epochs: list[dict] = []
    recording = contextlib.nullcontext()
    if by_epoch:
        sites = [simulated_site(cfg, k, num_sites) for k in range(num_sites)]
        real_val = np.concatenate([s.val_images for s in sites]), np.concatenate([s.val_labels for s in sites])
        score = classifier_module.holdout_score

        def recording_score(model, images, labels, *rest):  # the library's score, plus what the rules are judged on
            accuracy, log_likelihood = score(model, images, labels, *rest)
            epochs.append({"epoch": len(epochs) + 1, "holdout_accuracy": accuracy, "holdout_nll": -log_likelihood,
                           "holdout_size": len(labels),
                           "real_val_accuracy": evaluate(model, *real_val, device=device)["accuracy"],
                           "test_accuracy": evaluate(model, test.test_images, test.test_labels, device=device)["accuracy"]})
            return accuracy, log_likelihood

        recording = mock.patch.object(classifier_module, "holdout_score", recording_score)
    start = time.perf_counter()
    with recording:
        model, stats = train_classifier(images.numpy(), labels.numpy(), num_classes, ClassifierRecipe.from_config(cfg),
                                        val_fraction=cfg.factory.classifier_val_fraction, seed=cfg.seed, device=device)  # fmt: skip
    seconds_per_epoch = (time.perf_counter() - start) / stats["last_epoch"]  # with --by-epoch, its scoring too
    metrics = evaluate(model, test.test_images, test.test_labels, device=device)
    result = {"threads": threads, "accuracy": round(metrics["accuracy"], 4),
              "lowest_recall": round(min(metrics["per_class_recall"]), 4), "best_epoch": stats["best_epoch"],
              "train_loss": stats["train_loss"],
              "seconds_per_epoch": round(seconds_per_epoch, 3)}
    if by_epoch:
        result["rules"] = {name: epochs[index] for name, index in rule_picks(epochs).items()}
        result["epochs"] = epochs
    return result


def rule_picks(epochs: list[dict]) -> dict[str, int]:
    """Index of the epoch each selection rule keeps. "within-sampling-error-then-likelihood" treats accuracies
    within one standard error of a difference of two accuracies on the n held-out images, sqrt(2 a (1 - a) / n)
    at the best accuracy a, as ties and keeps the likeliest of them: on 300 images at 0.9967 that is 1.4 images,
    so one image's difference ties and two do not."""
    order = range(len(epochs))
    accuracy = [e["holdout_accuracy"] for e in epochs]
    nll = [e["holdout_nll"] for e in epochs]
    best = max(accuracy)
    standard_error = math.sqrt(2 * best * (1 - best) / epochs[0]["holdout_size"])
    within = [i for i in order if accuracy[i] >= best - standard_error]
    return {
        "first-best-accuracy": max(order, key=lambda i: (accuracy[i], -i)),
        "best-accuracy-then-likelihood": max(order, key=lambda i: (accuracy[i], -nll[i])),
        "within-sampling-error-then-likelihood": min(within, key=lambda i: nll[i]),
        "lowest-loss": min(order, key=lambda i: nll[i]),
        "last": len(epochs) - 1,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a finished factory run's directory")
    parser.add_argument("--synthetic", type=Path, help="a stored synthetic set, instead of --run")
    parser.add_argument("--run-config", default="", help="with --synthetic: its run config (key=value pairs)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--by-epoch", action="store_true", help="score every epoch and report each rule's pick")
    args = parser.parse_args(argv)
    if (args.run is None) == (args.synthetic is None):
        parser.error("give --run (a finished factory run's directory) or --synthetic with --run-config")
    if args.run is not None:
        config_file, synthetic_file = args.run / "config.json", args.run / SYNTHETIC_FILE
        for path in (config_file, synthetic_file):
            if not path.is_file():
                parser.error(f"--run {args.run}: no {path.name}; give the directory of a finished factory run")
        run_config = current_run_config(json.loads(config_file.read_text()))
    else:
        synthetic_file = args.synthetic
        if not synthetic_file.is_file():
            parser.error(f"--synthetic {synthetic_file}: no such file")
        run_config = {"method": "factory", **parse_run_config(args.run_config)}
    cfg = RunConfig.from_run_config(run_config)
    synthetic = load_file(synthetic_file)
    for threads in (int(t) for t in args.threads.split(",")):
        print(json.dumps(retrain(cfg, synthetic["images"], synthetic["labels"], threads, args.by_epoch)), flush=True)


if __name__ == "__main__":
    main()
