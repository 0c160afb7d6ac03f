"""The FedNCA-ML search's diagnostics: the validation-chosen threshold, pooled BatchNorm statistics,
the federated average and the GroupNorm ablation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.fednca_search import (
    bench_options,
    federated_average,
    recalibrated_batchnorm,
    validation_threshold,
)
from fedskew.models import backbones


def test_the_threshold_is_the_grid_point_with_the_best_validation_macro_f1():
    # Two classes whose positives score 0.30-0.35 and negatives 0.10-0.22: 0.5 predicts nothing (macro-F1 0);
    # 0.25 is the only grid point in [0.22, 0.30), the one that separates both classes perfectly.
    labels = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    probs = np.array([[0.30, 0.10], [0.15, 0.35], [0.32, 0.31], [0.22, 0.22]])
    assert validation_threshold(labels, probs) == pytest.approx(0.25)


def test_recalibrated_batchnorm_holds_the_pooled_statistics_and_leaves_the_model_alone():
    norm = torch.nn.BatchNorm2d(2)
    model = torch.nn.Sequential(norm).eval()
    images = np.random.default_rng(0).normal(3.0, 2.0, size=(300, 2, 4, 4)).astype(np.float32)
    pooled = recalibrated_batchnorm(model, images, batch_size=100)
    stats = pooled[0]
    np.testing.assert_allclose(stats.running_mean.numpy(), images.mean(axis=(0, 2, 3)), rtol=1e-5)
    # Mean of three per-batch unbiased variances: within sampling error of the pooled variance (4).
    np.testing.assert_allclose(stats.running_var.numpy(), images.var(axis=(0, 2, 3)), rtol=0.02)
    assert not pooled.training
    assert torch.equal(norm.running_mean, torch.zeros(2))  # the original keeps its statistics


def test_federated_average_weights_by_example_count():
    updates = [({"w": torch.tensor([0.0, 4.0])}, {"num-examples": 1}),
               ({"w": torch.tensor([4.0, 0.0])}, {"num-examples": 3})]
    assert torch.allclose(federated_average(updates)["w"], torch.tensor([3.0, 1.0], dtype=torch.float64))


def test_groupnorm_option_swaps_the_small_cnn_norm_only_inside_the_block():
    with bench_options({"bench.norm": "group"}):
        inside = backbones.SmallCNN(1)
    outside = backbones.SmallCNN(1)
    assert any(isinstance(m, torch.nn.GroupNorm) for m in inside.modules())
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in inside.modules())
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in outside.modules())
    with pytest.raises(ValueError, match="bench.width"):
        with bench_options({"bench.width": 2}):
            pass
