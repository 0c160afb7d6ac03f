"""Formula-driven pretraining: the IFS categories, the chaos game, the image set and the server's start."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from fedskew.config import RunConfig
from fedskew.models.backbones import SmallCNN
from fedskew.models.build import build_model, start_backbone
from fedskew.models.fractal import chaos_game, fractal_images, fractal_pretrain, ifs_category


def test_an_ifs_category_is_two_to_four_contractive_maps_with_probabilities_that_sum_to_one():
    rng = np.random.default_rng(0)
    for _ in range(20):
        matrices, shifts, probabilities = ifs_category(rng)
        used = probabilities > 0
        assert 2 <= used.sum() <= 4 and probabilities.sum() == pytest.approx(1.0)
        assert (np.linalg.svd(matrices[used], compute_uv=False)[:, 0] < 0.95).all()
        assert not matrices[~used].any() and not shifts[~used].any()


def test_the_chaos_game_draws_the_attractor_fitted_to_the_frame():
    # x -> x/2 and x -> x/2 + (1/2, 1/2): the attractor is the diagonal from (0, 0) to (1, 1); fitted to a 16 px
    # frame it lights the diagonal pixels and nothing else.
    half = 0.5 * np.eye(2)
    matrices = np.stack([half, half, np.zeros((2, 2)), np.zeros((2, 2))])[None]
    shifts = np.array([[0.0, 0.0], [0.5, 0.5], [0.0, 0.0], [0.0, 0.0]])[None]
    probabilities = np.array([[0.5, 0.5, 0.0, 0.0]])
    image = chaos_game(matrices, shifts, probabilities, 16, torch.Generator().manual_seed(0))[0]
    assert torch.equal(image, torch.eye(16))  # 1,000 points land on each of the 16 diagonal pixels


def test_fractal_images_are_seeded_one_category_per_block_and_the_pretraining_moves_only_the_backbone(capsys):
    images, labels = fractal_images(3, 4, 1, 12, seed=5)
    again, _ = fractal_images(3, 4, 1, 12, seed=5)
    assert images.shape == (12, 1, 12, 12) and images.dtype == np.uint8 and np.array_equal(images, again)
    assert labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert not np.array_equal(images, fractal_images(3, 4, 1, 12, seed=6)[0])
    backbone = SmallCNN(3, 12)
    before = copy.deepcopy(backbone.state_dict())
    result = fractal_pretrain(backbone, 3, 12, epochs=1, seed=0, categories=2, per_category=4)
    assert set(backbone.state_dict()) == set(before)  # the head stays outside the backbone
    assert any(not torch.equal(before[name], tensor) for name, tensor in backbone.state_dict().items())
    assert 0.0 <= result["fractal_accuracy"] <= 1.0 and result["fractal_loss"] > 0
    assert f"accuracy {result['fractal_accuracy']}" in capsys.readouterr().out  # the run's log says how far it got


def test_the_server_start_pretrains_the_backbone_alike_from_the_seed_and_leaves_the_head_as_built(monkeypatch):
    # The run's own pretraining on a set of 2 x 4 fractals instead of 64 x 100, to keep the test short.
    monkeypatch.setattr("fedskew.models.build.fractal_pretrain", functools.partial(fractal_pretrain, categories=2, per_category=4))
    cfg = RunConfig.from_run_config({"method": "fedavg", "fractal-pretrain-epochs": 1})
    torch.manual_seed(0)
    built = build_model(cfg, 3, (1, 12, 12))
    torch.manual_seed(0)
    first = start_backbone(cfg, build_model(cfg, 3, (1, 12, 12)), (1, 12, 12))
    torch.manual_seed(0)
    second = start_backbone(cfg, build_model(cfg, 3, (1, 12, 12)), (1, 12, 12))
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name  # every node that draws it gets one start
        changed = not torch.equal(tensor, built.state_dict()[name])
        assert changed == name.startswith("backbone."), name  # the classifier head stays as built


def test_fractal_pretraining_and_a_pretrained_file_are_refused_together():
    with pytest.raises(ValueError, match="fractal-pretrain-epochs.*0 when pretrained is set"):
        RunConfig.from_run_config({"model": "resnet18", "pretrained": "weights.pt", "fractal-pretrain-epochs": 3})
