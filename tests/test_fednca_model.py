import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.models.fednca import (
    ETFClassifier,
    FedNCAModel,
    LADM,
    check_simplex_etf,
    etf_dim,
    fednca_loss,
    fednca_optimizer,
    negative_feature_rejection,
    positive_feature_contrastive,
    simplex_etf,
    summed_bce,
)


class TinyBackbone(nn.Module):
    """Stand-in for the lead's backbones: (B, 1, 8, 8) -> (B, 16, 4, 4) feature map."""

    feature_dim = 16

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, self.feature_dim, 3, stride=2, padding=1)

    def forward_features(self, x):
        return self.conv2(F.relu(self.bn1(self.conv1(x))))


def tiny_model(num_classes=3, seed=0, **options):
    torch.manual_seed(seed)
    return FedNCAModel(TinyBackbone(), simplex_etf(num_classes, 16, seed=seed), **options)


# The 3-class ETF in the plane, written out: unit vectors 120 degrees apart (rows = prototypes).
PLANAR_PROTOTYPES = torch.tensor([[1.0, 0.0], [-0.5, math.sqrt(3) / 2], [-0.5, -math.sqrt(3) / 2]])


# ---------------------------------------------------------------- simplex ETF

@pytest.mark.parametrize("num_classes,dim", [(2, 1), (3, 2), (5, 4), (5, 5), (10, 16), (14, 512)])
def test_simplex_etf_unit_columns_equiangular_and_centred(num_classes, dim):
    etf = simplex_etf(num_classes, dim, seed=7)
    assert etf.shape == (dim, num_classes) and etf.dtype == torch.float32
    etf64 = etf.double()
    assert torch.allclose(etf64.norm(dim=0), torch.ones(num_classes, dtype=torch.float64), atol=1e-5)
    gram = etf64.T @ etf64
    off_diagonal = gram[~torch.eye(num_classes, dtype=torch.bool)]
    assert torch.allclose(off_diagonal, torch.full_like(off_diagonal, -1.0 / (num_classes - 1)), atol=1e-5)
    assert torch.allclose(etf64.sum(dim=1), torch.zeros(dim, dtype=torch.float64), atol=1e-5)
    check_simplex_etf(etf, num_classes, dim)


def test_simplex_etf_is_seeded():
    assert torch.equal(simplex_etf(6, 12, seed=3), simplex_etf(6, 12, seed=3))
    assert not torch.allclose(simplex_etf(6, 12, seed=3), simplex_etf(6, 12, seed=4), atol=1e-3)
    assert torch.equal(simplex_etf(6, 5, seed=3), simplex_etf(6, 5, seed=3))
    assert not torch.allclose(simplex_etf(6, 5, seed=3), simplex_etf(6, 5, seed=4), atol=1e-3)


def test_simplex_etf_refuses_dim_below_k_minus_1():
    with pytest.raises(ValueError, match=r"dim=8 < K-1=9.*projection_dim >= 9"):
        simplex_etf(10, 8, seed=0)


def test_check_simplex_etf_accepts_rotated_etf():
    etf = simplex_etf(4, 6, seed=0)
    rotation, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(1)))
    check_simplex_etf(rotation @ etf, 4, 6)


@pytest.mark.parametrize(
    "corrupt,message",
    [
        (lambda m: m.T.contiguous(), "shape"),
        (lambda m: m[:, :3], "shape"),
        (lambda m: m.index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("nan"))), "non-finite"),
        (lambda m: m * 1.01, "norm"),
        (lambda m: m + 0.01 * torch.randn(m.shape, generator=torch.Generator().manual_seed(0)), "norm|cosine"),
        (lambda m: torch.eye(6)[:, :4], "cosine"),  # unit columns, but orthogonal rather than equiangular
    ],
)
def test_check_simplex_etf_rejects_malformed(corrupt, message):
    with pytest.raises(ValueError, match=message):
        check_simplex_etf(corrupt(simplex_etf(4, 6, seed=0)), 4, 6)


# ---------------------------------------------------------------- LADM

def test_ladm_output_shape_and_token_order_invariance():
    torch.manual_seed(0)
    ladm = LADM(simplex_etf(4, 8, seed=0).T, num_heads=4)
    tokens = torch.randn(3, 5, 8)
    features = ladm(tokens)
    assert features.shape == (3, 4, 8)
    # No positional embedding: permuting the tokens must not change the class features.
    assert torch.allclose(ladm(tokens[:, torch.tensor([4, 2, 0, 1, 3])]), features, atol=1e-6)


def test_ladm_fixed_queries_get_no_gradient_but_projections_do():
    torch.manual_seed(0)
    ladm = LADM(simplex_etf(4, 8, seed=0).T)
    assert not ladm.queries.requires_grad
    assert "queries" not in dict(ladm.named_parameters())
    ladm(torch.randn(2, 5, 8)).pow(2).sum().backward()
    assert ladm.queries.grad is None
    for projection in (ladm.attention.in_proj_weight, ladm.attention.out_proj.weight):
        assert projection.grad is not None and projection.grad.abs().sum() > 0


def test_ladm_learnable_queries_start_at_prototypes_and_get_gradient():
    prototypes = simplex_etf(4, 8, seed=0).T
    ladm = LADM(prototypes, learnable_queries=True)
    assert "queries" in dict(ladm.named_parameters())
    assert torch.equal(ladm.queries.detach(), prototypes)
    ladm(torch.randn(2, 5, 8)).pow(2).sum().backward()
    assert ladm.queries.grad is not None and ladm.queries.grad.abs().sum() > 0


def test_ladm_rejects_heads_not_dividing_dim():
    with pytest.raises(ValueError, match="not divisible by num_heads=4"):
        LADM(simplex_etf(4, 6, seed=0).T, num_heads=4)


# ---------------------------------------------------------------- ETF classifier

def test_etf_classifier_logits_by_hand():
    classifier = ETFClassifier(PLANAR_PROTOTYPES)
    assert classifier.scale.item() == 10.0
    assert torch.equal(classifier.bias.detach(), torch.zeros(3))
    with torch.no_grad():
        classifier.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    features = torch.tensor([[[1.0, 2.0], [2.0, 0.0], [0.0, -2.0]]])  # f_0, f_1, f_2 of one sample
    z = classifier(features)
    # diagonal: <w0,f0> = 1; <w1,f1> = -1; <w2,f2> = sqrt(3)
    expected_diagonal = torch.tensor([[10 * 1 + 0.1, 10 * -1 + 0.2, 10 * math.sqrt(3) + 0.3]])
    assert torch.allclose(z.diagonal(dim1=1, dim2=2), expected_diagonal, atol=1e-5)
    # off-diagonal z[0, j=0, k=1] = 10 * <w1, f0> + b1 = 10 * (-0.5 + sqrt(3)) + 0.2
    assert z[0, 0, 1].item() == pytest.approx(10 * (-0.5 + math.sqrt(3)) + 0.2, abs=1e-5)


def test_model_logits_are_diagonal_of_class_logits():
    model = tiny_model()
    with torch.no_grad():
        model.classifier.bias.copy_(torch.tensor([0.5, -1.0, 2.0]))
    x = torch.rand(2, 1, 8, 8)
    logits, z, features = model.forward_with_features(x)
    assert logits.shape == (2, 3) and z.shape == (2, 3, 3) and features.shape == (2, 3, 16)
    prototypes = model.prototypes
    for b in range(2):
        for k in range(3):
            by_hand = 10.0 * torch.dot(prototypes[k], features[b, k]) + model.classifier.bias[k]
            assert logits[b, k].item() == pytest.approx(by_hand.item(), abs=1e-4)
    assert torch.allclose(model(x), logits)


def test_model_without_ladm_uses_pooled_feature():
    model = tiny_model(use_ladm=False)
    model.eval()
    x = torch.rand(2, 1, 8, 8)
    pooled = model.backbone.forward_features(x).mean(dim=(2, 3))
    expected = 10.0 * pooled @ model.prototypes.T + model.classifier.bias
    assert torch.allclose(model(x), expected, atol=1e-5)
    with pytest.raises(ValueError, match="use_ladm=True"):
        model.forward_with_features(x)
    with pytest.raises(ValueError, match="learnable_queries"):
        tiny_model(use_ladm=False, learnable_queries=True)


def test_model_rejects_etf_of_wrong_dim():
    with pytest.raises(ValueError, match=r"expected \(16, K\)"):
        FedNCAModel(TinyBackbone(), simplex_etf(3, 8, seed=0))


def test_projection_allows_more_classes_than_backbone_dim():
    num_classes = 20  # needs >= 19 dims, the tiny backbone has 16
    with pytest.raises(ValueError, match="projection_dim"):
        simplex_etf(num_classes, TinyBackbone.feature_dim, seed=0)
    dim = etf_dim(TinyBackbone.feature_dim, projection_dim=20)
    assert dim == 20 and etf_dim(TinyBackbone.feature_dim) == 16
    model = FedNCAModel(TinyBackbone(), simplex_etf(num_classes, dim, seed=0), projection_dim=20)
    logits, _, features = model.forward_with_features(torch.rand(2, 1, 8, 8))
    assert logits.shape == (2, 20) and features.shape == (2, 20, 20)
    assert "projection.weight" in model.state_dict()


# ---------------------------------------------------------------- federated state / set_etf

def test_state_dict_is_the_federated_state_without_etf():
    keys = set(tiny_model().state_dict())
    assert not any("prototypes" in key or "queries" in key for key in keys)
    assert {
        "backbone.bn1.running_mean",
        "backbone.bn1.num_batches_tracked",
        "ladm.attention.in_proj_weight",
        "ladm.attention.in_proj_bias",
        "ladm.attention.out_proj.weight",
        "classifier.scale",
        "classifier.bias",
    } <= keys
    assert "ladm.queries" in tiny_model(learnable_queries=True).state_dict()


def test_loading_federated_state_keeps_local_etf():
    sender = tiny_model(seed=0)
    receiver = FedNCAModel(TinyBackbone(), simplex_etf(3, 16, seed=5))
    receiver.load_state_dict(sender.state_dict(), strict=True)
    assert torch.equal(receiver.prototypes, simplex_etf(3, 16, seed=5).T)


def test_set_etf_installs_valid_matrix_and_refuses_malformed():
    model = tiny_model()
    new_etf = simplex_etf(3, 16, seed=1)
    model.set_etf(new_etf)
    assert torch.equal(model.classifier.prototypes, new_etf.T)
    assert torch.equal(model.ladm.queries, new_etf.T)
    with pytest.raises(ValueError, match="cosine"):
        model.set_etf(torch.eye(16)[:, :3])
    assert torch.equal(model.classifier.prototypes, new_etf.T)


def test_set_etf_leaves_learnable_queries_alone():
    model = tiny_model(learnable_queries=True)
    queries_before = model.ladm.queries.detach().clone()
    model.set_etf(simplex_etf(3, 16, seed=1))
    assert torch.equal(model.ladm.queries.detach(), queries_before)
    assert torch.equal(model.prototypes, simplex_etf(3, 16, seed=1).T)


# ---------------------------------------------------------------- losses (hand-made batches)
# Normalisation convention under test: every loss is (sum of per-pair terms) / batch size.

def test_summed_bce_by_hand():
    logits = torch.tensor([[0.0, math.log(3)], [math.log(3), -math.log(3)]])
    targets = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    # sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4
    sample_0 = math.log(2) + math.log(4 / 3)  # -ln(1/2) - ln(3/4)
    sample_1 = math.log(4) + math.log(4 / 3)  # -ln(1 - 3/4) - ln(1 - 1/4)
    assert summed_bce(logits, targets).item() == pytest.approx((sample_0 + sample_1) / 2, abs=1e-6)


def rejection_batch():
    ln3, ln4 = math.log(3), math.log(4)
    z = torch.tensor(
        [
            [[5.0, 5.0, 5.0], [-1.0, ln3, -2.0], [0.0, -1.0, -3.0]],  # m: -, ln3 (sig .75), 0 (sig .5)
            [[-ln3, -2.0, -5.0], [6.0, 6.0, 6.0], [-1.0, -1.0, ln4]],  # m: -ln3 (sig .25), -, ln4 (sig .8)
        ],
        requires_grad=True,
    )
    return z


def test_negative_feature_rejection_keeps_n_pos_hardest_negatives():
    z = rejection_batch()
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # 2 positives -> keep 2 of 4 negatives
    loss = negative_feature_rejection(z, targets, margin=0.3, scope="all")
    # kept: (1,2) sig .8 and (0,1) sig .75 -> ((.8 - .3) + (.75 - .3)) / batch 2
    assert loss.item() == pytest.approx((0.5 + 0.45) / 2, abs=1e-6)
    loss.backward()
    touched = (z.grad != 0).nonzero().tolist()
    assert touched == [[0, 1, 1], [1, 2, 2]]  # only the argmax entries of the two kept negatives


def test_negative_feature_rejection_keeps_all_when_fewer_negatives_and_clips_at_margin():
    targets = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])  # 4 positives, 2 negatives
    # negatives: (0,2) sig .5 -> .2 ; (1,0) sig .25 -> relu(-.05) = 0 ; divided by batch 2
    assert negative_feature_rejection(rejection_batch(), targets, scope="all").item() == pytest.approx(0.2 / 2, abs=1e-6)


def test_negative_feature_rejection_is_zero_without_positives():
    assert negative_feature_rejection(rejection_batch(), torch.zeros(2, 3)).item() == 0.0


def test_negative_feature_rejection_by_default_ignores_the_own_prototype():
    z = rejection_batch()
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    loss = negative_feature_rejection(z, targets, margin=0.1)
    # max over k != j: (0,1) -1, (0,2) 0, (1,0) -2, (1,2) -1 (the own entries ln3 and ln4 are skipped);
    # keep the 2 largest: sig(0) = .5 and sig(-1) -> ((.5 - .1) + (sig(-1) - .1)) / batch 2
    sig_minus_1 = 1 / (1 + math.e)
    assert loss.item() == pytest.approx((0.4 + sig_minus_1 - 0.1) / 2, abs=1e-6)
    loss.backward()
    own_entries = z.grad.diagonal(dim1=1, dim2=2)
    assert torch.equal(own_entries, torch.zeros(2, 3))
    assert z.grad[0, 2, 0] != 0  # the kept (0,2) negative's hardest other prototype
    with pytest.raises(ValueError, match=r"rejection scope must be one of \('other', 'all'\), got 'own'"):
        negative_feature_rejection(z, targets, scope="own")


def test_positive_feature_contrastive_by_hand():
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    targets = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    features = torch.tensor(
        [
            [[2.0, 0.0], [5.0, -7.0], [-3.0, 1.0]],  # (0,0) positive; others negative, ignored
            [[4.0, 4.0], [0.0, 3.0], [1.0, 1.0]],  # (1,1), (1,2) positive
        ]
    )
    # tau = 0.5, cross-entropy = -s_target + ln(sum_k exp(s_k)), s_k = cos(f, w_k) / tau:
    # (0,0): s = [2, 0, -2], target 0 -> ln(1 + e^-2 + e^-4)
    # (1,1): s = [0, 2, 0], target 1 -> ln(1 + 2 e^-2)
    # (1,2): s = [sqrt2, sqrt2, -sqrt2], target 2 -> sqrt2 + ln(2 e^sqrt2 + e^-sqrt2) = ln(2 e^(2 sqrt2) + 1)
    pair_losses = [
        math.log(1 + math.exp(-2) + math.exp(-4)),
        math.log(1 + 2 * math.exp(-2)),
        math.log(2 * math.exp(2 * math.sqrt(2)) + 1),
    ]
    loss = positive_feature_contrastive(features, prototypes, targets, tau=0.5)
    assert loss.item() == pytest.approx(sum(pair_losses) / 2, abs=1e-5)


def test_fednca_loss_combines_terms_and_ablations_fall_back_to_bce():
    model = tiny_model()
    x, y = torch.rand(4, 1, 8, 8), torch.tensor([[1.0, 0, 0], [0, 1, 1], [0, 0, 0], [1, 1, 1]])
    logits, z, features = model.forward_with_features(x)
    bce = summed_bce(logits, y)
    rejection = negative_feature_rejection(z, y, margin=0.3)
    assert rejection.item() != pytest.approx(negative_feature_rejection(z, y, margin=0.3, scope="all").item())
    contrastive = positive_feature_contrastive(features, model.prototypes, y, tau=0.07)
    assert rejection.item() > 0 and contrastive.item() > 0
    loss_fn = functools.partial(fednca_loss, rejection_weight=0.5, contrastive_weight=2.0)
    assert loss_fn(model, x, y).item() == pytest.approx((bce + 0.5 * rejection + 2.0 * contrastive).item(), rel=1e-5)
    assert fednca_loss(model, x, y, use_regularisers=False).item() == pytest.approx(bce.item(), rel=1e-5)
    pooled_model = tiny_model(use_ladm=False)
    assert fednca_loss(pooled_model, x, y).item() == pytest.approx(summed_bce(pooled_model(x), y).item(), rel=1e-5)


# ---------------------------------------------------------------- optimiser

def test_optimizer_exempts_biases_norms_and_scale_from_weight_decay():
    model = tiny_model()
    optimizer, _ = fednca_optimizer(model, total_steps=10)
    decay_of = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    names = dict(model.named_parameters())
    assert set(decay_of) == {id(p) for p in names.values()}
    no_decay = {n for n, p in names.items() if decay_of[id(p)] == 0.0}
    assert no_decay == {
        "backbone.conv1.bias",
        "backbone.bn1.weight",
        "backbone.bn1.bias",
        "backbone.conv2.bias",
        "ladm.attention.in_proj_bias",
        "ladm.attention.out_proj.bias",
        "classifier.scale",
        "classifier.bias",
    }
    assert all(decay_of[id(p)] == 0.01 for n, p in names.items() if n not in no_decay)
    assert optimizer.defaults["betas"] == (0.9, 0.98)


def learning_rates(optimizer, scheduler, steps):
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_learning_rate_warms_up_then_decays_linearly_to_zero():
    optimizer, scheduler = fednca_optimizer(tiny_model(), total_steps=100, lr=1e-4, warmup_steps=10)
    rates = learning_rates(optimizer, scheduler, 101)
    assert rates[0] == pytest.approx(1e-5)  # step 1 of 10 warm-up steps
    assert rates[4] == pytest.approx(5e-5)
    assert rates[9] == pytest.approx(1e-4) and rates[10] == pytest.approx(1e-4)
    assert rates[55] == pytest.approx(1e-4 * 45 / 90)
    assert rates[99] == pytest.approx(1e-4 / 90)
    assert rates[100] == 0.0


def test_step_offset_continues_the_global_schedule():
    optimizer, scheduler = fednca_optimizer(tiny_model(), total_steps=100, warmup_steps=10)
    global_rates = learning_rates(optimizer, scheduler, 100)
    optimizer, scheduler = fednca_optimizer(tiny_model(), total_steps=100, warmup_steps=10, step_offset=50)
    assert learning_rates(optimizer, scheduler, 20) == pytest.approx(global_rates[50:70])


@pytest.mark.parametrize(
    "options,message",
    [
        ({"total_steps": 100, "step_offset": 100}, "step_offset"),
        ({"total_steps": 0}, "total_steps"),
        ({"total_steps": 100, "warmup_steps": 100}, "warmup_steps"),
    ],
)
def test_optimizer_rejects_bad_schedule(options, message):
    with pytest.raises(ValueError, match=message):
        fednca_optimizer(tiny_model(), **options)


# ---------------------------------------------------------------- training

def test_a_few_training_steps_lower_the_loss():
    model = tiny_model(num_classes=4)
    generator = torch.Generator().manual_seed(0)
    x = torch.rand(8, 1, 8, 8, generator=generator)
    y = (torch.rand(8, 4, generator=generator) < 0.4).float()
    optimizer, scheduler = fednca_optimizer(model, total_steps=30, lr=3e-3, warmup_steps=0)
    losses = []
    for _ in range(30):
        loss = fednca_loss(model, x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
