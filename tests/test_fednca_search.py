"""The FedNCA-ML search: its reference trials reproduce through fedskew's own strategies and site code, and its
diagnostics (the validation-chosen threshold, pooled BatchNorm statistics, update agreement, loss terms, plots)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import fedavg as flower_fedavg
from flwr.serverapp.strategy import strategy_utils

from bench.fednca_search import (
    agreement_plot,
    cached_fractal_pretrain,
    checked_options,
    class_feature_cosine,
    curves_plot,
    epoch_part,
    f1_at,
    label_thresholds,
    loss_terms,
    main,
    pick_by_budget,
    pooled_sites,
    recalibrated_batchnorm,
    run_trial,
    table,
    update_agreement,
    validation_threshold,
)
from fedskew.config import RunConfig
from fedskew.data.sites import SiteData, load_task_dataset
from fedskew.data.pixels import unit_float
from fedskew.models import backbones
from fedskew.models.build import build_model, server_etf
from fedskew.models.fednca import fednca_loss
from fedskew.models.fractal import fractal_pretrain

REFERENCE = Path(__file__).resolve().parents[1] / "bench/results/harness-reference"


def float64_average(records, weighting_metric_name):
    """Flower's FedAvg average (aggregate_arrayrecords) taken in float64, the reference's recording arithmetic."""
    weights = [float(next(iter(record.metric_records.values()))[weighting_metric_name]) for record in records]
    total = sum(weights)
    averaged: dict[str, np.ndarray] = {}
    for record, weight in zip(records, weights):
        for arrays in record.array_records.values():
            for key, value in arrays.items():
                averaged[key] = averaged.get(key, 0.0) + value.numpy().astype(np.float64) * (weight / total)
    return ArrayRecord({key: Array(np.asarray(value)) for key, value in averaged.items()})


@pytest.mark.parametrize("trial", ["fednca-lr3e-3", "centralized-lr3e-3", "fedavg-lr0.1", "fedprox-lr0.1"])
def test_the_harness_reproduces_its_recorded_reference_trials(trial, tmp_path, monkeypatch):
    # The reference was recorded by the harness's former in-process federation, which averaged in float64 with
    # the sites in node order. Flower's FedAvg sums float32 updates in float32 in its sampled order: its average
    # differs by float32 rounding (at most 7e-7 a weight in these trials), which the next round's training
    # amplifies past any bound worth asserting. With exactly that arithmetic restored, every other step is the
    # app's own code (strategy, messages, site training, seeds, probes), so every recorded number must come back
    # to the bit: equality, no tolerance.
    monkeypatch.setattr(flower_fedavg, "aggregate_arrayrecords", float64_average)
    monkeypatch.setattr(strategy_utils.random, "sample", lambda nodes, k: sorted(nodes)[:k])
    recorded = {row["trial"]: row for row in map(json.loads, (REFERENCE / "trials.jsonl").read_text().splitlines())}
    main(["--out", str(tmp_path), "--dataset", "digits-mosaic", "--trials", trial, "--rounds", "2",
          "--local-epochs", "1", "--site-fraction", "0.5"])
    (rerun,) = map(json.loads, (tmp_path / "trials.jsonl").read_text().splitlines())
    for row in (rerun, recorded[trial]):
        row.pop("cpu_seconds")
    assert rerun == recorded[trial]


def test_an_ablation_of_the_former_harness_is_history_skipped_when_recorded_and_refused_by_name_when_not(tmp_path):
    with pytest.raises(ValueError, match=r"bench options \['bench.server-momentum'\] were ablations"):
        run_trial(RunConfig.from_run_config({"method": "fednca"}), 1.0, {"bench.server-momentum": 0.5})
    rows = [{"trial": "fednca-m0.5", "dataset": "digits-mosaic", "method": "fednca", "val": 0.4, "test": 0.3,
             "val_thr": 0.5, "test_thr": 0.45, "test_auc": 0.7, "rounds": 5, "local_epochs": 3, "seed": 0}]
    (tmp_path / "trials.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    # The experiment's own command, re-run: the finished trial is skipped, as every finished trial is.
    main(["--out", str(tmp_path), "--dataset", "digits-mosaic", "--trials", "fednca-m0.5"])
    with pytest.raises(SystemExit, match=r"fednca-m0.5, not finished in .* on shapes-multi \(seed 0\), whose bench "
                                         r"options \['bench.server-momentum'\] no longer run .* bench.pooled-sites"):
        main(["--out", str(tmp_path), "--dataset", "shapes-multi", "--trials", "fednca-m0.5"])
    # Its recorded log still gives its report and table.
    main(["--out", str(tmp_path), "--report"])
    assert "| fednca-m0.5 | 0.400 (0.300) |" in (tmp_path / "search.md").read_text()
    main(["--out", str(tmp_path), "--table", "--trials", "fednca-m0.5"])
    assert "| fednca-m0.5 | 0.450 (n=1) | 0.700 |" in (tmp_path / "table.md").read_text()


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
            checked_options({"bench.pooled-sites": bad})


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


