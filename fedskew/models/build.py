"""One place that turns a run config into the model every site and the server share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedskew.config import RunConfig
from fedskew.models.backbones import Classifier, build_backbone, load_pretrained
from fedskew.models.fednca import FedNCAModel, etf_dim, simplex_etf
from fedskew.models.fractal import fractal_pretrain


def server_etf(cfg: RunConfig, num_classes: int, image_shape: tuple[int, int, int]) -> torch.Tensor:
    """The run's fixed simplex ETF, built once by the server from the run seed."""
    feature_dim = build_backbone(cfg.model, image_shape[0], image_shape[1], bool(cfg.pretrained), cfg.feature_side).feature_dim
    return simplex_etf(num_classes, etf_dim(feature_dim, cfg.fednca.projection_dim or None), cfg.seed)


def build_model(
    cfg: RunConfig, num_classes: int, image_shape: tuple[int, int, int], etf: torch.Tensor | None = None
) -> nn.Module:
    """FedNCA-ML's ETF model (with the server's `etf`) for method fednca and its centralised bound, else
    backbone + linear head."""
    channels, height, _ = image_shape
    backbone = build_backbone(cfg.model, channels, height, bool(cfg.pretrained), cfg.feature_side)
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


def weights_mismatch(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> str | None:
    """Why `state` cannot be loaded into a model whose state dict is `reference` (tensor names, shapes,
    dtypes, finite values), or None when it can."""
    if set(state) != set(reference):
        missing, extra = sorted(set(reference) - set(state)), sorted(set(state) - set(reference))
        return f"the tensors do not match the model's: missing {missing[:5]}, unexpected {extra[:5]}"
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(reference[name].shape):
            return f"tensor {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(reference[name].shape)}"
        if tensor.dtype != reference[name].dtype:
            return f"tensor {name!r} has dtype {tensor.dtype}, the model's is {reference[name].dtype}"
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            return f"tensor {name!r} holds non-finite values"
    return None


def start_backbone(cfg: RunConfig, model: nn.Module, image_shape: tuple[int, int, int],
                   device: torch.device | None = None, pretrain: Callable = fractal_pretrain) -> nn.Module:
    """The server's initial model: its backbone from `pretrained`, or trained `fractal-pretrain-epochs` on
    formula-drawn fractals of `image_shape` (channels, height, width) on `device` (default CPU) by `pretrain`
    (`fractal_pretrain`'s signature; the benchmark's keeps its backbones on disk), or as built.
    Sites receive these weights in round 1 and never read the file nor draw the fractals."""
    if cfg.pretrained:
        load_pretrained(model.backbone, cfg.pretrained, cfg.model)
    elif cfg.fractal_pretrain_epochs:
        pretrain(model.backbone, image_shape[0], image_shape[1], cfg.fractal_pretrain_epochs, cfg.seed, device=device)
    return model
