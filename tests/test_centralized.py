"""The centralised bound trains the model, losses and optimiser of the method it bounds."""

from __future__ import annotations

import pytest
import torch

from fedskew.client_tasks import local_optimisation
from fedskew.config import ConfigError, RunConfig
from fedskew.data.sites import load_task_dataset
from fedskew.metrics import THRESHOLD_GRID
from fedskew.models.backbones import Classifier
from fedskew.models.build import build_model, server_etf
from fedskew.models.fednca import FedNCAModel
from fedskew.server_tasks import train_centralized


class RecordingRecorder:
    """Stands in for RunRecorder: keeps what train_centralized records, writes nothing."""

    def __init__(self):
        self.rounds, self.checkpoints, self.thresholds, self.val, self.extra = {}, {}, {}, {}, {}

    def record_round(self, server_round, test, train=None, val=None, server_val=None, threshold=None):
        self.rounds[server_round], self.val[server_round], self.thresholds[server_round] = test, val, threshold

    def save_checkpoint(self, state_dict, server_round=None, threshold=None):
        self.checkpoints[server_round] = state_dict


def _model_and_optimiser(run_config: dict):
    cfg = RunConfig.from_run_config(run_config)
    data = load_task_dataset(cfg)
    etf = server_etf(cfg, data.num_classes, data.image_shape) if cfg.fednca_model else None
    model = build_model(cfg, data.num_classes, data.image_shape, etf=etf)
    return model, local_optimisation(cfg, model, steps_per_round=10, server_round=1, augment_seed=0)


def test_centralized_on_multi_label_data_trains_fednca_models_losses_and_adamw_schedule():
    model, (optimizer, scheduler, loss_fn) = _model_and_optimiser(
        {"method": "centralized", "local-epochs": 1, "fednca.warmup-epochs": 2}
    )
    assert isinstance(model, FedNCAModel)
    assert isinstance(optimizer, torch.optim.AdamW) and scheduler is not None
    # Epochs of 10 steps, warm-up 2 epochs = 20 steps: the first step runs at lr / 20.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(RunConfig().fednca.lr / 20)
    assert loss_fn.func.__name__ == "fednca_loss"


def test_the_linear_head_bound_stays_available_and_is_the_default_on_single_label_data():
    for run_config in ({"method": "centralized", "centralized-model": "linear"},
                       {"method": "centralized", "mosaic-grid": 0, "partition": "iid"}):
        model, (optimizer, scheduler, _) = _model_and_optimiser(run_config)
        assert isinstance(model, Classifier) and isinstance(optimizer, torch.optim.SGD) and scheduler is None
    with pytest.raises(ConfigError, match="centralized-model"):
        RunConfig.from_run_config({"method": "centralized", "centralized-model": "fednca", "mosaic-grid": 0,
                                   "partition": "iid"})


def test_train_centralized_records_every_round_of_the_fednca_model():
    # A 40 % validation share keeps the pooled training set small: this is a cheap unit test.
    cfg = RunConfig.from_run_config({"method": "centralized", "num-server-rounds": 2, "local-epochs": 1, "val-fraction": 0.4})
    data = load_task_dataset(cfg)
    recorder = RecordingRecorder()
    torch.manual_seed(cfg.seed)  # as the ServerApp does before building any model
    train_centralized(cfg, data, 2, torch.device("cpu"), recorder)
    assert sorted(recorder.rounds) == [0, 1, 2] and sorted(recorder.checkpoints) == [1, 2]
    assert any(key.startswith("ladm.attention") for key in recorder.checkpoints[2])
    assert recorder.rounds[2]["f1_macro"] > recorder.rounds[0]["f1_macro"]
    # Each trained round's threshold is chosen on the pooled validation splits, never left at None.
    assert all(recorder.thresholds[r] in THRESHOLD_GRID for r in (1, 2))
    assert recorder.extra["threshold_chosen_by"].startswith("the sites' validation splits")
    assert recorder.val[2]["val_f1_macro"] >= recorder.val[2]["val_f1_macro_at_0.5"]  # the best of a grid holding 0.5


def test_the_sgd_bound_decays_its_learning_rate_to_zero_over_the_whole_run(monkeypatch):
    # At a constant rate the SGD bound's last epochs swung by many points (0.98 at its selected epoch, 0.82 at
    # the last on 28 px digit silos), so a final-round bound could read below the method it bounds. Its rate
    # must fall along one cosine over every step of the run: lower after each round, 0 after the last.
    import fedskew.server_tasks as server_tasks

    rates, real_train_local = [], server_tasks.train_local

    def recording_train_local(model, loader, *, optimizer, scheduler, **kwargs):
        rates.append((optimizer.param_groups[0]["lr"], scheduler is not None))
        return real_train_local(model, loader, optimizer=optimizer, scheduler=scheduler, **kwargs)

    monkeypatch.setattr(server_tasks, "train_local", recording_train_local)
    cfg = RunConfig.from_run_config({"method": "centralized", "mosaic-grid": 0, "partition": "iid",
                                     "num-server-rounds": 3, "local-epochs": 1, "val-fraction": 0.4})
    recorder = RecordingRecorder()
    optimizers = []
    real_local_optimisation = server_tasks.local_optimisation
    monkeypatch.setattr(server_tasks, "local_optimisation",
                        lambda *a, **k: optimizers.append(real_local_optimisation(*a, **k)) or optimizers[-1])
    train_centralized(cfg, load_task_dataset(cfg), 2, torch.device("cpu"), recorder)
    assert isinstance(optimizers[0][0], torch.optim.SGD) and optimizers[0][1] is None  # the SGD model's own setup
    assert [has_scheduler for _, has_scheduler in rates] == [True] * 3
    start = [lr for lr, _ in rates]
    assert start[0] == pytest.approx(cfg.lr) and start[0] > start[1] > start[2] > 0
    assert optimizers[0][0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # after the run's last step
