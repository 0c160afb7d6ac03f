"""The FedNCA-ML search's diagnostics: the validation-chosen threshold, pooled BatchNorm statistics,
the federated average and the GroupNorm ablation."""

from __future__ import annotations

import copy
import json
import math
import re

import numpy as np
import pytest
import torch

from bench.fednca_search import (
    BlockAdamW,
    ControlVariates,
    DictStore,
    FirstMomentBiasRestart,
    MimeLite,
    agreement_plot,
    backbone_lr_scaled,
    curves_plot,
    bench_options,
    cached_fractal_pretrain,
    class_feature_cosine,
    epoch_part,
    loss_terms,
    normalised_token_forward,
    federated_average,
    fresh_shifts,
    hold_then_decay,
    label_thresholds,
    f1_at,
    momentum_step,
    optimizer_restarts,
    pick_by_budget,
    pooled_sites,
    table,
    train_trial,
    recalibrated_batchnorm,
    run_trial,
    sharpness_aware,
    SiteCycle,
    validation_threshold,
    value_keyed_forward,
    warm_start_adam,
    update_agreement,
    warmup_then_cosine,
)
from fedskew import client_tasks
from fedskew.client_tasks import OPTIMIZER_SITE_STATE
from fedskew.config import RunConfig
from fedskew.data.sites import SiteData, load_task_dataset
from fedskew.data.pixels import unit_float
from fedskew.models import backbones
from fedskew.models.build import build_model, server_etf
from fedskew.models import fednca as fednca_model
from fedskew.models.fednca import fednca_loss
from fedskew.models.fractal import fractal_pretrain
from fedskew.training import make_loader


def test_the_threshold_is_the_grid_point_with_the_best_validation_macro_f1():
    # Two classes whose positives score 0.30-0.35 and negatives 0.10-0.22: 0.5 predicts nothing (macro-F1 0);
    # 0.25 is the only grid point in [0.22, 0.30), the one that separates both classes perfectly.
    labels = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    probs = np.array([[0.30, 0.10], [0.15, 0.35], [0.32, 0.31], [0.22, 0.22]])
    assert validation_threshold(labels, probs) == pytest.approx(0.25)


def test_each_label_gets_the_grid_point_that_separates_it_and_ties_go_to_the_nearest_half():
    # Class 0's positives score 0.70-0.80 and negatives 0.40-0.52: 0.55, 0.60 and 0.65 separate it, 0.55 is nearest
    # 0.5. Class 1's positives 0.20-0.25, negatives 0.05-0.12: 0.15 is the one grid point between. Class 2 has no
    # positive and scores 0.30: F1 is 0 at every threshold below 0.30 and, with nothing predicted, 0 above it too,
    # so the tie goes to 0.5. No shared threshold separates classes 0 and 1 at once.
    labels = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 0]])
    probs = np.array([[0.70, 0.05, 0.30], [0.80, 0.25, 0.30], [0.52, 0.20, 0.30], [0.40, 0.12, 0.30]])
    chosen = label_thresholds(labels, probs)
    np.testing.assert_allclose(chosen, [0.55, 0.15, 0.50])
    assert f1_at(labels[:, :2], probs[:, :2], chosen[:2]) == pytest.approx(1.0)
    assert f1_at(labels[:, :2], probs[:, :2], validation_threshold(labels[:, :2], probs[:, :2])) < 1.0


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
    with pytest.raises(ValueError, match="bench.depth"):
        with bench_options({"bench.depth": 2}):
            pass


def test_hold_then_decay_holds_the_peak_and_decays_over_the_last_share_only():
    # 10 warm-up steps of 110; share 0.2 of the 100 after warm-up: linear from 1 to 0 over steps 90..110.
    factor = hold_then_decay(0.2)
    assert [factor(s, 10, 110) for s in (0, 9, 50, 90, 100, 109, 110)] == pytest.approx([0.1, 1.0, 1.0, 1.0, 0.5, 0.05, 0.0])
    assert hold_then_decay(1.0)(60, 10, 110) == pytest.approx(0.5)  # share 1: the default schedule


def test_the_cosine_schedule_warms_up_as_the_linear_one_and_is_half_way_down_at_the_midpoint():
    # 10 warm-up steps of 110: the cosine after warm-up is 1 at step 10, 0.5 at step 60, 0 at step 110.
    assert [warmup_then_cosine(s, 10, 110) for s in (0, 9, 10, 60, 110)] == pytest.approx([0.1, 1.0, 1.0, 0.5, 0.0])
    assert warmup_then_cosine(35, 10, 110) == pytest.approx((1 + np.cos(np.pi / 4)) / 2)


def test_learning_rates_are_picked_per_budget_and_per_score_where_the_scores_disagree():
    def cells(rounds, at_half, at_threshold):
        return [{"rounds": rounds, "local_epochs": 1, "val": v, "val_thr": t} for v, t in zip(at_half, at_threshold)]

    picks = pick_by_budget([
        ("prox-0.1", "fedprox", cells(60, [0.8, 0.7, 0.1], [0.9, 0.7, 0.3])),  # means 0.533 / 0.633
        ("prox-0.2", "fedprox", cells(60, [0.7, 0.8, 0.0], [0.8, 0.8, 0.4])),  # means 0.500 / 0.667
        ("prox-short", "fedprox", cells(5, [0.9, 0.9, 0.9], [0.9, 0.9, 0.9])),  # another budget: its own pick
        ("prox-partial", "fedprox", [cells(60, [1.0], [1.0])[0], None, None]),  # incomplete: never picked
    ])
    assert picks == {"60 x 1": {"fedprox": ("prox-0.1", "prox-0.2")}, "5 x 1": {"fedprox": ("prox-short", "prox-short")}}


def test_the_etf_scale_option_sets_the_learned_scales_start_only_inside_the_block():
    from fedskew.models import fednca as fednca_model

    with bench_options({"bench.etf-scale": 3.0}):
        assert fednca_model.ETFClassifier(torch.eye(3)).scale.item() == 3.0
    assert fednca_model.ETFClassifier(torch.eye(3)).scale.item() == 10.0


class _BackboneAndHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.backbone(x))


def _squared_error(model, x, y):
    return ((model(x) - y) ** 2).mean()


def test_sam_gradient_is_the_gradient_at_the_ascended_weights_and_the_weights_come_back_exactly():
    torch.manual_seed(0)
    model, x, y, rho = _BackboneAndHead(), torch.randn(8, 4), torch.randn(8, 1), 0.1
    before = [p.detach().clone() for p in model.parameters()]
    loss = sharpness_aware(_squared_error, rho)(model, x, y)
    loss.backward()
    sam_gradients = [p.grad.clone() for p in model.parameters()]
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), before))
    # The reference, step by step: the gradient, the ascent of length rho along it, the gradient there.
    gradients = torch.autograd.grad(_squared_error(model, x, y), list(model.parameters()))
    norm = torch.sqrt(sum((g * g).sum() for g in gradients))
    ascended = copy.deepcopy(model)
    with torch.no_grad():
        for p, g in zip(ascended.parameters(), gradients):
            p.add_(rho * g / norm)
    moved = _squared_error(ascended, x, y)
    moved.backward()
    assert loss.item() == pytest.approx(moved.item(), rel=1e-6)
    for got, want in zip(sam_gradients, (p.grad for p in ascended.parameters())):
        torch.testing.assert_close(got, want)


def test_a_backbone_at_lr_scale_zero_stays_fixed_while_the_rest_follows_the_fednca_schedule():
    torch.manual_seed(0)
    model = _BackboneAndHead()
    backbone_before, head_before = copy.deepcopy(model.backbone.state_dict()), model.head.weight.detach().clone()
    schedule = dict(total_steps=10, lr=0.01, warmup_steps=2)
    optimizer, scheduler = backbone_lr_scaled(fednca_model.fednca_optimizer, 0.0)(model, **schedule)
    plain, plain_scheduler = fednca_model.fednca_optimizer(_BackboneAndHead(), **schedule)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
        plain.step()
        plain_scheduler.step()
        # The backbone's groups at 0, the others at the schedule's lr of the same step.
        backbone = {id(p) for p in model.backbone.parameters()}
        for group in optimizer.param_groups:
            in_backbone = {id(p) in backbone for p in group["params"]}
            assert len(in_backbone) == 1
            assert group["lr"] == (0.0 if in_backbone.pop() else plain.param_groups[0]["lr"])
    assert all(torch.equal(v, backbone_before[k]) for k, v in model.backbone.state_dict().items())
    assert not torch.equal(model.head.weight, head_before)


def test_two_decay_shapes_at_once_are_refused_rather_than_one_silently_winning():
    with pytest.raises(ValueError, match="bench.decay-share and bench.cosine-decay"):
        with bench_options({"bench.decay-share": 0.2, "bench.cosine-decay": True}):
            pass


def test_a_cached_fractal_backbone_leaves_the_weights_and_the_rng_where_pretraining_leaves_them(tmp_path, capsys, monkeypatch):
    def pretrained(pretrain, init_seed: int = 0):
        torch.manual_seed(init_seed)
        backbone = backbones.build_backbone("small-cnn", 3, 12)
        pretrain(backbone, 3, 12, 1, 0, categories=2, per_category=4)
        return backbone.state_dict(), torch.rand(3)  # the draw after it: the RNG state the pretraining left

    weights, draw = pretrained(fractal_pretrain)
    for run in ("miss", "hit"):
        cached_weights, cached_draw = pretrained(cached_fractal_pretrain(tmp_path))
        assert all(torch.equal(weights[name], cached_weights[name]) for name in weights), run
        assert torch.equal(draw, cached_draw), run
    assert len(list(tmp_path.glob("*.pt"))) == 1 and "pretrained earlier" in capsys.readouterr().out
    other_start, _ = pretrained(cached_fractal_pretrain(tmp_path), init_seed=1)  # other weights: another entry
    assert len(list(tmp_path.glob("*.pt"))) == 2
    assert not all(torch.equal(weights[name], other_start[name]) for name in weights)
    with monkeypatch.context() as patch:  # an edited pretraining is never served from the entry of the older one
        patch.setattr("bench.fednca_search.inspect.getsource", lambda module: "# edited\n")
        pretrained(cached_fractal_pretrain(tmp_path))
    assert len(list(tmp_path.glob("*.pt"))) == 3


def test_width_and_train_images_options_apply_only_inside_the_block():
    cfg = RunConfig.from_run_config({"dataset": "shapes-multi", "image-size": 16, "mosaic-grid": 0, "partition": "iid"})
    with bench_options({"bench.width": 8, "bench.train-images": 300}):
        assert backbones.build_backbone("small-cnn", 3, 16).feature_dim == 16
        assert len(load_task_dataset(cfg).train_labels) == 300
    assert backbones.build_backbone("small-cnn", 3, 16).feature_dim == 64
    assert len(load_task_dataset(cfg).train_labels) == 2000


def test_server_momentum_accumulates_the_averages_steps_and_leaves_batchnorm_statistics_averaged():
    # Round 1 from w=0 to the average 1: v=1, w=1. Round 2 the average moves w to 1.5: v = 0.5 + 0.9 * 1 = 1.4,
    # w = 1 + 1.4 = 2.4. The running variance is not a parameter: it is the average, never extrapolated.
    weights, velocity = momentum_step({"w": torch.tensor([0.0]), "var": torch.tensor([1.0])},
                                      {"w": torch.tensor([1.0]), "var": torch.tensor([0.5])}, {}, 0.9, ["w"])
    assert weights["w"].item() == pytest.approx(1.0) and velocity["w"].item() == pytest.approx(1.0)
    weights, velocity = momentum_step(weights, {"w": torch.tensor([1.5]), "var": torch.tensor([0.2])}, velocity, 0.9, ["w"])
    assert weights["w"].item() == pytest.approx(2.4) and weights["var"].item() == pytest.approx(0.2)
    assert weights["w"].dtype == torch.float32


def test_optimizer_restarts_forget_adams_state_every_n_steps_like_a_fresh_site_optimiser():
    # Adam's first step after a restart moves every weight by lr (m / sqrt(v) = sign(g) after bias correction);
    # a continuing Adam's second step on a gradient 10x smaller moves it by lr * m_hat / sqrt(v_hat) with
    # m_hat = (0.9 * 0.1 + 0.1 * 0.1) / (1 - 0.9^2) and v_hat = (0.999 * 0.001 + 0.001 * 0.01) / (1 - 0.999^2).
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.0)
    restart = optimizer_restarts(optimizer, every=2)
    moves = []
    for gradient in (1.0, 0.1, 0.1):
        weight.grad = torch.tensor([gradient])
        restart()
        before = weight.item()
        optimizer.step()
        moves.append(before - weight.item())
    assert moves[0] == pytest.approx(0.1, rel=1e-4) and moves[2] == pytest.approx(0.1, rel=1e-4)
    m_hat, v_hat = (0.9 * 0.1 + 0.1 * 0.1) / (1 - 0.9**2), (0.999 * 0.001 + 0.001 * 0.01) / (1 - 0.999**2)
    assert moves[1] == pytest.approx(0.1 * m_hat / v_hat**0.5, rel=1e-4)
    assert optimizer.state[weight]["step"].item() == 1  # the third step was the first after the restart


def test_a_zeroed_first_moment_restarts_its_bias_correction_while_the_second_keeps_its_step_count():
    # Step count 100 and v = 4 kept, m zeroed. With the restart the first step's m_hat is g itself
    # (0.1 g / (1 - 0.9)), and v_hat = (0.98 * 4 + 0.02 g^2) / (1 - 0.98^101): the move is lr * g / sqrt(v_hat).
    # Plain AdamW divides m by 1 - 0.9^101 = 1 and moves 0.1x that. The lr is back after the step; a fresh
    # AdamW (no state) moves lr * sign(g), as without the hook.
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=0.1, betas=(0.9, 0.98), weight_decay=0.0)
    optimizer.state[weight] = {"step": torch.tensor(100.0), "exp_avg": torch.zeros(1), "exp_avg_sq": torch.tensor([4.0])}
    restart = FirstMomentBiasRestart(optimizer)
    weight.grad = torch.tensor([0.5])
    optimizer.step()
    v_hat = (0.98 * 4 + 0.02 * 0.25) / (1 - 0.98**101)
    assert -weight.item() == pytest.approx(0.1 * 0.5 / v_hat**0.5, rel=1e-5)
    assert optimizer.param_groups[0]["lr"] == 0.1
    # Second step, same gradient: m = 0.9 * 0.05 + 0.05, corrected by 1 - 0.9^2.
    before, v_hat = weight.item(), (0.98 * (0.98 * 4 + 0.005) + 0.005) / (1 - 0.98**102)
    optimizer.step()
    assert before - weight.item() == pytest.approx(0.1 * (0.095 / 0.19) / v_hat**0.5, rel=1e-5)
    optimizer.state.clear()
    restart.restart()
    before = weight.item()
    optimizer.step()
    assert before - weight.item() == pytest.approx(0.1, rel=1e-5)


def test_the_bias_restart_is_refused_where_no_first_moment_is_zeroed_and_patches_the_sites_only_inside_the_block():
    with pytest.raises(ValueError, match="bench.first-moment-bias-restart"):
        with bench_options({"bench.first-moment-bias-restart": True}):
            pass
    original = client_tasks.local_optimisation
    with bench_options({"bench.average-optimizer-state": "second-moment", "bench.first-moment-bias-restart": True}):
        assert client_tasks.local_optimisation is not original
    assert client_tasks.local_optimisation is original


def test_warm_started_adam_takes_its_first_step_as_if_it_had_seen_the_batches_and_leaves_the_model_alone():
    # loss = sum(w * x) has gradient sum(x): batches of 1 and 3 give mean g = 2 and mean g^2 = 5 over K = 2.
    # After the warm start the step count is 2, so the next step (gradient 2) uses bias corrections at step 3:
    # m = 0.9 * 2 (1 - 0.9^2) + 0.1 * 2, v = 0.999 * 5 (1 - 0.999^2) + 0.001 * 4. A fresh Adam would move lr.
    linear, norm = torch.nn.Linear(1, 1, bias=False), torch.nn.BatchNorm1d(1)
    model = torch.nn.Sequential(norm, linear)
    torch.nn.init.zeros_(linear.weight)
    optimizer = torch.optim.AdamW([linear.weight], lr=0.1, weight_decay=0.0)
    marker = torch.tensor([[7.0]])
    linear.weight.grad = marker.clone()
    no_label = torch.zeros(1)
    batches = [(torch.tensor([[1.0], [2.0]]), no_label), (torch.tensor([[3.0], [5.0]]), no_label)]
    warm_start_adam(optimizer, linear, [(torch.tensor([[1.0]]), no_label), (torch.tensor([[3.0]]), no_label)],
                    lambda net, x, y: net(x).sum(), torch.device("cpu"))
    assert torch.equal(linear.weight.grad, marker)  # the caller's gradient survives the pass
    assert optimizer.state[linear.weight]["step"].item() == 2
    linear.weight.grad = torch.tensor([[2.0]])
    optimizer.step()
    m_hat = (0.9 * 2 * (1 - 0.9**2) + 0.1 * 2) / (1 - 0.9**3)
    v_hat = (0.999 * 5 * (1 - 0.999**2) + 0.001 * 4) / (1 - 0.999**3)
    assert -linear.weight.item() == pytest.approx(0.1 * m_hat / v_hat**0.5, rel=1e-4)
    # BatchNorm statistics are what they were before the gradient pass.
    warm_start_adam(optimizer, model, batches, lambda net, x, y: net(x).sum(), torch.device("cpu"))
    assert torch.equal(norm.running_mean, torch.zeros(1)) and norm.num_batches_tracked.item() == 0


def test_mime_lite_sites_step_from_the_servers_moments_which_only_the_server_updates():
    # loss = sum(w * x): a site's gradient is sum(x) whatever w is. Site A (1 example, batches [1], [3]: mean g 2,
    # mean g^2 5), site B (3 examples, batches [4], [4]: mean g 4, mean g^2 16). Weights 1/4 and 3/4: the server's
    # first update gives m = 0.1 * 3.5 and, from the batch squares, v = 0.02 * 13.25 (from the mean gradient:
    # 0.02 * 3.5^2). Every local step then starts from those moments at step 1: m' = 0.9 m + 0.1 g,
    # v' = 0.98 v + 0.02 g^2, bias-corrected at step 2, so two steps with gradient 1 move the weight twice by the
    # same amount, and the server's moments are unchanged by them.
    def loss(net, x, y):
        return net(x).sum()

    def site(mime, batches, examples, steps):
        linear = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(linear.weight)
        optimizer = torch.optim.AdamW([linear.weight], lr=0.1, betas=(0.5, 0.5), weight_decay=0.0)  # MimeLite's rule
        moves = []

        def train_local(model, loader, *, optimizer, loss_fn, device):
            for _ in range(steps):
                before = model.weight.item()
                model.weight.grad = torch.tensor([[1.0]])
                optimizer.step()
                moves.append(before - model.weight.item())
            return {}

        mime.train = train_local
        mime.train_local(linear, [(torch.tensor([[b]]), torch.zeros(1)) for b in batches], optimizer=optimizer,
                         loss_fn=loss, device=torch.device("cpu"))
        return moves, {"num-examples": examples}

    for second, v in (("batch-squares", 0.02 * 13.25), ("mean-gradient", 0.02 * 3.5**2)):
        mime = MimeLite(second, (0.9, 0.98))
        first_round = [site(mime, [1.0, 3.0], 1, 1), site(mime, [4.0, 4.0], 3, 1)]
        assert [moves for moves, _ in first_round] == [[pytest.approx(0.1)], [pytest.approx(0.1)]]  # fresh AdamW
        mime.update([weights for _, weights in first_round])
        assert mime.first[0].item() == pytest.approx(0.35) and mime.second[0].item() == pytest.approx(v)
        moves, _ = site(mime, [1.0], 1, 2)
        m_hat, v_hat = (0.9 * 0.35 + 0.1) / (1 - 0.9**2), (0.98 * v + 0.02) / (1 - 0.98**2)
        assert moves == [pytest.approx(0.1 * m_hat / v_hat**0.5, rel=1e-5)] * 2
        assert mime.first[0].item() == pytest.approx(0.35) and mime.updates == 1
    with pytest.raises(ValueError, match="bench.mime-lite"):
        MimeLite("both", (0.9, 0.98))


def test_block_adamw_scales_each_row_by_its_mean_squared_gradient_and_each_vector_as_a_whole():
    # First step, no weight decay: m_hat = g and v_hat = the block's mean of g^2. Rows [1, 3] and [2, 2] have mean
    # squares 5 and 4, so they move by lr * [1, 3] / sqrt(5) and lr * [1, 1]; the vector [3, 4] is one block
    # (mean square 12.5). AdamW would move every one of these weights by lr. Decoupled weight decay shrinks a
    # weight by lr * wd first.
    matrix, vector = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = BlockAdamW([{"params": [matrix], "weight_decay": 0.0}, {"params": [vector], "weight_decay": 0.0}],
                           lr=0.1, betas=(0.9, 0.98))
    matrix.grad, vector.grad = torch.tensor([[1.0, 3.0], [2.0, 2.0]]), torch.tensor([3.0, 4.0])
    optimizer.step()
    assert torch.allclose(-matrix, 0.1 * torch.tensor([[1 / 5**0.5, 3 / 5**0.5], [1.0, 1.0]]), rtol=1e-5)
    assert torch.allclose(-vector, 0.1 * torch.tensor([3.0, 4.0]) / 12.5**0.5, rtol=1e-5)
    decayed = torch.nn.Parameter(torch.ones(1, 1))
    BlockAdamW([decayed], lr=0.1, betas=(0.9, 0.98), weight_decay=0.5).step()  # no gradient: untouched
    assert decayed.item() == 1.0
    decayed.grad = torch.ones(1, 1)
    BlockAdamW([decayed], lr=0.1, betas=(0.9, 0.98), weight_decay=0.5).step()
    assert decayed.item() == pytest.approx(1 * (1 - 0.05) - 0.1, rel=1e-6)


def test_table_gives_mean_and_sample_sd_over_seeds(tmp_path):
    rows = [{"trial": "default-fednca", "dataset": "digits-mosaic", "seed": seed, "test_thr": f1, "test_auc": 0.9}
            for seed, f1 in enumerate([0.7, 0.8, 0.9])]
    rows.append({"trial": "default-fednca", "dataset": "digits-mosaic", "seed": 7, "test_thr": 0.0, "test_auc": 0.5})
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = table(tmp_path, [0, 1, 2])  # seed 7 is not asked for
    assert "| fednca | 0.800 ± 0.100 (n=3) | 0.900 ± 0.000 |" in text
    assert "| fedavg | - | - |" in text
    named = table(tmp_path, [0, 1, 2], ["default-fednca", "centralized-e2-r60"])  # any trials, in the order given
    assert named.splitlines()[2:] == ["| fednca | 0.800 ± 0.100 (n=3) | 0.900 ± 0.000 |", "| centralized-e2-r60 | - | - |"]
    columns = table(tmp_path, [0, 1, 2], ["default-fednca"], ["shapes-multi-32", "digits-mosaic"])  # in that order
    assert columns.splitlines()[0] == "| method | shapes-multi-32 macro-F1 | AUC | digits-mosaic macro-F1 | AUC |"
    assert columns.splitlines()[2] == "| fednca | - | - | 0.800 ± 0.100 (n=3) | 0.900 ± 0.000 |"


def test_the_sites_share_the_averaged_optimiser_state_only_from_the_chosen_round_on(monkeypatch):
    # Each fake site records the state it starts from and keeps v = round x (site + 1) with one example per
    # site. From round 3 on the server hands every site the average (round 3: v = 3 x 1.5 = 4.5), and the
    # first moment is zeroed ("second-moment"); before it every round starts from a fresh AdamW (empty state).
    cfg = RunConfig.from_run_config({"method": "fednca", "num-server-rounds": 4, "local-epochs": 1,
                                     "fednca.keep-optimizer-state": True})
    model = torch.nn.Linear(1, 1)
    received = []

    def fake_train_site(cfg, site, state, *, server_round, site_state, **rest):
        received.append((server_round, site, site_state.get(OPTIMIZER_SITE_STATE)))
        v = float(server_round * (site + 1))
        site_state.put(OPTIMIZER_SITE_STATE, {"0.exp_avg": torch.tensor([1.0]), "0.exp_avg_sq": torch.tensor([v])})
        return dict(state), {"num-examples": 1, "train_loss": 0.0}

    monkeypatch.setattr("bench.fednca_search.train_site", fake_train_site)
    train_trial(cfg, [0, 1], model, None, lambda m: {"val_auc": 0.5}, average_optimizer_state="second-moment",
                shared_state_from_round=3)
    starts = {(r, k): state for r, k, state in received}
    assert starts[(1, 0)] is None and starts[(2, 0)] == {} and starts[(3, 1)] == {}
    assert starts[(4, 0)]["0.exp_avg_sq"].item() == pytest.approx(4.5)
    assert starts[(4, 1)]["0.exp_avg"].item() == 0.0
    with pytest.raises(ValueError, match="bench.shared-state-from-round"):
        with bench_options({"bench.shared-state-from-round": 20}):
            pass


def test_epoch_parts_cover_each_image_once_per_epoch_in_an_order_drawn_afresh_each_epoch():
    # 10 images whose pixel value is their index: parts of rounds 1-3 (epoch 0) partition them, and round 4
    # (epoch 1) starts another order; one part is the site itself.
    images = np.arange(10, dtype=np.uint8).reshape(10, 1, 1, 1)
    site = SiteData(site_id=3, num_sites=10, train_images=images, train_labels=np.eye(10, dtype=np.float32),
                    val_images=images[:1], val_labels=np.eye(10, dtype=np.float32)[:1], num_classes=10,
                    class_names=tuple("abcdefghij"))
    split = {r: epoch_part(site, r, 3, seed=0) for r in range(1, 7)}
    for epoch_rounds in ((1, 2, 3), (4, 5, 6)):
        seen = np.concatenate([split[r].train_images.ravel() for r in epoch_rounds])
        assert sorted(seen) == list(range(10)) and all(len(split[r].train_labels) in (3, 4) for r in epoch_rounds)
        for r in epoch_rounds:  # images and labels stay paired
            assert np.array_equal(split[r].train_labels.argmax(1), split[r].train_images.ravel())
    assert not np.array_equal(split[1].train_images, split[4].train_images)
    assert epoch_part(site, 5, 1, seed=0) is site


def test_pooled_sites_hold_every_nth_sites_images_paired_with_their_labels_once():
    # Four sites whose pixel values are their images' global indices and whose labels one-hot encode them.
    def site(k: int, sizes: tuple[int, int]) -> SiteData:
        start = 10 * k
        train, val = np.arange(start, start + sizes[0]), np.arange(start + 5, start + 5 + sizes[1])
        one_hot = np.eye(40, dtype=np.float32)
        return SiteData(site_id=k, num_sites=4, train_images=train.astype(np.uint8).reshape(-1, 1, 1, 1),
                        train_labels=one_hot[train], val_images=val.astype(np.uint8).reshape(-1, 1, 1, 1),
                        val_labels=one_hot[val], num_classes=40, class_names=tuple(map(str, range(40))))
    sites = [site(0, (3, 1)), site(1, (5, 2)), site(2, (1, 3)), site(3, (2, 2))]
    for groups, members in ((1, [[0, 1, 2, 3]]), (2, [[0, 2], [1, 3]])):
        pooled = pooled_sites(sites, groups)
        assert [(p.site_id, p.num_sites, p.num_classes) for p in pooled] == [(g, groups, 40) for g in range(groups)]
        for site_pool, member in zip(pooled, members):
            for images, labels in (("train_images", "train_labels"), ("val_images", "val_labels")):
                expected = np.concatenate([getattr(sites[k], images).ravel() for k in member])
                assert np.array_equal(getattr(site_pool, images).ravel(), expected)
                assert np.array_equal(getattr(site_pool, labels).argmax(1), expected)
        assert sum(len(p.train_labels) for p in pooled) == 11 and sum(len(p.val_labels) for p in pooled) == 8
    for bad in (0, 11, 2.5, True):
        with pytest.raises(ValueError, match="bench.pooled-sites .* an int from 1 to 10"):
            with bench_options({"bench.pooled-sites": bad}):
                pass


def test_loss_terms_add_up_to_the_training_loss_and_cosines_are_cosines():
    # One batch of 40 mosaics: the weighted terms are FedNCA-ML's loss itself (the same model in evaluation mode).
    cfg = RunConfig.from_run_config({"method": "fednca", "dataset": "digits", "mosaic-grid": 2})
    data = load_task_dataset(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, data.num_classes, data.image_shape, etf=server_etf(cfg, data.num_classes, data.image_shape))
    images, labels = data.test_images[:40], data.test_labels[:40]
    terms = loss_terms(model, images, labels, cfg)
    x = unit_float(torch.from_numpy(images))
    with torch.no_grad():
        total = float(fednca_loss(model.eval(), x, torch.from_numpy(labels).float()))
    weighted = terms["bce"] + cfg.fednca.rejection_weight * terms["rejection"] + cfg.fednca.contrastive_weight * terms["contrastive"]
    # Each term is rounded to 1e-4: at most 0.5e-4 x (1 + 0.01 + 1) apart, plus float32 summation.
    assert weighted == pytest.approx(total, abs=2e-4)
    assert -1 <= terms["cos_absent"] <= 1 and -1 <= terms["cos_present"] <= 1


def test_class_feature_cosine_is_one_where_every_class_attends_alike_and_minus_one_over_k_minus_one_on_the_etf():
    cfg = RunConfig.from_run_config({"method": "fednca", "dataset": "digits", "mosaic-grid": 2})
    data = load_task_dataset(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, data.num_classes, data.image_shape, etf=server_etf(cfg, data.num_classes, data.image_shape))
    images = data.test_images[:300]  # two evaluation batches of 256, the second short: pairs are counted per image
    dim = model.ladm.attention.embed_dim
    with torch.no_grad():
        model.ladm.attention.in_proj_weight[:dim] = 0.0  # every class's query projects to the same vector
    assert class_feature_cosine(model, images) == pytest.approx(1.0, abs=1e-4)

    class OnTheirPrototypes(torch.nn.Module):  # each class feature is its own ETF prototype, for every image
        prototypes = model.prototypes

        def forward_with_features(self, x):
            return None, None, 3.0 * self.prototypes.expand(len(x), -1, -1)

    k = data.num_classes
    assert class_feature_cosine(OnTheirPrototypes(), images) == pytest.approx(-1 / (k - 1), abs=1e-4)


def ladm_with_identity_values(k: int = 4, dim: int = 8) -> fednca_model.LADM:
    ladm = fednca_model.LADM(fednca_model.simplex_etf(k, dim, seed=0).T, num_heads=1)
    with torch.no_grad():  # values and output pass the tokens through unchanged
        ladm.attention.in_proj_weight[2 * dim:] = torch.eye(dim)
        ladm.attention.in_proj_bias.zero_()
        ladm.attention.out_proj.weight.copy_(torch.eye(dim))
        ladm.attention.out_proj.bias.zero_()
    return ladm


def test_value_keyed_attention_pools_at_temperature_zero_and_sends_each_class_to_its_own_token():
    ladm = ladm_with_identity_values()
    tokens = 5.0 * ladm.queries.unsqueeze(0)  # token j is class j's prototype, scaled: it scores 5 on it
    pooled = value_keyed_forward(0.0)(ladm, tokens)
    assert torch.allclose(pooled, tokens.mean(dim=1, keepdim=True).expand_as(pooled), atol=1e-6)
    # At temperature t, class j weighs token n by softmax_n(t * 5 * <w_j, w_n>): 5t on its own token, -5t/(K-1) on
    # the others, so its own token's weight is e^(5t) / (e^(5t) + (K-1) e^(-5t/(K-1))).
    k, t = 4, 1.0
    own = math.exp(5 * t) / (math.exp(5 * t) + (k - 1) * math.exp(-5 * t / (k - 1)))
    features = value_keyed_forward(t)(ladm, tokens)[0]
    expected = own * tokens[0] + (1 - own) / (k - 1) * (tokens[0].sum(dim=0, keepdim=True) - tokens[0])
    assert torch.allclose(features, expected, atol=1e-5)


def test_token_norm_gives_the_ladm_tokens_of_zero_mean_and_unit_variance_over_channels_or_positions():
    ladm = ladm_with_identity_values()
    tokens = torch.randn(2, 6, 8) * 4.0 + 3.0
    over_channels = torch.nn.functional.layer_norm(tokens, (8,))
    assert torch.allclose(normalised_token_forward("channels")(ladm, tokens), ladm(over_channels), atol=1e-5)
    over_positions = normalised_token_forward("positions")
    # Over positions, an image whose tokens are all one vector has nothing left to read: every class gets the
    # values' bias alone (0 here), whatever its attention.
    flat = torch.ones(1, 6, 8) * torch.arange(8.0)
    assert torch.allclose(over_positions(ladm, flat), torch.zeros(1, 4, 8), atol=1e-4)
    # and adding one vector to every token, or scaling each channel, changes nothing.
    shifted = tokens * torch.linspace(0.5, 2.0, 8) + torch.randn(1, 1, 8)
    assert torch.allclose(over_positions(ladm, shifted), over_positions(ladm, tokens), atol=1e-4)
    assert not torch.allclose(ladm(shifted), ladm(tokens), atol=1e-3)
    with pytest.raises(ValueError, match="each replace the LADM's forward; give one"):
        with bench_options({"bench.token-norm": "channels", "bench.value-keyed-attention": 1.0}):
            pass
    with pytest.raises(ValueError, match="'channels' or 'positions'; got 'tokens'"):
        with bench_options({"bench.token-norm": "tokens"}):
            pass


def test_update_agreement_is_one_for_equal_changes_zero_for_opposite_and_splits_the_attention_projection():
    dim = 2
    global_state = {"backbone.w": torch.zeros(2), "ladm.attention.in_proj_weight": torch.zeros(3 * dim, dim)}
    in_proj = torch.zeros(3 * dim, dim)
    in_proj[:dim] = 1.0  # query third: the same change at both sites
    in_proj[dim:2 * dim, 0] = 1.0  # key third: orthogonal changes of equal norm
    other_in_proj = in_proj.clone()
    other_in_proj[dim:2 * dim] = 0.0
    other_in_proj[dim:2 * dim, 1] = 1.0
    other_in_proj[2 * dim:] = -2.0  # value third: changes only here at site 2, so one site's change of 0 against 4
    site_one = ({"backbone.w": torch.tensor([1.0, 0.0]), "ladm.attention.in_proj_weight": in_proj}, {"num-examples": 1})
    site_two = ({"backbone.w": torch.tensor([-1.0, 0.0]), "ladm.attention.in_proj_weight": other_in_proj},
                {"num-examples": 1})
    agreement = update_agreement(global_state, [site_one, site_two], ["backbone.w", "ladm.attention.in_proj_weight"])
    assert agreement["backbone"] == 0.0  # opposite changes cancel
    assert agreement["attention.query"] == 1.0
    assert agreement["attention.key"] == pytest.approx(2 ** -0.5, abs=1e-4)  # |a + b| / (|a| + |b|), a ⊥ b
    assert agreement["attention.value"] == 1.0  # a single site moving: its half survives, over half its norm
    site_two[1]["num-examples"] = 3  # example weights 1/4, 3/4 on opposite changes: |1/4 - 3/4| / 1
    assert update_agreement(global_state, [site_one, site_two], ["backbone.w"])["backbone"] == 0.5


def test_the_agreement_plot_draws_every_federated_trial_and_refuses_a_log_without_one(tmp_path):
    rows = [{"trial": "default-fednca", "dataset": "digits-mosaic", "seed": 0,
             "update_agreement_by_round": {"backbone": [0.5, 0.4], "classifier": [0.9, 1.0]}},
            {"trial": "default-centralized", "dataset": "digits-mosaic", "seed": 0}]
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = agreement_plot(tmp_path)
    assert path == tmp_path / "agreement.png" and path.read_bytes().startswith(b"\x89PNG")
    (tmp_path / "trials.jsonl").write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(SystemExit, match="recorded update_agreement_by_round"):
        agreement_plot(tmp_path)


def test_a_head_start_trains_only_the_later_rounds_with_the_schedule_where_the_run_has_it(monkeypatch):
    # The bound's epochs 1-2 are the head start; rounds 3-5 follow. The sites are asked for rounds 3-5 only, and the
    # bound continued from epoch 3 starts at the schedule's step 2 x (steps an epoch), not at its warm-up's first.
    cfg = RunConfig.from_run_config({"method": "fednca", "num-server-rounds": 5, "local-epochs": 1,
                                     "fednca.warmup-epochs": 1})
    asked = []

    def fake_train_site(cfg, site, state, *, server_round, **rest):
        asked.append(server_round)
        return dict(state), {"num-examples": 1, "train_loss": 0.0}

    monkeypatch.setattr("bench.fednca_search.train_site", fake_train_site)
    trace = train_trial(cfg, [0, 1], torch.nn.Linear(1, 1), None, lambda m: {"val_auc": 0.5}, rounds=range(3, 6))
    assert asked == [3, 3, 4, 4, 5, 5] and len(trace["val_auc_by_round"]) == 3

    first_lrs = []

    def fake_train_local(model, loader, *, optimizer, **rest):
        first_lrs.append(optimizer.param_groups[0]["lr"])
        return {"train_loss": 0.0}

    monkeypatch.setattr("bench.fednca_search.train_local", fake_train_local)
    bound = cfg.model_copy(update={"method": "centralized"})
    site = SiteData(site_id=0, num_sites=1, num_classes=2, train_images=np.zeros((64, 1, 4, 4), np.uint8),
                    train_labels=np.zeros((64, 2), np.float32), val_images=np.zeros((0, 1, 4, 4), np.uint8),
                    val_labels=np.zeros((0, 2), np.float32), class_names=("a", "b"))
    train_trial(bound, [site], torch.nn.Linear(1, 1), None, lambda m: {"val_auc": 0.5}, rounds=range(3, 6))
    # 64 images at batch 32: 2 steps an epoch, 10 in the run, warm-up 2; step 4 is at (10 - 4) / (10 - 2) of the peak.
    assert first_lrs[0] == pytest.approx(cfg.fednca.lr * 6 / 8) and len(first_lrs) == 3


def test_a_head_start_that_keeps_the_backbone_hands_over_the_rest_as_the_run_started_it(monkeypatch):
    cfg = RunConfig.from_run_config({"method": "fednca", "dataset": "digits", "mosaic-grid": 2,
                                     "num-server-rounds": 3, "local-epochs": 1})
    handed = []

    def fake_train_trial(cfg, sites, model, etf, probe, *args, rounds, **rest):
        if rounds[0] == 1:  # the head start: every weight moves
            with torch.no_grad():
                for tensor in model.state_dict().values():
                    tensor += 1
        else:
            handed.append(copy.deepcopy(model.state_dict()))
        return {"val_auc_by_round": [], "train_loss_by_round": []}

    monkeypatch.setattr("bench.fednca_search.train_trial", fake_train_trial)
    monkeypatch.setattr("bench.fednca_search.diagnose", lambda *args: {})
    run_trial(cfg, 1.0, {"bench.start-from-bound-epoch": 1, "bench.head-start-keeps": "backbone"})
    data = load_task_dataset(cfg)
    torch.manual_seed(cfg.seed)
    start = build_model(cfg, data.num_classes, data.image_shape, etf=server_etf(cfg, data.num_classes, data.image_shape))
    for name, tensor in start.state_dict().items():
        moved = tensor + 1 if name.startswith("backbone.") else tensor
        assert torch.equal(handed[0][name], moved), name
    with pytest.raises(ValueError, match="give it with bench.start-from-bound-epoch"):
        run_trial(cfg, 1.0, {"bench.head-start-keeps": "backbone"})


@pytest.mark.parametrize("epochs", [60, -1, 2.5, True])
def test_a_head_start_outside_the_run_is_refused_before_any_data_is_drawn(epochs):
    cfg = RunConfig.from_run_config({"method": "fednca", "num-server-rounds": 60})
    with pytest.raises(ValueError, match=r"bench.start-from-bound-epoch is how many .* an int from 1 to 59; got"):
        run_trial(cfg, 1.0, {"bench.start-from-bound-epoch": epochs})


def test_cyclic_weight_transfer_visits_each_site_whole_in_turn_reshuffled_every_pass():
    # Site k's images hold the value 10 k + i: a pass yields all of site 0's, then all of site 1's, each once.
    sizes = (5, 3)
    loaders = [make_loader(np.array([10 * k + i for i in range(n)], np.uint8).reshape(n, 1, 1, 1),
                           np.zeros((n, 2), np.float32), batch_size=2, shuffle=True, seed=k) for k, n in enumerate(sizes)]
    cycle = SiteCycle(loaders)
    assert len(cycle) == 3 + 2 and len(cycle.dataset) == 8
    passes = [[round(float(v) * 255) for x, _ in cycle for v in x.flatten()] for _ in range(4)]
    for seen in passes:
        assert sorted(seen[:5]) == [0, 1, 2, 3, 4] and sorted(seen[5:]) == [10, 11, 12]
    assert len({tuple(seen[:5]) for seen in passes}) > 1  # a fresh order each pass, not one fixed order


@pytest.mark.filterwarnings("ignore:No artists with labels")  # the colour check below draws nothing
def test_the_curves_plot_draws_the_named_trials_per_seed_and_names_a_missing_one(tmp_path, monkeypatch):
    rows = [{"trial": name, "dataset": "shapes-multi-32", "seed": seed, "val_auc_by_round": [0.5, 0.6, 0.7]}
            for name in ("default-fednca", "default-centralized") for seed in (0, 1)]
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    path = curves_plot(tmp_path, ["default-fednca", "default-centralized"], [0, 1])
    assert path == tmp_path / "curves.png" and path.read_bytes().startswith(b"\x89PNG")
    height = int.from_bytes(path.read_bytes()[20:24], "big")  # the PNG header's image height
    rows[0]["class_feature_cosine_by_round"] = [1.0, 0.9, 0.5]  # a second row of panels: the class features' cosine
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert int.from_bytes(curves_plot(tmp_path, ["default-fednca", "default-centralized"], [0, 1]).read_bytes()[20:24],
                          "big") == 2 * height
    with pytest.raises(SystemExit, match=r"\('default-fednca', 2\)"):
        curves_plot(tmp_path, ["default-fednca"], [0, 2])
    drawn = {}  # each trial in one colour on every panel, though seed 1's rows come in the other order
    monkeypatch.setattr("matplotlib.axes.Axes.plot",
                        lambda axis, x, y, **style: drawn.setdefault(style["label"], set()).add(style.get("color")))
    rows[1], rows[3] = rows[3], rows[1]  # seed 1: the bound's row first
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    curves_plot(tmp_path, ["default-fednca", "default-centralized"], [0, 1])
    assert len(drawn) == 2 and all(len(colours) == 1 for colours in drawn.values())
    assert drawn["shapes-multi-32, default-fednca"] != drawn["shapes-multi-32, default-centralized"]
    with pytest.raises(SystemExit, match=r"\('default-fednca', 0\)"):  # none of them on another data set
        curves_plot(tmp_path, ["default-fednca"], [0], datasets=["digits-mosaic"])


def test_a_misspelled_trial_is_named_instead_of_running_nothing(tmp_path):
    from bench.fednca_search import main

    with pytest.raises(SystemExit, match="no trial called fednca-e1-r60-from-bound13"):
        main(["--out", str(tmp_path), "--trials", "default-fednca,fednca-e1-r60-from-bound13"])


def test_every_trial_the_docs_name_exists():
    # The docs' commands only parse their arguments in tests/test_docs.py; a renamed trial would run nothing.
    from pathlib import Path

    from bench.fednca_search import TABLE_TRIALS, TRIALS

    known = {name for name, _, _ in TRIALS} | set(TABLE_TRIALS)
    root = Path(__file__).resolve().parents[1]
    named = [(page.name, trial) for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
             for trials in re.findall(r"bench\.fednca_search[^\n]*?--trials ([\w.,-]+)", page.read_text())
             for trial in trials.split(",")]
    assert named and [(page, trial) for page, trial in named if trial not in known] == []


def test_control_variates_shift_each_gradient_by_the_mean_of_every_sites_last_round_less_the_sites_own():
    model = torch.nn.Linear(2, 1, bias=False)
    stores = [DictStore(), DictStore()]
    variates = ControlVariates()

    def round_of(site: int, gradients: list[list[float]]) -> tuple[list[torch.Tensor], bool]:
        """The gradients AdamW would step with, given the raw ones the loss produced."""
        before_step, finish, restored = variates.drift_correction(None, model, stores[site], None, len(gradients))
        stepped = []
        for gradient in gradients:
            model.weight.grad = torch.tensor([gradient])
            before_step()
            stepped.append(model.weight.grad.clone())
        assert finish() == {}  # nothing travels: the bench keeps the controls where the sites and server would
        return stepped, restored

    first, restored = round_of(0, [[1.0, 2.0], [3.0, -2.0]])
    assert not restored and torch.equal(torch.stack(first), torch.tensor([[[1.0, 2.0]], [[3.0, -2.0]]]))  # round 1: none
    round_of(1, [[-4.0, 8.0]])
    variates.server_update(np.array([1.0, 3.0]))
    own, pooled = torch.tensor([[2.0, 0.0]]), 0.25 * torch.tensor([[2.0, 0.0]]) + 0.75 * torch.tensor([[-4.0, 8.0]])
    assert torch.allclose(variates.server["weight"], pooled)
    second, restored = round_of(0, [[0.5, 0.5]])
    assert restored and torch.allclose(second[0], torch.tensor([[0.5, 0.5]]) - own + pooled)
    assert torch.equal(stores[0].get(ControlVariates.STATE)["weight"], torch.tensor([[0.5, 0.5]]))  # raw, not corrected


def test_control_variates_are_refused_for_the_bound():
    cfg = RunConfig.from_run_config({"method": "centralized"})
    with pytest.raises(ValueError, match="bench.control-variates corrects FedNCA-ML's sites; method centralized"):
        run_trial(cfg, 1.0, {"bench.control-variates": True})


def test_fresh_shifts_are_the_sites_weighted_mean_gradient_less_each_sites_own():
    from fedskew.client_tasks import local_optimisation
    from fedskew.data.sites import load_task_dataset, simulated_site
    from fedskew.models.build import build_model, server_etf

    # One batch holds a site's every image, so its control is the gradient of its loss at the global weights.
    cfg = RunConfig.from_run_config({"method": "fednca", "batch-size": 4096, "fednca.control-variates": True})
    data = load_task_dataset(cfg)
    sites = [simulated_site(cfg, k, 10) for k in (0, 1)]
    etf = server_etf(cfg, data.num_classes, data.image_shape)
    model = build_model(cfg, data.num_classes, data.image_shape, etf=etf)
    shifts = fresh_shifts(cfg, sites, model.state_dict(), etf.numpy(), server_round=1)
    gradients = []
    for site in sites:
        model.zero_grad(set_to_none=True)
        _, _, loss_fn = local_optimisation(cfg, model, 1, 1, augment_seed=cfg.seed)
        loss_fn(model.train(), torch.as_tensor(site.train_images), torch.as_tensor(site.train_labels)).backward()
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad})
    counts = np.array([len(site.train_labels) for site in sites], dtype=np.float64)
    for name in gradients[0]:
        pooled = (counts[0] * gradients[0][name] + counts[1] * gradients[1][name]) / counts.sum()
        for shift, gradient in zip(shifts, gradients):
            assert torch.allclose(shift[name], pooled - gradient[name], atol=1e-5), name
