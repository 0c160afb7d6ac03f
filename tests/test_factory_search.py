"""bench.factory_search's P2P round: the experts the P2P handler trains, their Product of Experts, cached
synthetic images reused across variants."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench import factory_search
from bench.compare import parse_run_config
from bench.factory_search import main, summary_table, train_classifier
from fedskew.config import RunConfig
from fedskew.data.sites import load_task_dataset, simulated_site

TINY = ("classes-per-site=4 factory.classifier='small-cnn' factory.generator-steps=4 factory.audit-samples=8 factory.sampler-steps=3 "
        "factory.p2p-samples-per-class=12 factory.classifier-epochs=2 method='factory-p2p'")  # fmt: skip


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    out = tmp_path_factory.mktemp("search")
    main(["--dataset", "digits", "--num-sites", "3", "--seeds", "0", "--base", TINY, "--variant", "p2p:",
          "--variant", "p2p-again:", "--variant", "p2p-matched: bench.match-experts=true", "--out", str(out)])  # fmt: skip
    return out, {r["variant"]: r for r in json.loads((out / "results.json").read_text())}


def test_every_site_trains_an_expert_and_the_product_is_scored_on_the_test_split(search):
    _, results = search
    p2p = results["p2p"]
    assert [e["site"] for e in p2p["experts"]] == [0, 1, 2]
    assert all(e["last_epoch"] == 2 and 1 <= e["best_epoch"] <= 2 for e in p2p["experts"])  # p2p-epochs 0: the classifier's 2
    assert 0 <= p2p["accuracy"] <= 1 and p2p["min_class_recall"] == min(p2p["per_class_recall"])
    # Balanced accuracy is the mean recall over the test split's classes (digits' test split holds all ten).
    assert p2p["balanced_accuracy"] == pytest.approx(np.mean(p2p["per_class_recall"]))
    assert p2p["ratio_to_centralised"] == pytest.approx(p2p["accuracy"] / p2p["centralised_accuracy"])
    # The bound's own recall per class, scored on the same test split: its accuracy is their count-weighted mean.
    bound_recall = np.array(p2p["centralised_per_class_recall"])
    test_counts = np.bincount(load_task_dataset(RunConfig.from_run_config({**factory_search.SILOS, "method": "factory"})).test_labels, minlength=10)
    assert len(bound_recall) == 10 and p2p["centralised_min_class_recall"] == bound_recall.min()
    assert (bound_recall * test_counts).sum() / test_counts.sum() == pytest.approx(p2p["centralised_accuracy"])


def test_the_sites_synthetic_images_are_drawn_once_and_reused(search):
    out, results = search
    cached = sorted(p.name for p in out.glob("generators/*/site*-lacking-*.safetensors"))
    # Every site lacks classes the others hold: each draws its images once, 12 per class lacking.
    assert cached == [f"site{k}-lacking-12x-3steps-seed0.safetensors" for k in range(3)]
    assert results["p2p-again"]["per_class_recall"] == results["p2p"]["per_class_recall"]
    assert results["p2p-again"]["experts"] == results["p2p"]["experts"]


def test_matching_the_experts_images_is_a_recorded_ablation(search):
    _, results = search
    assert results["p2p-matched"]["run_config"]["bench.match-experts"] is True
    assert results["p2p-matched"]["experts"] != results["p2p"]["experts"]


def test_the_summary_gives_mean_and_sd_over_seeds_and_a_dash_for_what_a_row_lacks():
    rows = [{"variant": "p2p", "seed": seed, "accuracy": accuracy, "per_class_recall": [accuracy, 1.0]}
            for seed, accuracy in ((0, 0.5), (1, 0.7))]  # fmt: skip
    table = summary_table(rows)
    line = next(row for row in table.splitlines() if row.startswith("| p2p |"))
    assert line.split(" | ")[1] == "0.600 ± 0.141"  # mean and sample sd of 0.5 and 0.7
    assert line.split(" | ")[9] == "-"  # fd: P2P rows have none
    assert "| p2p | 0.60 | 1.00 |" in table  # per-class recall, mean over seeds


def _tiny_sites(num_sites: int):
    from bench.factory_search import SILOS
    from fedskew.data.sites import simulated_site

    cfg = RunConfig.from_run_config({**SILOS, **parse_run_config(TINY), "method": "factory"})
    return cfg, [simulated_site(cfg, k, num_sites) for k in range(num_sites)]


def test_a_search_stopped_half_way_resumes_from_the_generators_its_sites_finished(tmp_path, monkeypatch):
    cfg, sites = _tiny_sites(3)
    trained = []
    real_training = factory_search.train_site_generators

    def crash_at_the_last_site(cfg, site, device):
        if site.site_id == 2 and not trained.count(2):
            trained.append(2)
            raise RuntimeError("killed")
        trained.append(site.site_id)
        return real_training(cfg, site, device)

    monkeypatch.setattr(factory_search, "train_site_generators", crash_at_the_last_site)
    with pytest.raises(RuntimeError, match="killed"):
        factory_search.site_library(cfg, sites, tmp_path, torch.device("cpu"))
    library, directory, _ = factory_search.site_library(cfg, sites, tmp_path, torch.device("cpu"))
    assert trained == [0, 1, 2, 2]  # sites 0 and 1 trained once; the rerun trained only the site it lacked
    assert sorted({m.site_id for m in library.modules}) == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [directory.name]  # the per-site entries are gone


def test_sites_trained_side_by_side_give_the_library_trained_one_after_another(tmp_path):
    cfg, sites = _tiny_sites(3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two workers of one thread each, against one thread in turn: the same thread count per generator
    try:
        side_by_side, _, _ = factory_search.site_library(cfg, sites, tmp_path / "side-by-side", torch.device("cpu"), workers=2)
        torch.set_num_threads(1)
        in_turn, _, _ = factory_search.site_library(cfg, sites, tmp_path / "in-turn", torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert [(m.site_id, m.classes) for m in side_by_side.modules] == [(m.site_id, m.classes) for m in in_turn.modules]
    for a, b in zip(in_turn.modules, side_by_side.modules, strict=True):
        for (name, x), y in zip(a.state.items(), b.state.values(), strict=True):
            assert torch.equal(x, y), (a.site_id, a.classes, name)


def test_a_site_with_no_class_to_model_uploads_nothing_and_the_search_goes_on(tmp_path, monkeypatch, capsys):
    cfg, sites = _tiny_sites(3)
    real_plan = factory_search.site_plan
    monkeypatch.setattr(factory_search, "site_plan", lambda cfg, site: [] if site.site_id == 1 else real_plan(cfg, site))
    library, _, _ = factory_search.site_library(cfg, sites, tmp_path, torch.device("cpu"))
    assert sorted({m.site_id for m in library.modules}) == [0, 2]
    assert "site 1: no class with >= factory.min-class-images" in capsys.readouterr().out


def test_a_set_max_memorization_leaves_out_what_the_sites_would_withhold(tmp_path, capsys):
    from types import SimpleNamespace

    from fedskew.factory.library import Library

    def module(site, cls, share):
        return SimpleNamespace(module_id=f"site{site}-class{cls}", site_id=site, classes=(cls,), memorization=share)

    # site 0 withholds class 1 and keeps class 2; every generator of site 1 is above the limit: it uploads nothing
    modules = (module(0, 1, 0.5), module(0, 2, 0.05), module(1, 3, 0.9), module(1, 4, float("nan")))
    library = Library(modules, 5, (1, 8, 8), tuple("abcde"))
    directory = tmp_path / "0123abcd"
    cfg = RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "iid", "factory.max-memorization": 0.05})
    kept, cache = factory_search.uploaded_library(cfg, library, directory)
    assert [m.module_id for m in kept.modules] == ["site0-class2"]
    assert cache == tmp_path / "0123abcd-max-memorization-0.05" and cache.is_dir()  # its synthetic sets are its own
    assert "site 1: site refuses to upload" in capsys.readouterr().out
    # unset, the search (like a simulation) uploads every generator and caches next to the library
    assert factory_search.uploaded_library(RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "iid"}), library, directory) == (library, directory)


def test_the_bound_trains_its_own_epochs_when_asked(search, monkeypatch):
    out, results = search
    assert results["p2p"]["centralised_epochs"] == 2  # the classifier's own factory.classifier-epochs
    trained = []

    def recording(images, labels, num_classes, recipe, **kwargs):
        trained.append((len(images), recipe.epochs))
        return train_classifier(images, labels, num_classes, recipe, **kwargs)

    monkeypatch.setattr(factory_search, "train_classifier", recording)
    main(["--dataset", "digits", "--num-sites", "3", "--seeds", "0", "--base", TINY, "--variant", "p2p-bound-3:",
          "--bound-epochs", "3", "--out", str(out)])  # fmt: skip
    pooled = sum(len(site.train_images) for site in (simulated_site(RunConfig.from_run_config(
        {**factory_search.SILOS, **parse_run_config(TINY), "seed": 0}), k, 3) for k in range(3)))
    assert (pooled, 3) in trained  # the bound: the sites' pooled real images, 3 epochs
    record = next(r for r in json.loads((out / "results.json").read_text()) if r["variant"] == "p2p-bound-3")
    assert record["centralised_epochs"] == 3


def test_the_library_key_names_the_generator_lr_a_library_is_trained_at_except_the_former_001():
    def key_of(overlay):
        return json.loads(factory_search.library_key(RunConfig.from_run_config({**factory_search.SILOS, "method": "factory", **overlay}), 10))

    # The default and the same lr set explicitly train the same weights, so they share one cache entry.
    assert key_of({}) == key_of({"factory.generator-lr": 0.0}) == key_of({"factory.generator-lr": 0.04})
    assert key_of({})["generator_lr"] == 0.04
    # Libraries trained at 0.01 before the lr was a key keep their cache names.
    assert "generator_lr" not in key_of({"factory.generator-lr": 0.01})
    assert key_of({"factory.generator": "gpu-32px"}).get("generator_lr") is None
    assert key_of({"factory.generator": "gpu-32px", "factory.generator-lr": 0.02})["generator_lr"] == 0.02


def test_the_bound_alone_trains_no_generator(tmp_path, monkeypatch):
    monkeypatch.setattr(factory_search, "site_library", lambda *a, **k: pytest.fail("a generator library was built"))
    main(["--dataset", "digits", "--num-sites", "3", "--seeds", "0,1", "--base", TINY, "--bound-only", "--bound-epochs", "1",
          "--out", str(tmp_path)])  # fmt: skip
    bounds = json.loads((tmp_path / "bound.json").read_text())
    assert [(b["seed"], b["epochs"]) for b in bounds] == [(0, 1), (1, 1)]
    assert all(0.0 <= b["accuracy"] <= 1.0 for b in bounds)


def test_a_budget_in_seconds_becomes_whole_batches_of_the_measured_images_per_second():
    cfg = RunConfig.from_run_config({**factory_search.SILOS, "dataset": "digits", **parse_run_config(TINY), "method": "factory", "seed": 0})
    site = simulated_site(cfg, 0, 3)
    timed = factory_search.calibrated_generator_images(cfg, site, 30.0, torch.device("cpu"), steps=4, warmup=1)
    batch = timed["batch"]
    assert batch == factory_search.site_plan(cfg, site)[0].config.batch_size
    assert timed["generator_images"] == int(30.0 * timed["images_per_s"]) // batch * batch > 0
    # A budget shorter than one step still trains one batch.
    assert factory_search.calibrated_generator_images(cfg, site, 1e-9, torch.device("cpu"), steps=4, warmup=1)["generator_images"] == batch


def test_the_autoguidance_ablation_trains_a_guide_library_and_samples_from_it(tmp_path):
    base = TINY.replace("method='factory-p2p'", "factory.samples-per-class=12")
    main(["--dataset", "digits", "--num-sites", "3", "--seeds", "0", "--base", base, "--variant", "plain:",
          "--variant", "guided: factory.guide-steps=2 factory.guidance-weight=2", "--out", str(tmp_path)])  # fmt: skip
    plain, guided = json.loads((tmp_path / "results.json").read_text())
    assert plain["guide_seconds"] == 0 < guided["guide_seconds"]
    assert len(list((tmp_path / "generators").glob("*/manifest.json"))) == 2  # the generators and their guides
    assert "-guide" in guided["samples"] and "-guide" not in plain["samples"]
    assert guided["fd"] != plain["fd"]  # drawn from other images
