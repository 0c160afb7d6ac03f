"""FederatedFactory's P2P model: the Product of Experts over the sites' expert classifiers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# log(1e-12): an expert that rules a class out cannot veto it by more than this.
LOG_PROB_FLOOR = math.log(1e-12)


def product_of_experts(expert_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum over experts of log_softmax, each clamped at log(1e-12); softmax of the sum gives the PoE
    probabilities and its argmax the prediction."""
    if not expert_logits:
        raise ValueError("product_of_experts needs at least one expert's logits")
    return torch.stack([F.log_softmax(l.float(), dim=-1).clamp(min=LOG_PROB_FLOOR) for l in expert_logits]).sum(0)


class ExpertEnsemble(nn.Module):
    """The P2P model: forward returns the PoE score, so fedskew.training.evaluate's softmax yields the
    PoE probabilities."""

    def __init__(self, experts: Sequence[nn.Module]):
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product_of_experts([expert(x) for expert in self.experts])
