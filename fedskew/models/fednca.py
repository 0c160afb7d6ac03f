"""FedNCA-ML model, losses and local optimiser (Peng et al., arXiv:2509.12544; docs/fednca.md).

Pipeline: backbone feature map (B, d, h, w) -> optional learned 1x1 projection to D dims ->
N = h*w tokens (B, N, D) -> LADM (one multi-head attention layer whose queries are the K ETF
prototypes) -> class features f (B, K, D) -> fixed ETF classifier z_j = s * (W f_j) + b ->
diagonal logits z_k[k] (B, K).

ETF handling: the server owns the simplex ETF M (D, K); rows of W = M^T are the prototypes.
Every copy of it inside the model is a *non-persistent* buffer, so ``model.state_dict()`` is
exactly the federated state (backbone incl. BatchNorm statistics, projection, attention q/k/v/out,
scale, bias, and the queries when they are learnable) and never carries the ETF. The ETF still
follows ``model.to(device)``; a client installs the matrix it receives with ``model.set_etf(M)``,
which validates it first.

Projection (FedETF-style): an exact ETF of K vectors needs D >= K-1. When the backbone's
feature_dim is smaller (or whenever a different width is wanted) pass ``projection_dim``; a learned
1x1 convolution maps the feature map to that many channels and the ETF must be built in
``etf_dim(backbone.feature_dim, projection_dim)`` dimensions. The projection is federated.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "simplex_etf",
    "check_simplex_etf",
    "etf_dim",
    "LADM",
    "ETFClassifier",
    "FedNCAModel",
    "summed_bce",
    "negative_feature_rejection",
    "positive_feature_contrastive",
    "fednca_loss",
    "linear_warmup_decay_factor",
    "fednca_optimizer",
]


# --------------------------------------------------------------------------------------------
# Simplex ETF geometry
# --------------------------------------------------------------------------------------------

def _require_etf_dim(num_classes: int, dim: int) -> None:
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an int >= 2 for a simplex ETF, got {num_classes!r}")
    if not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    if dim < num_classes - 1:
        raise ValueError(
            f"no exact simplex ETF of {num_classes} classes exists in dim={dim} < K-1={num_classes - 1}; "
            f"valid: dim >= {num_classes - 1}, or give FedNCAModel a projection_dim >= {num_classes - 1} "
            "and build the ETF in that dimension"
        )


def _orthonormal_columns(matrix: Tensor) -> Tensor:
    """Q of the reduced QR with signs fixed so diag(R) > 0: unique, hence identical across LAPACKs."""
    q, r = torch.linalg.qr(matrix, mode="reduced")
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return q * signs


def simplex_etf(num_classes: int, dim: int, seed: int) -> Tensor:
    """Simplex ETF M of shape (dim, K), float32: unit columns, pairwise cosine exactly -1/(K-1).

    M = sqrt(K/(K-1)) * U C where C^T C = I_K - (1/K) 1 1^T. For dim >= K, U (dim x K) is the
    orthonormal factor of a seeded Gaussian and C is the centring matrix itself (the paper's form).
    For dim == K-1 no dim x K matrix has orthonormal columns, so C is the (K-1) x K transpose of an
    orthonormal basis of the sum-zero subspace and U is dim x (K-1); the Gram matrix is the same.
    Generated in float64 on CPU from a private torch.Generator, so the result depends only on
    (num_classes, dim, seed).
    """
    _require_etf_dim(num_classes, dim)
    k = num_classes
    centring = torch.eye(k, dtype=torch.float64) - torch.full((k, k), 1.0 / k, dtype=torch.float64)
    mixing = centring if dim >= k else _orthonormal_columns(centring[:, : k - 1]).T
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    gaussian = torch.randn(dim, mixing.shape[0], generator=generator, dtype=torch.float64)
    basis = _orthonormal_columns(gaussian)
    etf = math.sqrt(k / (k - 1)) * basis @ mixing
    return etf.to(torch.float32)


def check_simplex_etf(etf: Tensor, num_classes: int, dim: int, atol: float = 1e-4) -> None:
    """Raise ValueError naming the defect unless `etf` is a (dim, K) simplex ETF within `atol`.

    Clients call this on the matrix received from the server before using it.
    """
    _require_etf_dim(num_classes, dim)
    matrix = torch.as_tensor(etf)
    if tuple(matrix.shape) != (dim, num_classes):
        raise ValueError(
            f"ETF has shape {tuple(matrix.shape)}, expected (dim, num_classes) = ({dim}, {num_classes})"
        )
    if not matrix.is_floating_point():
        raise ValueError(f"ETF must be a floating-point matrix, got dtype {matrix.dtype}")
    matrix = matrix.detach().to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(matrix).all():
        bad = int((~torch.isfinite(matrix)).sum())
        raise ValueError(f"ETF has {bad} non-finite entries (NaN or inf); all entries must be finite")
    norms = matrix.norm(dim=0)
    norm_error = (norms - 1.0).abs()
    if norm_error.max() > atol:
        worst = int(norm_error.argmax())
        raise ValueError(
            f"ETF column {worst} has norm {norms[worst].item():.6g}; every column must have unit norm "
            f"(atol {atol})"
        )
    gram = matrix.T @ matrix
    target = -1.0 / (num_classes - 1)
    off_diagonal = ~torch.eye(num_classes, dtype=torch.bool)
    angle_error = torch.where(off_diagonal, (gram - target).abs(), torch.zeros_like(gram))
    if angle_error.max() > atol:
        i, j = divmod(int(angle_error.argmax()), num_classes)
        raise ValueError(
            f"ETF columns {i} and {j} have cosine {gram[i, j].item():.6g}; every pair must have cosine "
            f"-1/(K-1) = {target:.6g} (atol {atol})"
        )


def etf_fingerprint(etf: Tensor | np.ndarray) -> int:
    """CRC32 of the float32 bytes: lets the server confirm a site used exactly its ETF."""
    array = etf.detach().cpu().numpy() if isinstance(etf, Tensor) else etf
    return zlib.crc32(np.ascontiguousarray(array, dtype=np.float32).tobytes())


def etf_dim(feature_dim: int, projection_dim: int | None = None) -> int:
    """Dimension the ETF must be built in for a backbone of `feature_dim` and an optional projection."""
    if projection_dim is None:
        return feature_dim
    if not isinstance(projection_dim, int) or projection_dim < 1:
        raise ValueError(f"projection_dim must be None or a positive int, got {projection_dim!r}")
    return projection_dim


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------

class LADM(nn.Module):
    """Label-aware disentanglement: one multi-head attention layer, queries = K class prototypes.

    tokens (B, N, D) -> class features (B, K, D). Keys and values are the tokens; no residual,
    LayerNorm, feed-forward, dropout or positional embedding (as in the authors' implementation).
    Fixed queries are a non-persistent buffer (no gradient, not federated). With
    ``learnable_queries=True`` (ablation) they are a Parameter initialised at the prototypes and are
    federated like any other weight.
    """

    def __init__(self, prototypes: Tensor, num_heads: int = 4, learnable_queries: bool = False):
        super().__init__()
        if prototypes.dim() != 2:
            raise ValueError(f"prototypes must be (K, D), got shape {tuple(prototypes.shape)}")
        embed_dim = prototypes.shape[1]
        if not isinstance(num_heads, int) or num_heads < 1 or embed_dim % num_heads != 0:
            raise ValueError(
                f"LADM embedding dim {embed_dim} is not divisible by num_heads={num_heads!r}; pick a "
                "num_heads that divides it, or a projection_dim that is a multiple of num_heads"
            )
        self.learnable_queries = learnable_queries
        initial = prototypes.detach().clone().float()
        if learnable_queries:
            self.queries = nn.Parameter(initial)
        else:
            self.register_buffer("queries", initial, persistent=False)
        self.attention = nn.MultiheadAttention(embed_dim, num_heads, dropout=0.0, batch_first=True)

    def forward(self, tokens: Tensor) -> Tensor:
        queries = self.queries.unsqueeze(0).expand(tokens.shape[0], -1, -1)
        features, _ = self.attention(queries, tokens, tokens, need_weights=False)
        return features


class ETFClassifier(nn.Module):
    """Fixed-prototype classifier: features (..., D) -> s * features @ W^T + b, shape (..., K).

    W (K, D) is a non-persistent buffer; the scale s (init 10) and per-class bias b are learned.
    Applied to class features (B, K, D) it gives the full class-wise logits z (B, K, K) with
    z[b, j, k] = s * <w_k, f_bj> + b_k; applied to a pooled feature (B, D) it gives (B, K).
    """

    def __init__(self, prototypes: Tensor, initial_scale: float = 10.0):
        super().__init__()
        if prototypes.dim() != 2:
            raise ValueError(f"prototypes must be (K, D), got shape {tuple(prototypes.shape)}")
        self.register_buffer("prototypes", prototypes.detach().clone().float(), persistent=False)
        self.scale = nn.Parameter(torch.tensor(float(initial_scale)))
        self.bias = nn.Parameter(torch.zeros(prototypes.shape[0]))

    def forward(self, features: Tensor) -> Tensor:
        return self.scale * (features @ self.prototypes.T) + self.bias


class FedNCAModel(nn.Module):
    """Backbone -> [1x1 projection] -> LADM -> fixed ETF classifier; forward(x) -> logits (B, K).

    `etf` is the server's simplex ETF M of shape (etf_dim(backbone.feature_dim, projection_dim), K).
    `use_ladm=False` is the "ETF classifier without LADM" ablation: the global-average-pooled feature
    goes through the ETF classifier (train it with plain summed BCE). `learnable_queries=True` is the
    learnable-queries ablation (requires LADM).
    """

    def __init__(
        self,
        backbone: nn.Module,
        etf: Tensor,
        use_ladm: bool = True,
        learnable_queries: bool = False,
        num_heads: int = 4,
        projection_dim: int | None = None,
    ):
        super().__init__()
        if learnable_queries and not use_ladm:
            raise ValueError("learnable_queries=True needs use_ladm=True: without LADM there are no queries")
        feature_dim = int(backbone.feature_dim)
        self.embedding_dim = etf_dim(feature_dim, projection_dim)
        etf = torch.as_tensor(etf)
        if etf.dim() != 2 or etf.shape[0] != self.embedding_dim:
            raise ValueError(
                f"ETF has shape {tuple(etf.shape)}, expected ({self.embedding_dim}, K): its dim must equal "
                f"projection_dim ({projection_dim}) if given, else backbone.feature_dim ({feature_dim})"
            )
        self.num_classes = int(etf.shape[1])
        check_simplex_etf(etf, self.num_classes, self.embedding_dim)
        self.backbone = backbone
        self.projection = (
            nn.Conv2d(feature_dim, projection_dim, kernel_size=1) if projection_dim is not None else None
        )
        prototypes = etf.T
        self.ladm = LADM(prototypes, num_heads, learnable_queries) if use_ladm else None
        self.classifier = ETFClassifier(prototypes)

    @property
    def use_ladm(self) -> bool:
        return self.ladm is not None

    @property
    def prototypes(self) -> Tensor:
        """Fixed ETF prototypes W = M^T, shape (K, D)."""
        return self.classifier.prototypes

    def _feature_map(self, x: Tensor) -> Tensor:
        feature_map = self.backbone.forward_features(x)
        return self.projection(feature_map) if self.projection is not None else feature_map

    def forward_with_features(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(diagonal logits (B, K), class-wise logits z (B, K, K), class features f (B, K, D))."""
        if self.ladm is None:
            raise ValueError("forward_with_features needs use_ladm=True; the no-LADM ablation has no class features")
        tokens = self._feature_map(x).flatten(2).transpose(1, 2)
        class_features = self.ladm(tokens)
        class_logits = self.classifier(class_features)
        return class_logits.diagonal(dim1=1, dim2=2), class_logits, class_features

    def forward(self, x: Tensor) -> Tensor:
        if self.ladm is None:
            return self.classifier(self._feature_map(x).mean(dim=(2, 3)))
        return self.forward_with_features(x)[0]

    @torch.no_grad()
    def set_etf(self, etf: Tensor) -> None:
        """Validate a received ETF (D, K) and install it as the classifier's prototypes and fixed queries.

        Learnable queries (ablation) are left alone: they are federated weights, not the ETF.
        """
        check_simplex_etf(etf, self.num_classes, self.embedding_dim)
        prototypes = torch.as_tensor(etf).T
        self.classifier.prototypes.copy_(prototypes)
        if self.ladm is not None and not self.ladm.learnable_queries:
            self.ladm.queries.copy_(prototypes)


# --------------------------------------------------------------------------------------------
# Losses. Convention for all of them: the per-batch sum of per-pair terms divided by the batch
# size B, i.e. a per-sample loss averaged over the batch (the same scale as summed BCE).
# Targets are multi-hot (B, K); an entry > 0.5 is a positive pair.
# --------------------------------------------------------------------------------------------

def _require_same_shape(name: str, tensor: Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")


def summed_bce(logits: Tensor, targets: Tensor) -> Tensor:
    """Binary cross-entropy with logits summed over the K classes, mean over the batch."""
    _require_same_shape("targets", targets, tuple(logits.shape))
    per_entry = F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype), reduction="none")
    return per_entry.sum(dim=1).mean()


REJECTION_SCOPES = ("other", "all")


def negative_feature_rejection(z: Tensor, targets: Tensor, margin: float = 0.3, scope: str = "other") -> Tensor:
    """Push absent labels' class features away from the prototypes.

    z: class-wise logits (B, K, K), z[b, j, k] = logit of prototype k for sample b's class-j feature.
    For each negative pair (b, j), m_bj = max over k of z[b, j, k], k ranging over the other
    prototypes (k != j; scope "other", the paper's reading: an absent label's feature must not look
    like another class) or over all K, its own included (scope "all"). Of all negatives in the
    batch, the n_pos with the largest m are kept (n_pos = number of positive pairs in the batch; all
    negatives if there are fewer). Loss = sum over kept of relu(sigmoid(m_bj) - margin), divided by B.
    """
    if scope not in REJECTION_SCOPES:
        raise ValueError(f"rejection scope must be one of {REJECTION_SCOPES}, got {scope!r}")
    batch, num_classes = targets.shape
    _require_same_shape("z", z, (batch, num_classes, num_classes))
    positive = targets > 0.5
    if scope == "other":
        own = torch.eye(num_classes, dtype=torch.bool, device=z.device)
        z = z.masked_fill(own, float("-inf"))
    hardest_logit = z.max(dim=2).values
    negative_logits = hardest_logit[~positive]
    kept = min(int(positive.sum()), negative_logits.numel())
    hardest_negatives = torch.topk(negative_logits, kept).values
    return F.relu(torch.sigmoid(hardest_negatives) - margin).sum() / batch


def positive_feature_contrastive(
    class_features: Tensor, prototypes: Tensor, targets: Tensor, tau: float = 0.07
) -> Tensor:
    """Pull present labels' class features onto their own prototype, away from the others.

    class_features f (B, K, D), prototypes W (K, D). For each positive pair (b, j): cross-entropy
    over k of cos(f_bj, w_k) / tau with target class j. Sum over positive pairs, divided by B.
    """
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    batch, num_classes = targets.shape
    _require_same_shape("class_features", class_features, (batch, num_classes, prototypes.shape[1]))
    _require_same_shape("prototypes", prototypes, (num_classes, class_features.shape[2]))
    cosine = F.normalize(class_features, dim=2) @ F.normalize(prototypes, dim=1).T
    positive = targets > 0.5
    own_class = torch.arange(num_classes, device=targets.device).expand(batch, num_classes)
    per_pair = F.cross_entropy(cosine[positive] / tau, own_class[positive], reduction="sum")
    return per_pair / batch


def fednca_loss(
    model: FedNCAModel,
    x: Tensor,
    y: Tensor,
    rejection_weight: float = 0.01,
    contrastive_weight: float = 1.0,
    margin: float = 0.3,
    tau: float = 0.07,
    use_regularisers: bool = True,
    rejection_scope: str = "other",
) -> Tensor:
    """Summed BCE + rejection_weight * rejection + contrastive_weight * contrastive.

    Plain summed BCE when the model has no LADM or use_regularisers is False. Bind the keyword
    arguments with functools.partial to get a `loss_fn(model, x, y)`.
    """
    if rejection_weight < 0 or contrastive_weight < 0:
        raise ValueError(
            f"loss weights must be >= 0, got rejection_weight={rejection_weight}, "
            f"contrastive_weight={contrastive_weight}"
        )
    if not model.use_ladm or not use_regularisers:
        return summed_bce(model(x), y)
    logits, class_logits, class_features = model.forward_with_features(x)
    return (
        summed_bce(logits, y)
        + rejection_weight * negative_feature_rejection(class_logits, y, margin, rejection_scope)
        + contrastive_weight * positive_feature_contrastive(class_features, model.prototypes, y, tau)
    )


# --------------------------------------------------------------------------------------------
# Optimiser
# --------------------------------------------------------------------------------------------

def linear_warmup_decay_factor(global_step: int, warmup_steps: int, total_steps: int) -> float:
    """LR multiplier for the optimiser step with 0-based index `global_step`.

    (s+1)/warmup during warm-up, so the first step already moves and step warmup-1 reaches the peak;
    then (total - s)/(total - warmup), linear to 0 at s = total; 0 afterwards.
    """
    if global_step >= total_steps:
        return 0.0
    if global_step < warmup_steps:
        return (global_step + 1) / warmup_steps
    return (total_steps - global_step) / (total_steps - warmup_steps)


def fednca_optimizer(
    model: nn.Module,
    *,
    total_steps: int,
    lr: float = 1e-4,
    betas: tuple[float, float] = (0.9, 0.98),
    weight_decay: float = 0.01,
    warmup_steps: int = 0,
    step_offset: int = 0,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW + LambdaLR (linear warm-up over warmup_steps of total_steps, then linear decay to 0).

    Weight decay applies only to parameters with >= 2 dims (conv/linear/attention weights and
    learnable queries); biases, norm weights and the ETF scale (all < 2 dims) get none.
    Call scheduler.step() after every optimizer.step().

    Federated use: the schedule is global over the whole run. A client that trains
    steps_per_round steps in round r (1-based) passes total_steps = num_rounds * steps_per_round
    and step_offset = (r - 1) * steps_per_round, so its first step uses the LR of global step
    step_offset. AdamW moments restart each round (a fresh optimiser), the schedule does not.
    """
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
    if not isinstance(warmup_steps, int) or not 0 <= warmup_steps < total_steps:
        raise ValueError(f"warmup_steps must be an int in [0, total_steps={total_steps}), got {warmup_steps!r}")
    if not isinstance(step_offset, int) or not 0 <= step_offset < total_steps:
        raise ValueError(
            f"step_offset must be an int in [0, total_steps={total_steps}), got {step_offset!r}; "
            "a larger offset would train at learning rate 0"
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    decayed = [p for p in trainable if p.dim() >= 2]
    not_decayed = [p for p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": weight_decay},
            {"params": not_decayed, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=betas,
    )

    def global_schedule(local_step: int) -> float:
        return linear_warmup_decay_factor(step_offset + local_step, warmup_steps, total_steps)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, global_schedule)
