import json

import pytest
import torch
from safetensors.torch import save_file

from bench.classifier_threads import SYNTHETIC_FILE, main
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
    assert first == second and first["threads"] == 1
    # Two epochs on 1,437 real digits: far above the 0.1 of a model that learnt nothing.
    assert first["accuracy"] > 0.5 and 1 <= first["best_epoch"] <= 2


def test_a_folder_that_is_not_a_finished_factory_run_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["--run", str(tmp_path)])
    assert f"--run {tmp_path}: no {SYNTHETIC_FILE}" in capsys.readouterr().err
