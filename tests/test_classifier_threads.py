import json

import pytest
import torch
from safetensors.torch import save_file

from bench.classifier_threads import SYNTHETIC_FILE, main, rule_picks
from fedskew.config import RunConfig
from fedskew.data.pixels import unit_float
from fedskew.data.sources import load_source


def finished_run(directory, epochs: int = 2):
    """A factory run's folder as the server leaves it: its config and the synthetic set it trained on (here
    the real 8 px digits stand in for synthetic ones)."""
    cfg = RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "classes-per-site",
                                    "factory.classifier-epochs": epochs})
    (directory / "config.json").write_text(json.dumps(cfg.to_run_config()))
    digits = load_source("digits", data_root="", image_size=8, allow_download=False, seed=0)
    save_file({"images": torch.from_numpy(unit_float(digits.train_images)).contiguous(),
               "labels": torch.from_numpy(digits.train_labels).long()}, str(directory / SYNTHETIC_FILE))


def test_the_same_thread_count_retrains_the_same_classifier(tmp_path, capsys):
    finished_run(tmp_path)
    main(["--run", str(tmp_path), "--threads", "1,1"])
    first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert first.pop("seconds_per_epoch") > 0 and second.pop("seconds_per_epoch") > 0  # wall time differs run to run
    assert first == second and first["threads"] == 1
    # Two epochs on 1,437 real digits: far above the 0.1 of a model that learnt nothing.
    assert first["accuracy"] > 0.5 and 1 <= first["best_epoch"] <= 2
    assert 0.0 <= first["lowest_recall"] <= first["accuracy"]  # the lowest recall is at most the mean recall


def test_a_folder_that_is_not_a_finished_factory_run_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["--run", str(tmp_path)])
    assert f"--run {tmp_path}: no {SYNTHETIC_FILE}" in capsys.readouterr().err


def test_by_epoch_records_every_epoch_and_each_rule_picks_from_them(tmp_path, capsys):
    finished_run(tmp_path, epochs=3)
    main(["--synthetic", str(tmp_path / SYNTHETIC_FILE), "--run-config",
          "mosaic-grid=0 partition='classes-per-site' factory.classifier-epochs=3", "--threads", "1", "--by-epoch"])
    [result] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    epochs = result["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    # The library's own rule is one of the reported ones, and the model it returned is that epoch's.
    now = result["rules"]["best-accuracy-then-likelihood"]
    assert now["epoch"] == result["best_epoch"] and now["test_accuracy"] == pytest.approx(result["accuracy"], abs=1e-4)
    assert result["rules"]["last"] == epochs[-1]
    assert result["rules"]["lowest-loss"]["holdout_nll"] == min(e["holdout_nll"] for e in epochs)


def test_the_sampling_error_rule_ties_accuracies_one_image_apart_on_300_and_not_two():
    # 300 held-out images, the best 299 right: the standard error of a difference of two accuracies there is
    # sqrt(2 * 299/300 * 1/300 / 300) = 1.41 images, so 298 right ties with it and 297 does not.
    scores = [(297, 0.05), (299, 0.04), (298, 0.02), (297, 0.01)]  # (images right, held-out NLL) per epoch
    epochs = [{"holdout_accuracy": right / 300, "holdout_nll": nll, "holdout_size": 300} for right, nll in scores]
    picks = rule_picks(epochs)
    assert picks["first-best-accuracy"] == picks["best-accuracy-then-likelihood"] == 1
    assert picks["within-sampling-error-then-likelihood"] == 2  # the likelier of the two within one image
    assert picks["lowest-loss"] == picks["last"] == 3
    # A perfect best accuracy has no sampling error: only perfect epochs tie.
    perfect = [{"holdout_accuracy": a, "holdout_nll": n, "holdout_size": 300} for a, n in [(1.0, 0.2), (299 / 300, 0.1)]]
    assert rule_picks(perfect)["within-sampling-error-then-likelihood"] == 0
