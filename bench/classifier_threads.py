"""Does a FederatedFactory run's server classifier depend on the number of torch threads?

    python -m bench.classifier_threads --run RUN_DIR --threads 1,2

Retrains the server classifier of a finished `factory` run (its `config.json` and the synthetic set it
stored, `synthetic.safetensors`) once per torch thread count, with the run's recipe and seed, and
prints the test accuracy, the best epoch and the final training loss of each. The same seed and data
give the same model only at the same thread count: another count sums the same gradients in another
order, and the rounding grows over the epochs. This is how the in-process search
(`bench.factory_search`, one thread) and a Flower run (the server's threads) were found to part on
identical generators and synthetic sets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from fedskew.config import RunConfig, current_run_config
from fedskew.data.sites import load_task_dataset
from fedskew.factory.classifier import ClassifierRecipe, train_classifier
from fedskew.training import evaluate

SYNTHETIC_FILE = "synthetic.safetensors"


def retrain(cfg: RunConfig, images: torch.Tensor, labels: torch.Tensor, threads: int) -> dict:
    """Test metrics of the run's classifier recipe trained on (images, labels) with `threads` torch threads."""
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    num_classes = int(labels.max()) + 1
    model, stats = train_classifier(images.numpy(), labels.numpy(), num_classes, ClassifierRecipe.from_config(cfg),
                                    val_fraction=cfg.factory.classifier_val_fraction, seed=cfg.seed, device=device)  # fmt: skip
    test = load_task_dataset(cfg)
    metrics = evaluate(model, test.test_images, test.test_labels, device=device)
    return {"threads": threads, "accuracy": round(metrics["accuracy"], 4), "best_epoch": stats["best_epoch"],
            "train_loss": stats["train_loss"]}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished factory run's directory")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    args = parser.parse_args(argv)
    config_file, synthetic_file = args.run / "config.json", args.run / SYNTHETIC_FILE
    for path in (config_file, synthetic_file):
        if not path.is_file():
            parser.error(f"--run {args.run}: no {path.name}; give the directory of a finished factory run")
    cfg = RunConfig.from_run_config(current_run_config(json.loads(config_file.read_text())))
    synthetic = load_file(synthetic_file)
    for threads in (int(t) for t in args.threads.split(",")):
        print(json.dumps(retrain(cfg, synthetic["images"], synthetic["labels"], threads)), flush=True)


if __name__ == "__main__":
    main()
