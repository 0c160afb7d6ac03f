"""Self-contained model files and `fedskew predict`: a saved model rebuilds from its file alone and
predicts exactly what the model in memory predicts."""

import csv
import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from fedskew.cli import main as cli_main
from fedskew.config import RunConfig
from fedskew.factory.classifier import build_classifier, run_classifier
from fedskew.models.ensemble import ExpertEnsemble
from fedskew.models.build import build_model, server_etf
from fedskew.metrics import multilabel_metrics
from fedskew.models.model_file import ModelFileError, load_model_file, read_model_file, run_model_card, save_model_file
from fedskew.predict import predict

NAMES = ("a", "b", "c", "d")


def _fednca_file(tmp_path, shape=(1, 8, 8)):
    cfg = RunConfig.from_run_config({"dataset": "npz:own.npz", "mosaic-grid": 0})
    etf = server_etf(cfg, len(NAMES), shape)
    torch.manual_seed(0)
    model = build_model(cfg, len(NAMES), shape, etf=etf).eval()
    path = save_model_file(tmp_path / "m.safetensors", model.state_dict(), run_model_card(cfg, NAMES, True, shape), etf)
    return model, path


def _forged_file(tmp_path, **header):
    """A valid FedNCA-ML model file saved again with the header fields `header` changed."""
    _, path = _fednca_file(tmp_path)
    card, state, etf = read_model_file(path)
    return save_model_file(tmp_path / "forged.safetensors", state, dataclasses.replace(card, **header), etf)


def test_a_fednca_model_file_carries_its_etf_and_rebuilds_the_same_model(tmp_path):
    model, path = _fednca_file(tmp_path)
    loaded, card = load_model_file(path)
    x = torch.rand(5, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert (card.method, card.label_kind, card.class_names, card.image_shape) == ("fednca", "multi", NAMES, (1, 8, 8))
    assert "> 0.5" in card.decision


def test_a_file_from_before_feature_side_rebuilds_the_one_stage_small_cnn_it_was_trained_with(tmp_path):
    # At 32 px feature-side matters (16x16 map with one stride-2 stage, 8x8 with the default): a card without
    # the key was written when the small CNN always had one stage. Cards of then also hold the retired
    # fednca.warmup-fraction, which must not stop the file from loading.
    shape = (1, 32, 32)
    cfg = RunConfig.from_run_config({"dataset": "npz:own.npz", "mosaic-grid": 0, "feature-side": 0})
    etf = server_etf(cfg, len(NAMES), shape)
    model = build_model(cfg, len(NAMES), shape, etf=etf).eval()
    card = run_model_card(cfg, NAMES, True, shape)
    old_run_config = {k: v for k, v in card.run_config.items() if k not in ("feature-side", "fednca.warmup-epochs")}
    old_card = dataclasses.replace(card, run_config={**old_run_config, "fednca.warmup-fraction": 0.1})
    path = save_model_file(tmp_path / "old.safetensors", model.state_dict(), old_card, etf)
    loaded, _ = load_model_file(path)
    x = torch.rand(2, *shape)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("side", [8, 28, 32])
def test_the_factory_classifier_is_the_network_of_the_centralised_bound_and_the_baselines(side):
    # One network for the factory's classifier and experts and for `centralized` / FedAvg / FedProx on the
    # same run config: above 16 px `feature-side` adds stride-2 stages to both, not to one of them.
    cfg = RunConfig.from_run_config({"method": "factory", "dataset": "deformed-digits", "image-size": side, "mosaic-grid": 0, "partition": "iid"})
    shape = (1, side, side)
    torch.manual_seed(0)
    factory = run_classifier(cfg, shape, 10).eval()
    torch.manual_seed(0)
    bound = build_model(cfg.model_copy(update={"method": "centralized"}), 10, shape).eval()
    x = torch.rand(2, *shape)
    with torch.no_grad():
        assert torch.equal(factory(x), bound(x))
    assert factory.backbone.forward_features(x).shape[-1] == min((side + 1) // 2, 7 if side == 28 else 8)


def test_a_factory_file_from_before_the_classifier_followed_feature_side_loads_its_one_stage_network(tmp_path):
    cfg = RunConfig.from_run_config({"method": "factory", "dataset": "deformed-digits", "image-size": 32, "mosaic-grid": 0, "partition": "iid"})
    shape = (1, 32, 32)
    one_stage = build_classifier("small-cnn", shape, 10, 0).eval()
    card = dataclasses.replace(run_model_card(cfg, tuple("0123456789"), False, shape), factory_feature_side=0)
    header = {k: v for k, v in dataclasses.asdict(card).items() if k != "factory_feature_side"}  # as such files were written
    path = tmp_path / "old.safetensors"
    save_file(one_stage.state_dict(), str(path), metadata={"fedskew": json.dumps({**header, "format": "fedskew-model/1"})})
    loaded, loaded_card = load_model_file(path)
    x = torch.rand(2, *shape)
    with torch.no_grad():
        assert torch.equal(loaded(x), one_stage(x))
    assert loaded_card.factory_feature_side == 0 and run_model_card(cfg, tuple("0123456789"), False, shape).factory_feature_side == 8


@pytest.mark.parametrize("side", ["8", -1, True])
def test_a_model_file_whose_feature_side_is_not_a_natural_number_is_refused(tmp_path, side):
    forged = _forged_file(tmp_path, factory_feature_side=side)
    with pytest.raises(ModelFileError, match=r"'factory_feature_side' = .* is invalid; valid: an int >= 0"):
        read_model_file(forged)


@pytest.mark.parametrize("method", ["fedsgd", ["fedavg"], None])
def test_a_model_file_whose_method_is_none_of_fedskew_s_is_refused(tmp_path, method):
    forged = _forged_file(tmp_path, method=method)
    with pytest.raises(ModelFileError, match=r"forged.safetensors: the header's 'method' = .* is invalid; valid: fednca, fedavg, "):
        read_model_file(forged)


def test_a_product_of_experts_file_predicts_with_every_expert(tmp_path):
    cfg = RunConfig.from_run_config({"method": "factory-p2p", "mosaic-grid": 0, "partition": "iid", "factory.classifier": "small-cnn"})
    torch.manual_seed(1)
    experts = ExpertEnsemble([build_classifier("small-cnn", (3, 8, 8), 4, 8) for _ in range(3)]).eval()
    card = run_model_card(cfg, NAMES, False, (3, 8, 8))
    path = save_model_file(tmp_path / "poe.safetensors", experts.state_dict(), card.__class__(**{**card.__dict__, "experts": 3}))
    loaded, card = load_model_file(path)
    x = torch.rand(4, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), experts(x)) and card.experts == 3


def test_predict_writes_one_row_per_image_of_a_folder_with_every_class_probability(tmp_path):
    model, path = _fednca_file(tmp_path)
    folder = tmp_path / "scans"
    (folder / "ward").mkdir(parents=True)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(folder / "a.png")
    Image.fromarray(rng.integers(0, 255, (16, 16), dtype=np.uint8)).save(folder / "ward" / "b.jpg")  # resized to 8 px
    out = tmp_path / "predictions.csv"
    assert cli_main(["predict", str(path), "--input", str(folder), "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["file"] for r in rows] == ["a.png", "ward/b.jpg"]
    image = np.asarray(Image.open(folder / "a.png"), dtype=np.float32)[None, None] / 255
    with torch.no_grad():
        expected = torch.sigmoid(model(torch.from_numpy(image)))[0].numpy()
    assert [float(rows[0][f"p:{n}"]) for n in NAMES] == expected.tolist()
    assert rows[0]["predicted"] == "|".join(n for n, p in zip(NAMES, expected) if p > 0.5)


def test_a_weights_only_file_or_a_missing_model_is_a_clear_error(tmp_path):
    save_file({"w": torch.zeros(1)}, str(tmp_path / "old.safetensors"))
    with pytest.raises(ModelFileError, match="has no 'fedskew' metadata header"):
        load_model_file(tmp_path / "old.safetensors")
    assert cli_main(["predict", str(tmp_path / "nowhere"), "--input", str(tmp_path)]) == 2
    with pytest.raises(ValueError, match="holds neither model-selected.safetensors nor model.safetensors"):
        predict(tmp_path, tmp_path, tmp_path / "p.csv")


def test_the_model_file_carries_the_rounds_decision_threshold_and_predict_decides_and_scores_at_it(tmp_path):
    model, path = _fednca_file(tmp_path)
    assert read_model_file(path)[0].threshold == 0.5  # the card before any round chose one
    rng = np.random.default_rng(2)
    images = rng.integers(0, 255, (12, 8, 8), dtype=np.uint8)
    labels = (rng.random((12, len(NAMES))) < 0.4).astype(np.uint8)
    arrays = {f"{split}_{kind}": value for split in ("train", "val", "test")
              for kind, value in (("images", images), ("labels", labels))}  # fmt: skip
    np.savez(tmp_path / "scans.npz", **arrays)
    with torch.no_grad():
        probs = torch.sigmoid(model(torch.from_numpy(images[:, None].astype(np.float32) / 255))).numpy()
    # A threshold between the probabilities, where predictions differ from those at 0.5.
    threshold = float(np.median(probs))
    assert ((probs > threshold) != (probs > 0.5)).any()
    card, state, etf = read_model_file(path)
    chosen = save_model_file(tmp_path / "chosen.safetensors", state, card.at_round(3, "val_f1_macro", threshold), etf)
    assert read_model_file(chosen)[0].threshold == threshold and f"> {threshold}" in read_model_file(chosen)[0].decision
    report = predict(chosen, tmp_path / "scans.npz", tmp_path / "p.csv")
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    assert [r["predicted"] for r in rows] == ["|".join(np.array(NAMES)[row > threshold]) for row in probs]
    assert report["metrics"]["f1_macro"] == multilabel_metrics(labels, probs, threshold)["f1_macro"]


def test_a_model_file_whose_threshold_is_not_a_probability_is_refused(tmp_path):
    forged = _forged_file(tmp_path, threshold=1.5)
    with pytest.raises(ModelFileError, match=r"multi-label 'threshold' = 1.5 is invalid; valid: a number in \(0, 1\)"):
        read_model_file(forged)
