"""Generator fidelity metrics: FD and KID on hand-made feature sets, and the per-class report
separating a real-like synthetic set from noise in a classifier's features."""

import math

import numpy as np
import pytest
import torch

from fedskew.config import RunConfig
from fedskew.data.sites import load_task_dataset
from fedskew.fidelity import frechet_distance, generator_fidelity, inception_features, kernel_inception_distance


def test_frechet_distance_by_hand():
    # 1-d: means 1 and 3, sample variances 2 and 8 -> (1 - 3)^2 + 2 + 8 - 2 sqrt(2 * 8) = 6
    assert frechet_distance(np.array([[0.0], [2.0]]), np.array([[1.0], [5.0]])) == pytest.approx(6.0)
    same = np.random.default_rng(0).normal(size=(50, 3))
    assert frechet_distance(same, same) == pytest.approx(0.0, abs=1e-6)


def test_kid_by_hand():
    # d = 1, k(x, y) = (x y + 1)^3; a = b = {0, 1}: K = [[1, 1], [1, 8]]
    # off-diagonal means 1 and 1, cross mean (1 + 1 + 1 + 8) / 4 -> 1 + 1 - 2 * 11/4 = -3.5
    a = np.array([[0.0], [1.0]])
    assert kernel_inception_distance(a, a) == pytest.approx(-3.5)
    with pytest.raises(ValueError, match=">= 2 feature rows"):
        kernel_inception_distance(a[:1], a)



def test_per_class_report_separates_real_like_samples_from_noise(tmp_path):
    real = load_task_dataset(RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "iid"}))
    rng = np.random.default_rng(0)
    keep = np.isin(real.train_labels, [0, 1])
    real_like = real.train_images[keep]
    noise = rng.random(real_like.shape, dtype=np.float32)
    images = np.concatenate([real_like[real.train_labels[keep] == 0], noise[real.train_labels[keep] == 1]])
    labels = np.concatenate([np.zeros((real.train_labels[keep] == 0).sum(), int), np.ones((real.train_labels[keep] == 1).sum(), int)])
    report = generator_fidelity(images, labels, real, seed=0, device=torch.device("cpu"), tsne_path=tmp_path / "tsne.png")
    assert (tmp_path / "tsne.png").stat().st_size > 10_000
    per_class = report["classifier"]["per_class"]
    assert set(per_class) == {real.class_names[0], real.class_names[1]}
    real_row, noise_row = per_class[real.class_names[0]], per_class[real.class_names[1]]
    # class 0's "synthetic" images are real training images: the same distribution as the floor's
    assert noise_row["fd"] > 5 * max(real_row["fd"], real_row["fd_floor"])
    assert noise_row["kid"] > 5 * max(real_row["kid"], real_row["kid_floor"])
    assert math.isclose(report["classifier"]["class_mean"]["fd"], (real_row["fd"] + noise_row["fd"]) / 2)


def test_inception_weights_path_must_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="factory.inception-weights = .*missing.pth.*no such file"):
        inception_features(str(tmp_path / "missing.pth"), torch.device("cpu"))
