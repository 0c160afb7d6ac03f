"""FedNCA-ML neural-collapse analysis: the inter-class similarity on hand-made features and the
written report of a real (tiny) model."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedskew.analysis import interclass_similarity, write_fednca_analysis
from fedskew.config import RunConfig
from fedskew.data.sites import load_task_dataset
from fedskew.models.build import build_model, server_etf


def test_interclass_similarity_by_hand():
    # class means (1, 0), (0, 1), (-1, 0): cosines 0, -1, 0 -> mean -1/3; the ETF of 3 classes: -1/2
    features = np.array([[2.0, 0.0], [0.0, 1.0], [0.0, 3.0], [-1.0, 0.0]])
    classes = np.array([0, 1, 1, 2])
    report = interclass_similarity(features, classes, num_classes=3)
    assert report["mean_pairwise_cosine"] == pytest.approx(-1 / 3)
    assert report["etf_cosine"] == pytest.approx(-0.5)
    with pytest.raises(ValueError, match=">= 2 classes"):
        interclass_similarity(features[:1], classes[:1], num_classes=3)


def test_fednca_analysis_writes_similarity_and_tsne(tmp_path):
    cfg = RunConfig.from_run_config({"method": "fednca"})
    data = load_task_dataset(cfg)
    torch.manual_seed(0)
    shape = data.test_images.shape[1:]
    model = build_model(cfg, data.num_classes, shape, etf=server_etf(cfg, data.num_classes, shape))
    # the first 120 test mosaics (~2.6 labels each) keep the t-SNE to seconds
    test = SimpleNamespace(test_images=data.test_images[:120], test_labels=data.test_labels[:120], class_names=data.class_names)
    report = write_fednca_analysis(model, test, tmp_path, torch.device("cpu"), seed=0)
    assert json.loads((tmp_path / "nc_analysis.json").read_text()) == report
    assert (tmp_path / "nc_tsne.png").stat().st_size > 10_000
    assert -1.0 <= report["mean_pairwise_cosine"] <= 1.0 and math.isclose(report["etf_cosine"], -1 / 9)
    assert report["classes_measured"] == 10
