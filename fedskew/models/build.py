"""One place that turns a run config into the model every site and the server share."""

from __future__ import annotations

import torch
from torch import nn

from fedskew.config import RunConfig
from fedskew.models.backbones import Classifier, build_backbone
from fedskew.models.fednca import FedNCAModel, etf_dim, simplex_etf


def server_etf(cfg: RunConfig, num_classes: int, image_shape: tuple[int, int, int]) -> torch.Tensor:
    """The run's fixed simplex ETF, built once by the server from the run seed."""
    feature_dim = build_backbone(cfg.model, image_shape[0], image_shape[1]).feature_dim
    return simplex_etf(num_classes, etf_dim(feature_dim, cfg.fednca.projection_dim or None), cfg.seed)


def build_model(
    cfg: RunConfig, num_classes: int, image_shape: tuple[int, int, int], etf: torch.Tensor | None = None
) -> nn.Module:
    """FedNCA-ML's ETF model (with the server's `etf`) for method fednca and its centralised bound, else
    backbone + linear head."""
    channels, height, _ = image_shape
    backbone = build_backbone(cfg.model, channels, height)
    if not cfg.fednca_model:
        return Classifier(backbone, num_classes)
    if etf is None:
        raise ValueError("FedNCA-ML's model needs the server's ETF matrix")
    return FedNCAModel(
        backbone,
        etf,
        use_ladm=cfg.fednca.ladm,
        learnable_queries=cfg.fednca.learnable_queries,
        num_heads=cfg.fednca.heads,
        projection_dim=cfg.fednca.projection_dim or None,
    )
