"""FederatedFactory: PoE arithmetic, quota split, upload validation on tampered uploads, library and
synthetic-set round trips, the memorisation audit, and end-to-end `flwr run`s of factory (DP generators, one site
withholding a generator it cannot audit) and factory-p2p, followed by modular unlearning of their run directories."""

import dataclasses
import hashlib
import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedskew.cli import main as cli_main
from fedskew.config import AUTO_GUIDE_STEPS_WIDE, RunConfig
from fedskew.data.sites import SiteData, load_task_dataset, simulated_site
from fedskew.factory.classifier import ClassifierRecipe, stratified_holdout
from fedskew.factory.run import FactoryRun
from fedskew.methods import method_of
from fedskew.models.ensemble import LOG_PROB_FLOOR, ExpertEnsemble, product_of_experts
from fedskew.factory.library import (
    GeneratorModule,
    Library,
    PlannedModule,
    SampleJob,
    SyntheticSet,
    UploadRejected,
    class_balanced_set,
    load_synthetic,
    read_library,
    releases_outside_the_guarantee,
    sampling_plan,
    save_synthetic,
    split_quota,
    validate_upload,
    withheld_modules,
    write_library,
)
from fedskew.factory.site import (
    MemorizationRefusal,
    check_memorization,
    generator_config,
    generator_payload_limit,
    guide_config,
    guide_steps,
    memorization_share,
    p2p_samples_per_class,
    planned_modules,
)
from fedskew.unlearn import unlearn
from fedskew.testing.launch import SimulationSuperLink
from fedskew.predict import predict
from fedskew.training import random_shift
from fedskew.protocol import decode_modules, encode_modules
from fedskew.models.edm2 import CPU_PRESET, build_generator
from fedskew.models.generator_io import GeneratorFileError, state_dict_checksum

# --- Product of Experts ---------------------------------------------------------------------------------


def test_poe_sums_clamped_log_softmax_of_each_expert():
    a = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))  # already log-probabilities: log_softmax leaves them
    b = torch.tensor([[0.0, 0.0, -100.0]])  # third class ruled out far below 1e-12: clamped
    log_b = [math.log(0.5), math.log(0.5), LOG_PROB_FLOOR]
    expected = torch.tensor([[math.log(0.5) + log_b[0], math.log(0.25) + log_b[1], math.log(0.25) + log_b[2]]])
    torch.testing.assert_close(product_of_experts([a, b]), expected)
    # softmax of the sum: classes 0 and 1 in ratio 2:1, class 2 ~ 1e-12 relative weight
    probs = torch.softmax(product_of_experts([a, b]), dim=1)[0]
    assert probs[0] / probs[1] == pytest.approx(2.0) and probs[2] < 1e-11


def test_poe_of_one_expert_is_that_expert_and_ensemble_forward_matches():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 3.0, 1.0]])
    torch.testing.assert_close(torch.softmax(product_of_experts([logits]), 1), torch.softmax(logits, 1))

    class Fixed(torch.nn.Module):
        def __init__(self, out):
            super().__init__()
            self.out = out

        def forward(self, x):
            return self.out

    other = torch.tensor([[0.0, 0.0, 4.0], [1.0, 0.0, 0.0]])
    ensemble = ExpertEnsemble([Fixed(logits), Fixed(other)])
    torch.testing.assert_close(ensemble(torch.zeros(2, 1)), product_of_experts([logits, other]))
    with pytest.raises(ValueError, match="at least one expert"):
        product_of_experts([])


# --- quotas, holdout, augmentation -----------------------------------------------------------------------


def test_split_quota_is_proportional_and_exact():
    assert split_quota(10, [2, 1, 1]) == [5, 3, 2]  # 5, 2.5, 2.5: the earlier tie gets the spare image
    assert split_quota(7, [130, 65]) == [5, 2]
    assert sum(split_quota(1000, [3, 7, 11])) == 1000
    with pytest.raises(ValueError, match="positive weights"):
        split_quota(5, [1, 0])


def test_stratified_holdout_holds_out_every_class():
    labels = np.repeat(np.arange(3), [10, 20, 2])
    train, val = stratified_holdout(labels, 0.1, seed=0)
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(len(labels)))
    assert np.bincount(labels[val], minlength=3).tolist() == [1, 2, 1]


def test_random_shift_moves_pixels_within_bounds():
    x = torch.zeros(50, 1, 5, 5)
    x[:, :, 2, 2] = 1.0
    shifted = random_shift(x, 1, torch.Generator().manual_seed(0))
    positions = {tuple(torch.nonzero(img[0])[0].tolist()) for img in shifted}
    assert positions <= {(r, c) for r in (1, 2, 3) for c in (1, 2, 3)} and len(positions) > 1
    assert torch.all(shifted.sum(dim=(1, 2, 3)) == 1)


# --- modules, validation, library ---------------------------------------------------------------------------

TINY = dataclasses.replace(
    CPU_PRESET, model_channels=8, num_blocks=1, batch_size=8, total_images=8, t_ref=8, t_rampup=0
)


def make_module(site_id: int, class_id: int, count: int = 20, seed: int = 0) -> GeneratorModule:
    config = dataclasses.replace(TINY, seed=seed)
    state = {k: v.clone() for k, v in build_generator(config).state_dict().items()}
    return GeneratorModule(
        f"site{site_id}-class{class_id}", site_id, (class_id,), (count,), config, state_dict_checksum(state), 0.0, state
    )


def upload_of(*modules: GeneratorModule) -> tuple[dict, dict]:
    meta = {"site-id": modules[0].site_id, "image-shape": [1, 8, 8], "modules": [m.metadata() for m in modules]}
    return meta, {m.module_id: {k: v.clone() for k, v in m.state.items()} for m in modules}


def plan_of(*modules: GeneratorModule) -> list[PlannedModule]:
    return [PlannedModule(m.module_id, m.classes, m.image_counts, m.config) for m in modules]


MODULES = (make_module(1, 3), make_module(1, 5, seed=1))


def validate(meta, states, **overrides):
    return validate_upload(meta, states, **{"site_id": 1, "plan": plan_of(*MODULES), "image_shape": (1, 8, 8), **overrides})


def test_an_upload_crosses_the_wire_as_one_array_per_generator_and_decodes_to_the_same_weights():
    meta, _ = upload_of(*MODULES)
    content = encode_modules(meta, list(MODULES))
    # One packed array per generator keeps the object count (one SuperLink request each) small.
    assert [list(content[k]) for k in content.array_records] == [["safetensors"], ["safetensors"]]
    manifest, states = decode_modules(content, max_bytes=1 << 22)
    assert manifest == meta
    for module in MODULES:
        assert all(torch.equal(states[module.module_id][k], v) for k, v in module.state.items())
    assert [m.module_id for m in validate(manifest, states)] == ["site1-class3", "site1-class5"]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (lambda state: ArrayRecord(state), "expected one array 'safetensors'"),
        (lambda state: ArrayRecord({"safetensors": Array(np.arange(64, dtype=np.uint8))}), "not a readable safetensors payload"),
        (lambda state: ArrayRecord({"safetensors": Array(np.zeros(5000, dtype=np.uint8))}), r"take 5\d{3} bytes; .* at most 4096"),
    ],
    ids=["unpacked", "garbage-bytes", "oversized"],
)
def test_weights_that_are_not_one_packed_array_are_rejected_with_the_reason(record, reason):
    with pytest.raises(UploadRejected, match=f"generator .site1-class3.: .*{reason}"):
        decode_modules(RecordDict({"manifest": ConfigRecord({"json": "{}"}),
                                   "generator.site1-class3": record(make_module(1, 3).state)}), max_bytes=4096)  # fmt: skip


def test_a_valid_upload_passes():
    meta, states = upload_of(*MODULES)
    assert [m.module_id for m in validate(meta, states)] == ["site1-class3", "site1-class5"]


def _nan_weight(meta, states):
    name = next(iter(states["site1-class3"]))
    states["site1-class3"][name].view(-1)[0] = float("nan")


def _changed_weight(meta, states):
    tensor = next(t for t in states["site1-class3"].values() if t.is_floating_point() and t.numel() > 1)
    tensor.view(-1)[0] += 1.0


def _class_out_of_range(meta, states):
    meta["modules"][0]["classes"] = [10]


def _wider_config(meta, states):
    meta["modules"][0]["config"]["model_channels"] = 16


def _memorised(meta, states):
    meta["modules"][0]["memorization"] = 0.9


def _site_images_of_another_shape(meta, states):
    meta["image-shape"] = [3, 8, 8]


def _other_site(meta, states):
    meta["modules"][0]["site-id"] = 2


def _path_in_module_id(meta, states):
    meta["modules"][0]["module-id"] = "../evil"
    states["../evil"] = states.pop("site1-class3")


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (_nan_weight, "non-finite"),
        (_changed_weight, "checksum mismatch"),
        (_class_out_of_range, "declared classes \\[10\\] differs from the server's"),
        (_wider_config, "declared config .* differs"),
        (_memorised, "exceeds factory.max-memorization"),
        (_site_images_of_another_shape, r"the site's images are \[3, 8, 8\]"),
        (_other_site, "declared site-id 2 differs"),
        (_path_in_module_id, "declares modules \\['../evil', 'site1-class5'\\]"),
    ],
)
def test_a_tampered_upload_is_rejected_with_its_reason(tamper, reason):
    meta, states = upload_of(*MODULES)
    tamper(meta, states)
    with pytest.raises(UploadRejected, match=reason):
        validate(meta, states, max_memorization=0.5)


def test_an_upload_may_withhold_planned_modules_and_the_server_takes_the_rest():
    meta, states = upload_of(MODULES[1])
    meta["withheld"] = [{"module-id": "site1-class3", "reason": "0.900 of audit samples memorised"}]
    assert [m.module_id for m in validate(meta, states)] == ["site1-class5"]
    assert withheld_modules(meta, plan_of(*MODULES)) == [
        {"module-id": "site1-class3", "classes": [3], "reason": "0.900 of audit samples memorised"}
    ]


def _withholding(entries, uploaded=MODULES[1:]):
    meta, states = upload_of(*uploaded) if uploaded else ({"site-id": 1, "image-shape": [1, 8, 8], "modules": []}, {})
    meta["withheld"] = entries
    return meta, states


@pytest.mark.parametrize(
    ("meta_states", "reason"),
    [
        (_withholding({"module-id": "site1-class3"}), "withheld must be a list of"),
        (_withholding([{"module-id": "site1-class3"}]), "withheld must be a list of"),
        (_withholding([{"module-id": "site1-class7", "reason": "x"}]), "distinct modules of this site's plan"),
        (_withholding([{"module-id": "site1-class3", "reason": "x"}] * 2), "distinct modules of this site's plan"),
        (_withholding([{"module-id": "site1-class3", "reason": "x" * 301}]), "a reason of 1-300 characters"),
        (_withholding([{"module-id": "site1-class3", "reason": ""}]), "a reason of 1-300 characters"),
        # withheld and uploaded at once: the declared modules must be the plan less the withheld
        (_withholding([{"module-id": "site1-class3", "reason": "x"}], MODULES), "make exactly \\['site1-class5'\\]"),
        (_withholding([{"module-id": m.module_id, "reason": "x"} for m in MODULES], ()), "withholds every module"),
    ],
    ids=["not-a-list", "no-reason", "not-planned", "twice", "long-reason", "empty-reason", "also-uploaded", "everything"],
)
def test_a_malformed_or_forged_withheld_list_is_rejected_with_its_reason(meta_states, reason):
    meta, states = meta_states
    with pytest.raises(UploadRejected, match=reason):
        validate(meta, states)


def test_an_upload_whose_weights_match_a_forged_checksum_still_needs_the_declared_architecture():
    meta, states = upload_of(*MODULES)
    del states["site1-class3"]["logvar_linear.weight"]
    meta["modules"][0]["checksum"] = state_dict_checksum(states["site1-class3"])
    with pytest.raises(UploadRejected, match="missing"):
        validate(meta, states)


def test_library_round_trip_and_a_tampered_file_is_refused(tmp_path):
    library = Library((make_module(0, 2), make_module(1, 2, count=10, seed=1), make_module(1, 7, seed=2)), 10, (1, 8, 8),
                      tuple(map(str, range(10))))  # fmt: skip
    write_library(library, tmp_path / "library")
    back = read_library(tmp_path / "library")
    assert back.manifest() == library.manifest()
    for a, b in zip(library.modules, back.modules):
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert back.missing_classes() == [0, 1, 3, 4, 5, 6, 8, 9]
    weights = tmp_path / "library" / "site1-class7.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\1")
    with pytest.raises(GeneratorFileError, match="altered"):
        read_library(tmp_path / "library")


def test_sampling_plan_splits_a_shared_class_by_image_counts_and_seeds_do_not_depend_on_other_modules():
    library = Library((make_module(0, 2, count=30), make_module(1, 2, count=10), make_module(2, 2, count=50),
                       make_module(1, 7)), 10, (1, 8, 8), tuple(map(str, range(10))))  # fmt: skip
    plan = sampling_plan(library, 100, seed=0)
    # 30 : 10 : 50, the 50 capped at the others' 40 (capped_counts): 37.5, 12.5, 50 -> the earlier tie gets the spare image
    assert [(j.module_id, j.class_id, j.count) for j in plan] == [
        ("site0-class2", 2, 38), ("site1-class2", 2, 12), ("site2-class2", 2, 50), ("site1-class7", 7, 100)
    ]
    alone = sampling_plan(library.without(["site0-class2"]), 100, seed=0)
    assert {j.module_id: j.seed for j in alone} == {j.module_id: j.seed for j in plan if j.module_id != "site0-class2"}
    with pytest.raises(ValueError, match="class 4 has no generator"):
        sampling_plan(library, 10, seed=0, classes=[4])


def test_synthetic_set_round_trip_and_dropping_a_module_keeps_the_other_images(tmp_path):
    jobs = (SampleJob("site0-class1", 1, 3, 11), SampleJob("site1-class1", 1, 2, 12), SampleJob("site1-class4", 4, 4, 13))
    source = np.repeat(np.arange(3), [3, 2, 4])
    images = np.random.default_rng(0).random((9, 1, 8, 8), dtype=np.float32)
    synthetic = SyntheticSet(images, np.array([1] * 5 + [4] * 4), source, jobs)
    back = load_synthetic(save_synthetic(synthetic, tmp_path / "s.safetensors"))
    assert back.jobs == jobs and np.array_equal(back.images, images) and np.array_equal(back.source, source)
    kept = back.without_modules(["site1-class1"])
    assert kept.jobs == (jobs[0], jobs[2])
    assert np.array_equal(kept.images, images[source != 1]) and kept.source.tolist() == [0, 0, 0, 1, 1, 1, 1]


# --- site side ----------------------------------------------------------------------------------------------


def test_memorization_share_on_hand_made_images():
    rng = np.random.default_rng(0)
    train, heldout = rng.random((20, 1, 8, 8)), rng.random((5, 1, 8, 8))
    assert memorization_share(train[:10], train, heldout) == 1.0  # exact copies of training images
    assert memorization_share(heldout, train, heldout) == 0.0
    assert math.isnan(memorization_share(train[:3], train, heldout[:0]))


def test_a_site_withholds_each_generator_above_max_memorization_and_refuses_when_none_is_left():
    modules = [dataclasses.replace(make_module(0, 1), memorization=0.4),
               dataclasses.replace(make_module(0, 2), memorization=float("nan")),
               dataclasses.replace(make_module(0, 3), memorization=0.3)]  # fmt: skip
    assert check_memorization(modules, 0.0) == (modules, [])  # off
    kept, withheld = check_memorization(modules, 0.3)  # at the limit is within it
    assert kept == modules[2:]
    assert withheld == [{"module-id": "site0-class1", "reason": "0.400 of audit samples memorised"},
                        {"module-id": "site0-class2", "reason": "no held-out image of class(es) [2] to audit against (raise val-fraction)"}]  # fmt: skip
    with pytest.raises(MemorizationRefusal) as refusal:
        check_memorization(modules, 0.2)
    assert all(f"site0-class{c}: " in str(refusal.value) for c in (1, 2, 3)) and "every generator" in str(refusal.value)


def test_a_site_trains_guides_only_for_what_it_uploads_and_withholds_a_generator_with_its_guide(monkeypatch):
    from fedskew.factory import site as site_module

    cfg = RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "classes-per-site",
                                     "factory.generator-channels": 32, "factory.guide-steps": 7, "factory.max-memorization": 0.3})  # fmt: skip
    asked = {}

    def guides_trained(guide_cfg, site, device, only, kind):
        asked.update(cfg=guide_cfg, only=only, kind=kind)
        shares = {"site0-class1": 0.0, "site0-class3": 0.4}
        return [dataclasses.replace(make_module(0, int(m[-1])), memorization=shares[m]) for m in only], {"generator_seconds": 2.0}

    monkeypatch.setattr(site_module, "train_site_generators", guides_trained)
    modules = [make_module(0, 1), make_module(0, 3)]
    earlier = [{"module-id": "site0-class2", "reason": "0.500 of audit samples memorised"}]
    kept, guides, withheld, metrics = site_module.trained_guides(cfg, SimpleNamespace(site_id=0), modules, earlier, torch.device("cpu"))
    # Guides train for the generators the site keeps, at the CPU preset's own width for factory.guide-steps steps.
    assert asked["only"] == ["site0-class1", "site0-class3"] and asked["kind"] == "guide"
    assert (asked["cfg"].factory.generator_channels, asked["cfg"].factory.generator_steps, asked["cfg"].factory.generator) == (0, 7, "cpu")
    assert [m.module_id for m in kept] == [g.module_id for g in guides] == ["site0-class1"]
    assert withheld == [*earlier, {"module-id": "site0-class3", "reason": "its guide: 0.400 of audit samples memorised"}]
    assert metrics == {"guide_generator_seconds": 2.0}
    with pytest.raises(MemorizationRefusal, match="the guides of factory.guide-steps"):
        site_module.trained_guides(cfg, SimpleNamespace(site_id=0), modules[1:], [], torch.device("cpu"))


@pytest.mark.parametrize(("side", "expected"), [(8, 20), (28, 500)])
def test_a_p2p_site_draws_its_largest_class_size_per_lacking_class_and_more_for_large_images(side, expected):
    labels = np.array([0] * 10 + [3] * 20)  # two classes held, the larger of 20 images: its expert trains class-balanced
    images = np.zeros((len(labels), 1, side, side), dtype=np.uint8)
    site = SiteData(0, 2, images, labels, images[:2], labels[:2], 4, ("a", "b", "c", "d"))
    assert p2p_samples_per_class(site, RunConfig().factory) == expected
    assert p2p_samples_per_class(site, RunConfig.from_run_config({"factory.p2p-samples-per-class": 7}).factory) == 7


def test_generator_config_keeps_attention_levels_and_scales_the_schedule():
    factory = RunConfig.from_run_config({"factory.generator-steps": 40}).factory
    config = generator_config(factory, (3, 16, 16), label_dim=0, n_images=40, seed=5)
    assert (config.img_channels, config.img_resolution, config.attn_resolutions) == (3, 16, (8,))
    assert config.batch_size == 32 and config.total_steps == 40 and config.seed == 5
    # The ramp-up keeps the preset's share of the run, counted in images seen.
    assert config.t_rampup == round(CPU_PRESET.t_rampup / CPU_PRESET.total_images * 40 * 32)
    with pytest.raises(ValueError, match="square"):
        generator_config(factory, (1, 8, 6), 0, 40, 0)


def test_a_plain_factory_run_releases_only_the_survey_and_the_audit_outside_the_generators_dp():
    cfg = RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "classes-per-site"})
    assert releases_outside_the_guarantee(cfg.factory, p2p=False) == [
        "the survey's image counts per class", "each generator's memorization share (its manifest entry)"]



@pytest.mark.parametrize("keys", [
    {"method": "factory"},
    {"method": "factory-p2p", "factory.conditional": True},
    {"method": "factory", "factory.generator-channels": 32},  # autoguided: guides of AUTO_GUIDE_STEPS_WIDE steps
    {"method": "factory-p2p", "factory.generator-channels": 32},  # P2P sites draw unguided
], ids=["factory", "p2p-conditional", "factory-wide", "p2p-wide"])  # fmt: skip
def test_a_factory_run_gives_the_site_functions_what_its_run_config_gives(keys):
    # fedskew's server strategy plans from a FactoryRun of the run config's values, its sites from the RunConfig:
    # every plan, payload limit, guide and classifier recipe must be the same, or honest uploads would be refused.
    cfg = RunConfig.from_run_config({"mosaic-grid": 0, "partition": "classes-per-site", "seed": 7, "feature-side": 4, **keys})
    run = FactoryRun(factory=cfg.factory, seed=cfg.seed, p2p=method_of(cfg).p2p, feature_side=cfg.feature_side)
    counts, shape = [20, 0, 30], (1, 8, 8)
    assert planned_modules(run, 1, counts, shape) == planned_modules(cfg, 1, counts, shape)
    assert generator_payload_limit(run, shape, 3) == generator_payload_limit(cfg, shape, 3)
    assert guide_steps(run) == guide_steps(cfg) == (AUTO_GUIDE_STEPS_WIDE if keys == {"method": "factory", "factory.generator-channels": 32} else 0)
    assert ClassifierRecipe.from_config(run) == ClassifierRecipe.from_config(cfg)

def test_factory_methods_need_single_label_data():
    with pytest.raises(ValueError, match="single-label data"):
        RunConfig.from_run_config({"method": "factory", "mosaic-grid": 2})


@pytest.mark.parametrize(("extra", "reason"), [
    ({"method": "factory-p2p"}, "0 for method 'factory-p2p'"),
    ({"factory.dp-noise-multiplier": 1.0}, "the two DP guarantees would compose"),
    ({"factory.guidance-weight": 0.5}, "factory.guidance-weight"),
])  # fmt: skip
def test_autoguidance_is_refused_where_it_does_not_apply(extra, reason):
    with pytest.raises(ValueError, match=reason):
        RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "classes-per-site", "factory.guide-steps": 5, **extra})


def guided_steps(**keys) -> int:
    cfg = RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "classes-per-site", **keys})
    guided = guide_config(cfg)
    return guided.factory.generator_steps if guided else 0


@pytest.mark.parametrize(("generators", "expected"), [
    ({}, 0),  # the CPU preset: its guides would be as wide as it, and measured gained nothing
    ({"factory.generator-channels": 16}, 0),
    ({"factory.generator-channels": 32}, AUTO_GUIDE_STEPS_WIDE),
    ({"factory.generator": "gpu-32px"}, AUTO_GUIDE_STEPS_WIDE),
])  # fmt: skip
def test_autoguidance_by_default_guides_generators_wider_than_the_cpu_preset(generators, expected):
    assert guided_steps(**generators) == expected
    # Explicit values hold for any generators; the automatic guides step aside where guidance does not apply.
    assert guided_steps(**generators, **{"factory.guide-steps": 7}) == 7
    assert guided_steps(**generators, **{"factory.guide-steps": 0}) == 0
    assert guided_steps(**generators, method="factory-p2p") == 0
    assert guided_steps(**generators, **{"factory.dp-noise-multiplier": 1.0}) == 0


# --- end to end ------------------------------------------------------------------------------------------

E2E = {
    "mosaic-grid": 0, "partition": "classes-per-site", "classes-per-site": 4, "min-site-size": 5,
    "factory.generator-steps": 4, "factory.audit-samples": 8, "factory.sampler-steps": 3,
    "factory.samples-per-class": 24, "factory.p2p-samples-per-class": 12, "factory.classifier": "small-cnn",
    "factory.classifier-epochs": 2, "factory.p2p-epochs": 1,
}  # fmt: skip
# With val-fraction 0.02 and seed 1, one of the 3 sites holds no held-out image of a class it models,
# so with the audit on (max-memorization > 0) it cannot check that generator and withholds it.
REFUSAL = {"val-fraction": 0.02, "seed": 1, "factory.max-memorization": 0.5}
# The factory run is also autoguided: every site trains a guide per generator it uploads (guides refuse
# DP-SGD and factory-p2p, so the factory run carries them and the P2P run the DP).
GUIDES = {"factory.guide-steps": 3}
# The P2P run's generators train with DP-SGD; every one's epsilon is below the limit the server applies.
DP_GENERATORS = {"factory.dp-noise-multiplier": 2.0, "factory.max-epsilon": 50.0}


FACTORY = {**E2E, **REFUSAL, **GUIDES, "method": "factory"}
# The P2P run also has the sites validate the server's classifier on their real validation images, and
# match its synthetic images to the pixel histograms they upload.
P2P = {"method": "factory-p2p", "factory.conditional": True, "factory.site-validation": True, "factory.calibration-rounds": 1,
       "factory.match-intensity": True}


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        # One thread per process: the machine's cores are shared by Ray workers and the ServerApp.
        patch.setenv("OMP_NUM_THREADS", "1")
        with SimulationSuperLink(tmp_path_factory.mktemp("flwr-home")) as link:
            yield link


def _only_run_dir(results_dir):
    (run,) = [p for p in results_dir.iterdir() if p.is_dir()]
    return run


def _tree_hashes(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def factory_outcome(superlink, tmp_path_factory):
    results = tmp_path_factory.mktemp("factory-results")
    config = {**FACTORY, "results-dir": str(results)}
    outcome = superlink.run_app(config, num_supernodes=3)
    assert outcome.completed, outcome.output[-4000:]
    return outcome, _only_run_dir(results)


@pytest.fixture(scope="module")
def factory_run(factory_outcome):
    return factory_outcome[1]


def test_sites_progress_reaches_the_run_stream_while_generators_train(factory_outcome):
    """Each site's generator training reports its steps (first and last at least) into `flwr run --stream`."""
    output = factory_outcome[0].output
    modelled, _ = _site_classes(REFUSAL)
    for site, classes in modelled.items():
        n = len(classes)
        for k in (1, n):
            assert re.search(rf"site {site}: generator {k}/{n} \S+: step 1/4, loss [0-9.]+, [0-9.]+ images/s", output), site
            assert re.search(rf"site {site}: generator {k}/{n} \S+: step 4/4, loss ", output), site


@pytest.fixture(scope="module")
def p2p_run(superlink, tmp_path_factory):
    results = tmp_path_factory.mktemp("p2p-results")
    config = {**E2E, **P2P, **DP_GENERATORS, "results-dir": str(results)}
    outcome = superlink.run_app(config, num_supernodes=3)
    assert outcome.completed, outcome.output[-4000:]
    return _only_run_dir(results)


def accuracy_from_recalls(per_class_recall) -> float:
    """Accuracy on the digits test split from per-class recalls: sum over classes of recall x class share."""
    counts = np.bincount(load_task_dataset(RunConfig.from_run_config({**E2E, "method": "factory"})).test_labels, minlength=10)
    return float(np.dot(per_class_recall, counts) / counts.sum())


def _site_classes(overrides, min_images=10):
    cfg = RunConfig.from_run_config({**E2E, **overrides, "method": "factory"})
    sites = [simulated_site(cfg, k, 3) for k in range(3)]
    modelled = {s.site_id: [c for c in range(10) if (s.train_labels == c).sum() >= min_images] for s in sites}
    unauditable = {(s.site_id, c) for s in sites for c in modelled[s.site_id] if (s.val_labels == c).sum() == 0}
    return modelled, unauditable


def test_factory_run_writes_library_and_metrics_and_uploads_all_but_the_unauditable_generator(factory_run):
    modelled, unauditable = _site_classes(REFUSAL)
    ((site, withheld_class),) = unauditable  # the scenario needs exactly one generator that cannot be audited
    assert len(modelled[site]) > 1, "and its site must have others to upload"
    summary = json.loads((factory_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 1 and summary["dropped"] == []
    assert summary["factory"]["withheld"] == [{
        "site-id": site, "module-id": f"site{site}-class{withheld_class}", "classes": [withheld_class],
        "reason": f"no held-out image of class(es) [{withheld_class}] to audit against (raise val-fraction)",
    }]  # fmt: skip
    uploaded = [(s, c) for s, classes in modelled.items() for c in classes if (s, c) not in unauditable]
    assert summary["factory"]["missing_classes"] == sorted(set(range(10)) - {c for _, c in uploaded})
    manifest = json.loads((factory_run / "library" / "manifest.json").read_text())
    assert sorted((m["site-id"], c) for m in manifest["modules"] for c in m["classes"]) == sorted(uploaded)
    for module in manifest["modules"]:
        assert (factory_run / "library" / f"{module['module-id']}.safetensors").is_file()
    assert "privacy" not in summary and not any("privacy" in m for m in manifest["modules"])  # no DP-SGD here
    rounds = [json.loads(line) for line in (factory_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1]
    # accuracy is the test split's class shares weighting the per-class recalls (two computations agree)
    assert rounds[0]["test"]["accuracy"] == pytest.approx(accuracy_from_recalls(rounds[0]["test"]["per_class_recall"]))
    # bytes: every site sent its generators, the withholding one three of its four
    received = summary["bytes"]["received_per_site"]
    assert len(received) == 3 and min(received.values()) > 3 * 250_000
    assert (factory_run / "samples" / "all-classes.png").is_file() and (factory_run / "model.safetensors").is_file()
    report = (factory_run / "report.html").read_text()  # written at the end of the run, from these files
    assert "Synthetic samples" in report and all(m["module-id"] in report for m in manifest["modules"])
    # generator fidelity per uploaded class, next to its real-vs-real floor, in fidelity.json and the summary
    fidelity = json.loads((factory_run / "fidelity.json").read_text())
    assert summary["fidelity"] == fidelity
    assert (factory_run / fidelity["tsne_png"]).stat().st_size > 10_000
    per_class = fidelity["classifier"]["per_class"]
    assert sorted(int(name) for name in per_class) == sorted({c for _, c in uploaded})
    assert all(row["n"] == 24 and row["fd"] > -1e-6 and row["fd_floor"] > -1e-6 for row in per_class.values())


def test_p2p_run_evaluates_the_product_of_experts_and_each_expert(p2p_run, tmp_path):
    summary = json.loads((p2p_run / "summary.json").read_text())
    # The run's model file is the Product of Experts: predicting the test split reproduces its accuracy.
    test = load_task_dataset(RunConfig.from_run_config({**E2E, "method": "factory-p2p"}))
    grey = test.test_images[:, 0]
    np.savez(tmp_path / "test.npz", train_images=grey[:2], train_labels=test.test_labels[:2, None], val_images=grey[:1],
             val_labels=test.test_labels[:1, None], test_images=grey, test_labels=test.test_labels[:, None])  # fmt: skip
    report = predict(p2p_run, tmp_path / "test.npz", tmp_path / "predictions.csv")
    assert report["model"].endswith("model-selected.safetensors") and summary["best_round"] == 2
    assert report["metrics"]["accuracy"] == summary["best"]["accuracy"] == summary["p2p"]["poe_test"]["accuracy"]
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert [e["site-id"] for e in summary["p2p"]["experts"]] == [0, 1, 2]
    for expert in summary["p2p"]["experts"]:
        assert expert["test"]["accuracy"] == pytest.approx(accuracy_from_recalls(expert["test"]["per_class_recall"]))
        assert expert["train"]["last_epoch"] == 1  # factory.p2p-epochs
    assert summary["factory"]["classifier"]["last_epoch"] == 2  # factory.classifier-epochs: the server's own
    assert summary["final"] == summary["p2p"]["poe_test"]
    manifest = json.loads((p2p_run / "library" / "manifest.json").read_text())
    assert [m["module-id"] for m in manifest["modules"]] == ["site0", "site1", "site2"]  # conditional: one per site
    # DP generators: each module's epsilon, in the manifest and the summary, is the one its site's image count and
    # the run config give (fedskew.factory.dp_sgd, checked against dp-accounting in test_dp_generators)
    cfg = RunConfig.from_run_config({**E2E, **P2P, **DP_GENERATORS})
    derived = {
        p.module_id: p.privacy
        for site in (simulated_site(cfg, k, 3) for k in range(3))
        for p in planned_modules(cfg, site.site_id, np.bincount(site.train_labels, minlength=10).tolist(), (1, 8, 8))
    }  # fmt: skip
    assert {m["module-id"]: m["privacy"] for m in manifest["modules"]} == {m["module-id"]: derived[m["module-id"]] for m in manifest["modules"]}
    assert [m["privacy"]["epsilon"] for m in summary["factory"]["modules"]] == [m["privacy"]["epsilon"] for m in manifest["modules"]]
    assert all(0 < m["privacy"]["epsilon"] <= 50 for m in manifest["modules"])
    assert summary["privacy"]["epsilon"] == max(m["privacy"]["epsilon"] for m in manifest["modules"])
    # ... and names what the run released outside it: the experts, site validation, histograms (all on in P2P)
    assert summary["privacy"]["not_covered"] == [
        "the survey's image counts per class", "each generator's memorization share (its manifest entry)",
        "each site's expert classifier, trained on its real images without DP",
        "each site's per-class sums of the server's classifier on its real validation images",
        "each site's pixel histograms per class",
    ]  # fmt: skip
    # round 2 relays the whole library to each of the 3 sites
    library_bytes = sum(p.stat().st_size for p in (p2p_run / "library").glob("*.safetensors"))
    assert min(summary["bytes"]["sent_per_site"].values()) > 0.9 * library_bytes
    # The sites judged the server's checkpoints (epochs 1 and 2) and one calibration of its output biases.
    validation = summary["factory"]["site_validation"]
    assert set(validation["site_val_balanced_accuracy_by_epoch"]) == {"1", "2"}
    assert len(validation["site_val_balanced_accuracy_by_calibration_round"]) == 1 and len(validation["class_bias"]) == 10
    assert validation["site_val_images"] == sum(len(simulated_site(cfg, k, 3).val_labels) for k in range(3))
    # Every site's histograms passed the server's check and the stored synthetic set is the matched one:
    # every pixel of a class lies in a histogram bin that holds real training pixels of that class (the
    # digits' pixels are multiples of 1/16: 17 of the 256 bins), whatever the generators drew.
    assert summary["factory"]["classifier"]["intensity_matched"] is True and summary["factory"]["rejected"] == []
    synthetic = load_synthetic(p2p_run / "synthetic.safetensors")
    sites = [simulated_site(cfg, k, 3) for k in range(3)]
    images, labels = np.concatenate([s.train_images for s in sites]), np.concatenate([s.train_labels for s in sites])
    for class_id in np.unique(synthetic.labels):
        real_bins = np.unique(np.minimum(images[labels == class_id] * 256, 255).astype(int))
        matched = synthetic.images[synthetic.labels == class_id].ravel()[:, None] * 256
        assert np.all(((matched >= real_bins - 1e-4) & (matched <= real_bins + 1 + 1e-4)).any(axis=1))


def test_unlearning_a_site_drops_exactly_its_modules_and_leaves_the_source_run_unchanged(factory_run, tmp_path, capsys):
    before = _tree_hashes(factory_run)
    source_manifest = json.loads((factory_run / "library" / "manifest.json").read_text())
    site = source_manifest["modules"][0]["site-id"]
    forgotten = {m["module-id"] for m in source_manifest["modules"] if m["site-id"] == site}
    target = tmp_path / "forgot"
    assert cli_main(["unlearn", str(factory_run), "--site", str(site), "--out", str(target)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {target}" in printed and "(forgotten)" in printed
    assert _tree_hashes(factory_run) == before
    manifest = json.loads((target / "library" / "manifest.json").read_text())
    assert {m["module-id"] for m in manifest["modules"]} == {m["module-id"] for m in source_manifest["modules"]} - forgotten
    source_set, new_set = load_synthetic(factory_run / "synthetic.safetensors"), load_synthetic(target / "synthetic.safetensors")
    assert np.array_equal(new_set.images, source_set.without_modules(forgotten).images)
    assert {j.module_id for j in new_set.jobs} == {j.module_id for j in source_set.jobs} - forgotten
    report = json.loads((target / "unlearning.json").read_text())
    lost = report["classes_without_generator_after"]
    # the retrained classifier never sees a forgotten class (its recall on them is measured in the bench)
    assert lost and set(np.unique(new_set.labels)).isdisjoint(lost)
    assert "(forgotten)" in (target / "unlearning.md").read_text()
    with pytest.raises(ValueError, match="already exists"):
        unlearn(factory_run, site=site, out=target)


def test_unlearning_in_p2p_drops_the_expert_and_refuses_to_split_a_conditional_module(p2p_run, tmp_path):
    with pytest.raises(ValueError, match="cannot be split"):
        unlearn(p2p_run, class_id=int(json.loads((p2p_run / "library" / "manifest.json").read_text())["modules"][0]["classes"][0]))
    before = _tree_hashes(p2p_run)
    target = unlearn(p2p_run, site=1, out=tmp_path / "forgot")
    assert _tree_hashes(p2p_run) == before
    assert sorted(p.name for p in (target / "experts").glob("*.safetensors")) == ["site-0.safetensors", "site-2.safetensors"]
    report = json.loads((target / "unlearning.json").read_text())
    assert report["p2p"]["dropped_experts"] == [1] and report["forgotten_modules"] == ["site1"]
    with pytest.raises(ValueError, match="no module of site 7"):
        unlearn(p2p_run, site=7, out=tmp_path / "none")


def test_an_autoguided_run_keeps_one_guide_per_generator_and_its_images_are_the_guided_draw(factory_run, tmp_path):
    cfg = RunConfig.from_run_config(FACTORY)
    library, guides = read_library(factory_run / "library"), read_library(factory_run / "library" / "guides")
    assert [m.module_id for m in library.modules] == [g.module_id for g in guides.modules]
    planned = {
        p.module_id: p.config
        for site in (simulated_site(cfg, k, 3) for k in range(3))
        for p in planned_modules(guide_config(cfg), site.site_id, np.bincount(site.train_labels, minlength=10).tolist(), (1, 8, 8))
    }  # fmt: skip
    assert all(g.config == planned[g.module_id] for g in guides.modules)
    # The server's synthetic set is the library's draw guided at factory.guidance-weight (2): drawn again
    # here it is the same images, and unguided it is not.
    stored, cpu = load_synthetic(factory_run / "synthetic.safetensors"), torch.device("cpu")
    guided = class_balanced_set(library, cfg.factory, cfg.seed, cpu, guides, cfg.factory.guidance_weight)
    np.testing.assert_allclose(guided.images, stored.images, atol=1e-4)
    assert np.abs(class_balanced_set(library, cfg.factory, cfg.seed, cpu).images - stored.images).max() > 0.05
    summary = json.loads((factory_run / "summary.json").read_text())
    assert all(m["guide_generator_seconds"] > 0 for m in summary["factory"]["site_metrics"])
    # Unlearning a site drops its guides with its generators.
    target = unlearn(factory_run, site=library.modules[0].site_id, out=tmp_path / "forgot")
    kept = [m.module_id for m in library.modules if m.site_id != library.modules[0].site_id]
    assert [g.module_id for g in read_library(target / "library" / "guides").modules] == kept


def test_autoguidance_at_weight_one_is_the_generator_and_at_zero_the_guide():
    """D = guide + w (generator - guide): the same noise gives the generator's images at w = 1 and the guide's
    at w = 0; each module is guided by the guide of its own site and classes."""
    from fedskew.factory.library import synthesise

    def trained_looking(module: GeneratorModule, seed: int) -> GeneratorModule:
        # A new EDM2 network's output layer is zero, so every untrained module denoises alike: perturb them all.
        rng = torch.Generator().manual_seed(seed)
        state = {k: v + 0.3 * torch.randn(v.shape, generator=rng) if v.is_floating_point() else v for k, v in module.state.items()}
        return dataclasses.replace(module, state=state, checksum=state_dict_checksum(state))

    library = Library((trained_looking(make_module(0, 1), 1), trained_looking(make_module(1, 2), 2)), 10, (1, 8, 8), tuple("0123456789"))
    guides = dataclasses.replace(library, modules=(trained_looking(make_module(1, 2), 4), trained_looking(make_module(0, 1), 3)))
    plan = sampling_plan(library, 6, seed=0)
    draw = {"steps": 3, "batch_size": 4, "device": torch.device("cpu"), "progress": False}
    plain, of_guides = synthesise(library, plan, **draw).images, synthesise(guides, plan, **draw).images
    assert not np.allclose(plain, of_guides)
    np.testing.assert_allclose(synthesise(library, plan, guides=guides, guidance_weight=1.0, **draw).images, plain, atol=1e-6)
    np.testing.assert_allclose(synthesise(library, plan, guides=guides, guidance_weight=0.0, **draw).images, of_guides, atol=1e-6)
    with pytest.raises(KeyError, match="no guide for site0-class1"):
        synthesise(library, plan, guides=dataclasses.replace(guides, modules=guides.modules[:1]), **draw)
