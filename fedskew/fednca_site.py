"""FedNCA-ML's site side as plain functions, with no run config: what a Flower ClientApp of one's own
needs to train against `fedskew.strategies.FedNCA` with its own backbone and data. The server's training
and evaluation messages carry the simplex ETF as their ArrayRecord `ETF_KEY`; `etf_from_message` reads
and checks it, `FedNCAModel(backbone, etf)` puts the LADM and the fixed ETF classifier on the backbone
(which must provide `feature_dim` and `forward_features(x) -> (B, feature_dim, h, w)`), `fednca_loss`
and `fednca_optimizer` train it, and `etf_echo` is the metric by which the server confirms that a site
trained against its ETF. fedskew's own sites (fedskew.client_tasks) use the same functions."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import RecordDict

from fedskew.models.fednca import FedNCAModel, check_simplex_etf, etf_fingerprint, fednca_loss, fednca_optimizer
from fedskew.protocol import ETF_ECHO_KEY, ETF_KEY  # ETF_KEY: an ArrayRecord holding one array of that name

__all__ = ["ETF_ECHO_KEY", "ETF_KEY", "FedNCAModel", "checked_etf", "etf_echo", "etf_from_message", "fednca_loss",
           "fednca_optimizer"]  # fmt: skip


def checked_etf(etf: np.ndarray, num_classes: int) -> torch.Tensor:
    """The server's ETF, checked before use: a malformed matrix is refused with the reason."""
    if etf.ndim != 2:
        raise ValueError(f"refusing the server's ETF: expected a (dim, {num_classes}) matrix, got shape {etf.shape}")
    check_simplex_etf(etf, num_classes, etf.shape[0])
    return torch.from_numpy(np.array(etf, dtype=np.float32))


def etf_from_message(content: RecordDict, num_classes: int) -> torch.Tensor:
    """The ETF a FedNCA server sent with its training or evaluation message `content`, checked for a
    simplex ETF over `num_classes` classes; a message without one is refused naming what it holds."""
    if ETF_KEY not in content.array_records:
        raise ValueError(f"the server's message carries no ArrayRecord '{ETF_KEY}' (it holds ArrayRecords "
                         f"{sorted(content.array_records)}): is the server's strategy fedskew.strategies.FedNCA?")
    return checked_etf(content[ETF_KEY][ETF_KEY].numpy(), num_classes)


def etf_echo(etf: torch.Tensor | np.ndarray) -> dict[str, int]:
    """The metric to add to a training reply: FedNCA warns about (and records) sites whose echo differs."""
    return {ETF_ECHO_KEY: etf_fingerprint(etf)}
