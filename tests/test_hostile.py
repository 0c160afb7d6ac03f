"""One bad or hostile site never costs the federation its run: every crafted upload, expert, relayed
library, checkpoint, unlearn input and site data file below is refused with a message naming the input,
where it came from and what is valid, and the server keeps every honest site's generators."""

import dataclasses
import json
import math
import re

import numpy as np
import pytest
import torch
from flwr.common.constant import SType
from flwr.supercore.task_identity import TaskIdentity
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from PIL import Image
from safetensors.torch import save_file

from fedskew.cli import main as cli_main
from fedskew.config import RunConfig
from fedskew.data.site_folder import SiteFolderError, read_labelled_folder
from fedskew import unlearn as unlearn_module
from fedskew.factory.classifier import build_classifier
from fedskew.factory.library import GeneratorModule, Library, UploadRejected, library_from_manifest
from fedskew.factory.site import guide_config, planned_module, planned_modules
from fedskew.models.edm2 import build_generator
from fedskew.models.generator_io import state_dict_checksum
from fedskew.results import RunRecorder
from fedskew.server_tasks import TaskShape
from fedskew.factory.site import generator_payload_limit
from fedskew.protocol import GUIDE_MANIFEST_KEY, GUIDE_PREFIX, decode_modules, encode_modules, packed_weights
from fedskew.strategies import FederatedFactory
from fedskew.strategies.messages import arrays_layout, training_reply_problem

CFG = RunConfig.from_run_config(
    {"method": "factory", "mosaic-grid": 0, "partition": "classes-per-site", "factory.classifier": "small-cnn",
     "factory.max-memorization": 0.5}
)  # fmt: skip
TASK = TaskShape(10, (1, 8, 8), tuple(str(k) for k in range(10)), False, "digits")
# node -> (site id, training label counts): node 11 is site 0 (class 0), node 12 site 1 (class 1).
SITES = {11: (0, [20] + [0] * 9), 12: (1, [0, 30] + [0] * 8)}


def survey_of(sites: dict) -> dict:
    return {node: {"site-id": site, "label-counts": counts} for node, (site, counts) in sites.items()}


@pytest.fixture(scope="module")
def honest():
    """site id -> (manifest, modules) of an honest upload (untrained weights: only their form matters)."""
    uploads = {}
    for site, counts in SITES.values():
        modules = []
        for planned in planned_modules(CFG, site, counts, TASK.image_shape):
            state = build_generator(planned.config).state_dict()
            modules.append(
                GeneratorModule(planned.module_id, site, planned.classes, planned.image_counts, planned.config,
                                state_dict_checksum(state), 0.1, state)
            )  # fmt: skip
        uploads[site] = ({"site-id": site, "image-shape": list(TASK.image_shape), "modules": [m.metadata() for m in modules]}, modules)
    return uploads


@pytest.fixture(autouse=True)
def inside_a_run(monkeypatch):
    """Messages are made inside a run (as in a ServerApp)."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


class ScriptedGrid:
    """A Grid whose sites answer with `answer(node, message)`."""

    def __init__(self, answer):
        self.answer = answer

    def send_and_receive(self, messages, timeout=None):
        return [Message(self.answer(m.metadata.dst_node_id, m), reply_to=m) for m in messages]


def factory_strategy(tmp_path, survey, cfg=CFG, floor=1) -> FederatedFactory:
    """The server's strategy for the sites of `survey` under `cfg`, recording into tmp_path."""
    strategy = FederatedFactory(survey, TASK.num_classes, TASK.image_shape, TASK.class_names, cfg.factory, seed=cfg.seed,
                                feature_side=cfg.feature_side, timeout=10, min_sites=floor)  # fmt: skip
    strategy.attach(RunRecorder(path=tmp_path, multilabel=False, method="factory"))
    return strategy


def round_replies(strategy: FederatedFactory, server_round: int, answer) -> list[Message]:
    """One round's exchange as Flower's start makes it: the strategy's configure_train messages, answered by `answer`."""
    grid = ScriptedGrid(answer)
    return grid.send_and_receive(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))


def collect_library(tmp_path, answer, survey, cfg=CFG, floor=1):
    """The strategy and round 1's (library, rejections) with the sites answering `answer`."""
    strategy = factory_strategy(tmp_path, survey, cfg, floor)
    return strategy, strategy.checked_library(round_replies(strategy, 1, answer))


def collect_experts(tmp_path, answer, survey=None):
    """Round 2's (experts, rejections) with the sites answering `answer` to the relay of an empty library."""
    strategy = factory_strategy(tmp_path, survey_of(SITES) if survey is None else survey)
    strategy.library = _empty_library()  # as round 1 leaves it
    return strategy.checked_experts(round_replies(strategy, 2, answer))


def collect(tmp_path, honest, hostile_content, sites=SITES):
    """The server's round 1 with site 0 honest and node 12 answering `hostile_content(honest)`."""

    def answer(node, _):
        return hostile_content(honest) if node == 12 else encode_modules(*honest[0])

    return collect_library(tmp_path, answer, survey_of(sites))[1]


def with_module(changes):
    """Site 1's upload with its module metadata changed."""

    def forge(honest):
        manifest, modules = json.loads(json.dumps(honest[1][0])), honest[1][1]
        changes(manifest["modules"][0])
        return encode_modules(manifest, modules)

    return forge


def with_weights(dtype):
    def forge(honest):
        manifest, (module,) = honest[1]
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in module.state.items()}
        return encode_modules(manifest, [dataclasses.replace(module, state=state)])

    return forge


def with_manifest_text(text):
    def forge(honest):
        content = encode_modules(*honest[1])
        content["manifest"] = ConfigRecord({"json": text})
        return content

    return forge


def with_config(field, value):
    return with_module(lambda m: m["config"].__setitem__(field, value))


def renamed(module_id):
    def forge(honest):
        manifest, (module,) = honest[1]
        forged = dataclasses.replace(module, module_id=module_id)
        return encode_modules({**manifest, "modules": [forged.metadata()]}, [forged])

    return forge


def oversized(honest):
    content = encode_modules(*honest[1])
    content["generator.site1-class1"] = ArrayRecord({"safetensors": Array(np.zeros(64 << 20, dtype=np.uint8))})
    return content


def impostor(honest):
    """Node 12 (site 1) sends site 0's generator under site 0's ids."""
    return encode_modules(*honest[0])


def many_arrays(honest):
    content = encode_modules(*honest[1])
    for k in range(1000):
        content[f"generator.site1-x{k}"] = ArrayRecord({"safetensors": Array(np.zeros(8, dtype=np.uint8))})
    return content


HOSTILE_UPLOADS = {
    "bf16 weights": (with_weights(torch.bfloat16), "dtype bfloat16, expected float32"),
    "float8 weights": (with_weights(torch.float8_e4m3fn), "dtype float8_e4m3fn, expected float32"),
    "module id int": (with_module(lambda m: m.__setitem__("module-id", 7)), r"declares modules \[7\]"),
    "module id null": (with_module(lambda m: m.__setitem__("module-id", None)), r"declares modules \[None\]"),
    "module id newline": (renamed("site1-class1\n"), r"weights came for modules \['site1-class1\\n'\]"),
    "seed 2**64": (with_config("seed", 2**64), "declared config .* differs from the server's"),
    "model_channels 2**40": (with_config("model_channels", 2**40), "declared config .* differs"),
    "num_blocks 10**6": (with_config("num_blocks", 10**6), "declared config .* differs"),
    "float field as text": (with_config("dropout", "0.0"), "declared config .* differs"),
    "image-counts 10**400": (with_module(lambda m: m.__setitem__("image-counts", [10**400])), "declared image-counts .* differs"),
    "image-counts 10**15": (with_module(lambda m: m.__setitem__("image-counts", [10**15])), r"declared image-counts \[1000000000000000\] differs"),
    "nested 100000 deep": (with_manifest_text("[" * 100_000 + "]" * 100_000), "a JSON string of at most 32768 characters, got 200000"),
    "nested 5000 deep": (with_manifest_text("[" * 5000 + "]" * 5000), "not valid JSON: maximum recursion depth"),
    "nested 10 deep": (with_manifest_text('{"a": ' + "[" * 9 + "]" * 9 + "}"), "a JSON object nested at most 8 deep"),
    "5000-digit int": (with_manifest_text('{"site-id": 1' + "0" * 5000 + "}"), "not valid JSON"),
    "memorisation as text": (with_module(lambda m: m.__setitem__("memorization", "0.1")), "memorization must be a share"),
    "64 MiB payload": (oversized, r"take 67\d{6} bytes; this run's model takes at most \d+"),
    "impostor": (impostor, "claims site-id 0, but its node answered the survey as site 1"),
    "a class it does not hold": (renamed("site1-class5"), r"weights came for modules \['site1-class5'\]; expected \['site1-class1'\]"),
    "1000 generator arrays": (many_arrays, r"weights came for modules .* \.\.\.; expected \['site1-class1'\]"),
    "no manifest": (lambda honest: RecordDict({}), "no 'manifest' record"),
}


@pytest.mark.parametrize("case", HOSTILE_UPLOADS)
def test_a_hostile_upload_is_rejected_naming_site_and_reason_and_the_honest_site_is_kept(tmp_path, honest, case):
    forge, reason = HOSTILE_UPLOADS[case]
    library, rejected = collect(tmp_path, honest, forge)
    assert [m.module_id for m in library.modules] == ["site0-class0"]
    (rejection,) = rejected
    assert rejection["node"] == "12" and rejection["site-id"] == 1
    assert re.search(reason, rejection["reason"]), rejection["reason"]


def _hostile_site():
    """tests/hostile_site/sitecustomize.py, the forgery of the real-process hostile site (tests/test_deploy.py)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("hostile_site", Path(__file__).parent / "hostile_site" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOSTILE_SITE = _hostile_site()
# What refuses each lie of the real-process hostile site, told alone (one forged message per check).
FORGED_CHECKS = {
    "impostor": "claims site-id 0, but its node answered the survey as site 1",
    "image count": r"declared image-counts \[1000000000000000\] differs",
    "oversized generator": "declared config .* differs from the server's",
}


@pytest.mark.parametrize("lie", list(HOSTILE_SITE.LIES))
def test_each_lie_of_the_deployed_hostile_site_is_refused_by_its_own_check(tmp_path, honest, lie):
    library, (rejection,) = collect(tmp_path, honest, lambda _: HOSTILE_SITE.forged_upload(CFG, 1, SITES[12][1], TASK.image_shape, [lie]))
    assert [m.module_id for m in library.modules] == ["site0-class0"] and rejection["site-id"] == 1
    assert re.search(FORGED_CHECKS[lie], rejection["reason"]), rejection["reason"]


def test_the_deployed_hostile_sites_upload_without_a_lie_is_accepted_and_with_all_is_refused_as_an_impostor(tmp_path, honest):
    # Without a lie the forgery is an honest upload of untrained generators: each refusal above is its lie's.
    library, rejected = collect(tmp_path, honest, lambda _: HOSTILE_SITE.forged_upload(CFG, 1, SITES[12][1], TASK.image_shape, []))
    assert rejected == [] and [m.module_id for m in library.modules] == ["site0-class0", "site1-class1"]
    library, (rejection,) = collect(tmp_path, honest, lambda _: HOSTILE_SITE.forged_upload(CFG, 1, SITES[12][1], TASK.image_shape))
    assert re.search(FORGED_CHECKS["impostor"], rejection["reason"]), rejection["reason"]


def test_both_honest_uploads_pass_and_their_counts_come_from_the_survey(tmp_path, honest):
    library, rejected = collect(tmp_path, honest, lambda honest: encode_modules(*honest[1]))
    assert rejected == [] and [(m.module_id, m.image_counts) for m in library.modules] == [("site0-class0", (20,)), ("site1-class1", (30,))]


def test_nodes_claiming_one_site_id_are_all_refused_before_round_one(tmp_path, honest):
    library, rejected = collect(tmp_path, honest, impostor, sites={**SITES, 12: (0, SITES[11][1])})
    assert library.modules == () and [r["node"] for r in rejected] == ["11", "12"]
    assert all("nodes [11, 12] all claim site-id 0" in r["reason"] for r in rejected)


def test_a_malformed_survey_reply_refuses_that_node_only(tmp_path, honest):
    sites = {**SITES, 13: (2.5, [1] * 10), 14: (3, [-1] * 10)}
    library, rejected = collect(tmp_path, honest, lambda honest: encode_modules(*honest[1]), sites=sites)
    assert [m.site_id for m in library.modules] == [0, 1]
    assert [(r["node"], r["reason"].split(" must")[0]) for r in rejected] == [("13", "survey site-id"), ("14", "survey label-counts")]


def test_a_server_bug_while_checking_one_upload_rejects_it_loudly_and_the_run_goes_on(tmp_path, honest, monkeypatch, capsys):
    from fedskew.strategies import factory_flow

    real = factory_flow.validate_upload

    def buggy(manifest, states, **kwargs):
        if kwargs["site_id"] == 1:
            raise KeyError("a bug")
        return real(manifest, states, **kwargs)

    monkeypatch.setattr(factory_flow, "validate_upload", buggy)
    library, (rejection,) = collect(tmp_path, honest, lambda honest: encode_modules(*honest[1]))
    assert [m.module_id for m in library.modules] == ["site0-class0"]
    assert "KeyError: 'a bug'" in rejection["reason"] and "fedskew bug" in rejection["reason"]
    assert "Traceback" in capsys.readouterr().err


def test_the_generator_payload_limit_is_the_run_models_size():
    planned = planned_modules(CFG, 0, [20] + [0] * 9, TASK.image_shape)[0]
    weights = sum(t.numel() * 4 for t in build_generator(planned.config, "meta").state_dict().values())
    assert weights < generator_payload_limit(CFG, TASK.image_shape, 10) <= weights + (1 << 20)


# --- autoguidance: the guides travel beside the generators ----------------------------------------------

GUIDED = CFG.model_copy(update={"factory": CFG.factory.model_copy(update={"generator_channels": 32, "guide_steps": 3})})


def untrained_modules(cfg: RunConfig, site: int, counts: list[int]) -> list[GeneratorModule]:
    return [
        GeneratorModule(p.module_id, site, p.classes, p.image_counts, p.config, state_dict_checksum(state), 0.1, state)
        for p in planned_modules(cfg, site, counts, TASK.image_shape)
        for state in [build_generator(p.config).state_dict()]
    ]  # fmt: skip


def guided_upload(site: int, guides_of=None, manifest_changes=None) -> RecordDict:
    """Site `site`'s upload with guides (`guides_of(guides)` forges them, `manifest_changes` the guide manifest)."""
    counts = dict(SITES.values())[site]
    modules, guides = untrained_modules(GUIDED, site, counts), untrained_modules(guide_config(GUIDED), site, counts)
    guides = guides_of(guides) if guides_of else guides
    meta = {"site-id": site, "image-shape": list(TASK.image_shape)}
    content = encode_modules({**meta, "modules": [m.metadata() for m in modules]}, modules)
    guide_manifest = {**meta, "modules": [g.metadata() for g in guides]}
    if manifest_changes:
        manifest_changes(guide_manifest)
    return encode_modules(guide_manifest, guides, content, GUIDE_MANIFEST_KEY, GUIDE_PREFIX)


def as_generator_config(guides):
    """A guide that is really a copy of the (wider) generator."""
    return untrained_modules(GUIDED, guides[0].site_id, dict(SITES.values())[guides[0].site_id])


def trained_longer(guides):
    """Guides of the same architecture but another step count than factory.guide-steps."""
    longer = GUIDED.model_copy(update={"factory": GUIDED.factory.model_copy(update={"guide_steps": 30})})
    return untrained_modules(guide_config(longer), guides[0].site_id, dict(SITES.values())[guides[0].site_id])


def no_guide_manifest(honest):
    content = guided_upload(1)
    del content[GUIDE_MANIFEST_KEY]
    return content


HOSTILE_GUIDES = {
    "a guide trained longer": (lambda honest: guided_upload(1, guides_of=trained_longer), "declared config .* differs"),
    "no guide manifest": (no_guide_manifest, "no 'guide-manifest' record"),
    "guide weights missing": (lambda honest: guided_upload(1, guides_of=lambda g: []), r"weights came for guides \[\]; expected \['site1-class1'\]"),
    "the generator as its own guide": (lambda honest: guided_upload(1, guides_of=as_generator_config),
                                       r"guide 'site1-class1': the packed weights take \d+ bytes; this run's model takes at most \d+"),
    "another site's guide manifest": (lambda honest: guided_upload(1, manifest_changes=lambda m: m.__setitem__("site-id", 0)),
                                      "claims site-id 0, but its node answered the survey as site 1"),
}


def collect_guided(tmp_path, forge):
    def answer(node, _):
        return forge(None) if node == 12 else guided_upload(0)

    strategy, (library, rejected) = collect_library(tmp_path, answer, survey_of(SITES), GUIDED)
    return library, strategy.guides, rejected


def test_honest_guided_uploads_give_one_guide_per_generator_at_the_guide_config(tmp_path):
    library, guides, rejected = collect_guided(tmp_path, lambda _: guided_upload(1))
    assert rejected == [] and [m.module_id for m in library.modules] == [g.module_id for g in guides.modules] == ["site0-class0", "site1-class1"]
    assert {g.config.model_channels for g in guides.modules} == {16} and {m.config.model_channels for m in library.modules} == {32}


@pytest.mark.parametrize("case", HOSTILE_GUIDES)
def test_a_hostile_guide_upload_is_rejected_with_its_generators_and_the_honest_site_is_kept(tmp_path, case):
    forge, reason = HOSTILE_GUIDES[case]
    library, guides, (rejection,) = collect_guided(tmp_path, forge)
    assert [m.module_id for m in library.modules] == [g.module_id for g in guides.modules] == ["site0-class0"]
    assert rejection["node"] == "12" and re.search(reason, rejection["reason"]), rejection["reason"]


# --- P2P: experts and the relayed library -----------------------------------------------------------


def expert_reply(state=None, metrics=None):
    state = state if state is not None else build_classifier("small-cnn", TASK.image_shape, 10, 8).state_dict()
    return RecordDict({"expert": packed_weights(state), "metrics": MetricRecord(metrics or {"train_loss": 0.5, "val_accuracy": 0.5})})


@pytest.mark.parametrize(
    ("hostile", "reason"),
    [
        (lambda: expert_reply({k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v
                               for k, v in build_classifier("small-cnn", TASK.image_shape, 10, 8).state_dict().items()}),
         "dtype torch.float8_e4m3fn, the model's is torch.float32"),
        (lambda: expert_reply(metrics={"val_accuracy": 0.5}), r"metrics \['train_loss'\] are missing or not finite"),
        (lambda: expert_reply(metrics={"train_loss": math.inf, "val_accuracy": 0.5}), "not finite"),
        (lambda: RecordDict({}), "no expert weights"),
    ],
    ids=["float8", "no train_loss", "inf train_loss", "no expert"],
)
def test_a_hostile_expert_is_rejected_and_the_others_are_kept(tmp_path, hostile, reason):
    answer = lambda node, _: hostile() if node == 12 else expert_reply()  # noqa: E731
    experts, (rejection,) = collect_experts(tmp_path, answer)
    assert [e.site_id for e in experts] == [0] and rejection["site-id"] == 1
    assert re.search(reason, rejection["reason"]), rejection["reason"]


def _empty_library():
    return Library((), 10, TASK.image_shape, TASK.class_names)


def test_an_expert_is_named_by_its_nodes_survey_not_by_the_site_id_it_reports(tmp_path):
    answer = lambda node, _: expert_reply(metrics={"train_loss": 0.5, "val_accuracy": 0.5, "site-id": math.nan})  # noqa: E731
    experts, rejected = collect_experts(tmp_path, answer)
    assert rejected == [] and [(e.node, e.site_id) for e in experts] == [(11, 0), (12, 1)]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: m.__setitem__("num-classes", "10"), "num-classes must be an int"),
        (lambda m: m.__setitem__("image-shape", "1x8x8"), "image-shape must be three ints"),
        (lambda m: m.__setitem__("class-names", 10), "class-names must be 10 strings"),
        (lambda m: m["modules"][0].__setitem__("classes", "1"), "classes must be a non-empty list of ints"),
        (lambda m: m["modules"][0]["config"].__setitem__("num_blocks", 3), r"config fields \['num_blocks'\] differ"),
        (lambda m: m["modules"][0].__setitem__("site-id", 0), "is named 'site0-class1'"),
    ],
    ids=["num-classes text", "image-shape text", "class-names int", "classes text", "another config", "id of another site"],
)
def test_a_relayed_library_with_wrong_fields_is_refused_by_the_site(honest, change, reason):
    manifest, modules = honest[1]
    relayed = {"num-classes": 10, "image-shape": [1, 8, 8], "class-names": list(TASK.class_names), "modules": manifest["modules"]}
    relayed = json.loads(json.dumps(relayed))
    content = encode_modules(relayed, modules)
    decoded, states = decode_modules(content, generator_payload_limit(CFG, TASK.image_shape, 10))
    planned = lambda site, classes, counts: planned_module(CFG, site, classes, counts, TASK.image_shape, 10)  # noqa: E731
    assert [m.module_id for m in library_from_manifest(decoded, states, planned).modules] == ["site1-class1"]
    change(decoded)
    with pytest.raises(UploadRejected, match=reason):
        library_from_manifest(decoded, states, planned)


# --- resume-from ------------------------------------------------------------------------------------------


@pytest.fixture
def earlier_run(tmp_path):
    recorder = RunRecorder.create(RunConfig.from_run_config({"method": "fedavg", "mosaic-grid": 0, "partition": "iid"}),
                                  multilabel=False, base=tmp_path / "earlier")  # fmt: skip
    recorder.save_checkpoint(torch.nn.Linear(3, 2).state_dict(), server_round=1)
    recorder.record_round(1, {"accuracy": 0.5})
    return recorder.path


def _resume(earlier, tmp_path):
    recorder = RunRecorder(path=tmp_path, multilabel=False, method="fedavg")
    return recorder.continue_from(earlier, torch.nn.Linear(3, 2).state_dict())


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda run: (run / "checkpoint.json").write_text('{"round": "abc"}'), "completed round as an int >= 1, got 'abc'"),
        (lambda run: (run / "checkpoint.json").write_text('{"round": '), "cannot read .*checkpoint.json"),
        (lambda run: (run / "model.safetensors").write_bytes((run / "model.safetensors").read_bytes()[:40]), "not a readable checkpoint"),
        (lambda run: save_file(torch.nn.Linear(5, 2).state_dict(), str(run / "model.safetensors")),
         r"does not fit this run's model: tensor 'weight' has shape \(2, 5\), the model's is \(2, 3\)"),
        (lambda run: save_file({k: torch.full_like(v, math.nan) for k, v in torch.nn.Linear(3, 2).state_dict().items()},
                                                                    str(run / "model.safetensors")), "holds non-finite values"),
        (lambda run: (run / "metrics.jsonl").write_bytes(b"\xff\n"), "cannot read .*metrics.jsonl"),
    ],
    ids=["round abc", "broken marker", "truncated", "another model", "all NaN", "metrics not UTF-8"],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file(earlier_run, tmp_path, damage, reason):
    (tmp_path / "ok").mkdir()
    assert _resume(earlier_run, tmp_path / "ok")[0] == 1
    damage(earlier_run)
    (tmp_path / "new").mkdir()
    with pytest.raises(ValueError, match=reason):
        _resume(earlier_run, tmp_path / "new")


# --- unlearn ----------------------------------------------------------------------------------------------


def test_unlearn_refuses_an_output_inside_the_source_run_or_an_existing_one(tmp_path):
    run = tmp_path / "run"
    (run / "library").mkdir(parents=True)
    with pytest.raises(ValueError, match="lies inside the source run"):
        unlearn_module.output_folder(run, run / "library" / "x", "site0")
    with pytest.raises(ValueError, match="lies inside the source run"):
        unlearn_module.output_folder(run, run, "site0")
    with pytest.raises(ValueError, match="already exists"):
        unlearn_module.output_folder(run, tmp_path, "site0")
    assert unlearn_module.output_folder(run, None, "site0") == tmp_path / "run-forget-site0"


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ({"site-id": 0, "file": "../../../x.safetensors"}, "must be the file 'site-0.safetensors'"),
        ({"site-id": "0", "file": "site-0.safetensors"}, "needs a distinct int site-id"),
        ({"site-id": 0, "file": "site-0.safetensors"}, "cannot read .*site-0.safetensors"),
    ],
    ids=["path traversal", "site-id text", "missing file"],
)
def test_unlearn_opens_only_the_expert_files_the_run_wrote(tmp_path, entry, reason):
    (tmp_path / "experts").mkdir()
    (tmp_path / "experts" / "manifest.json").write_text(json.dumps({"classifier": "small-cnn", "experts": [entry]}))
    with pytest.raises(ValueError, match=reason):
        unlearn_module._load_experts(tmp_path, CFG, 10, TASK.image_shape)


def test_a_failed_unlearn_leaves_no_folder_behind_and_the_rerun_is_not_blocked(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(CFG.to_run_config()))

    def fail_half_way(run_dir, cfg, target, site, class_id):
        (target / "library").mkdir()
        raise ValueError("the library is damaged")

    monkeypatch.setattr(unlearn_module, "_write_unlearned", fail_half_way)
    for _ in range(2):  # the second attempt meets the same error, not a leftover folder
        assert cli_main(["unlearn", str(run), "--site", "0"]) == 2
        assert "fedskew unlearn: the library is damaged" in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing-run", "--site", "0"], "cannot read .*missing-run/config.json"),
        (["run", "--site", "0", "--out", "run/inside"], "lies inside the source run"),
    ],
)
def test_unlearn_cli_errors_are_one_line_not_a_traceback(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(CFG.to_run_config()))
    assert cli_main(["unlearn", *args]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


# --- site data ------------------------------------------------------------------------------------------------


def png_folder(tmp_path, rows, images=None, labels_bytes=None):
    (tmp_path / "images").mkdir()
    for name, mode in (images or {"a.png": "L", "b.png": "L"}).items():
        Image.new(mode, (8, 8)).save(tmp_path / "images" / name)
    (tmp_path / "labels.csv").write_bytes(labels_bytes or ("file,labels\n" + "".join(f"{f},{l}\n" for f, l in rows)).encode())
    (tmp_path / "classes.txt").write_text("\n".join(str(k) for k in range(10)) + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ([("a.png", "²"), ("b.png", "1")], r"labels.csv line 2: labels '²' are not class ids; valid: whole numbers >= 0 written with 0-9"),
        ([("a.png", "٣"), ("b.png", "1")], r"line 2: labels '٣' are not class ids"),
        ([("a.png", "1"), ("b.png", "9" * 5000)], r"line 3: labels '9999.*' are not class ids"),
        ([("a.png", "1"), ("b.png", "1" + " " * 200_000)], r"labels.csv line 3: field larger than field limit"),
    ],
    ids=["superscript two", "arabic-indic digit", "5000 digits", "200000-char field"],
)
def test_a_bad_label_is_refused_naming_file_and_line(tmp_path, rows, reason):
    with pytest.raises(SiteFolderError, match=reason):
        read_labelled_folder(png_folder(tmp_path, rows), multilabel=False)


def test_a_labels_csv_that_is_not_utf8_names_its_line(tmp_path):
    folder = png_folder(tmp_path, [], labels_bytes=b"file,labels\na.png,1\nb\xe9.png,1\n")
    with pytest.raises(SiteFolderError, match=r"labels.csv line 3 is not UTF-8"):
        read_labelled_folder(folder, multilabel=False)


def test_mixed_grey_and_colour_images_are_refused_also_when_resized(tmp_path):
    folder = png_folder(tmp_path, [("a.png", "1"), ("b.png", "2")], images={"a.png": "L", "b.png": "RGB"})
    for size in (0, 16):
        with pytest.raises(SiteFolderError, match=r"b.png \(line 3 of .*labels.csv\) has shape \(3, 8, 8\) .* line 2 has \(1, 8, 8\)"):
            read_labelled_folder(folder, multilabel=False, image_size=size)


def test_a_decompression_bomb_is_refused_before_it_is_decoded(tmp_path, monkeypatch):
    # PIL's own guard scaled down: a 64 x 64 image stands in for a 20000 x 20000 one.
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    folder = png_folder(tmp_path, [("a.png", "1"), ("b.png", "1")], images={"a.png": "L", "b.png": "L"})
    for side in (40, 64):  # PIL warns above its limit and fails above twice it: both are refused
        Image.new("L", (side, side)).save(folder / "images" / "b.png")
        with pytest.raises(SiteFolderError, match=rf"b.png \(line 3 of .*\) is too large .*{side * side} pixels.*at most 1000 pixels"):
            read_labelled_folder(folder, multilabel=False)


def test_an_npz_with_five_channels_is_refused(tmp_path):
    np.savez(tmp_path / "site.npz", train_images=np.zeros((4, 8, 8, 5), np.uint8), train_labels=np.zeros((4, 1), np.int64),
             class_names=np.array([str(k) for k in range(10)]))  # fmt: skip
    with pytest.raises(SiteFolderError, match=r"site.npz: .*'train_images' has shape \(4, 8, 8, 5\); .*C = 1 \(grey\) or 3 \(RGB\)"):
        read_labelled_folder(tmp_path, multilabel=False)


# --- a federated round's training replies (FedAvg, FedNCA-ML, SCAFFOLD and the others) ---------------------

def _model_record(weight: float) -> dict[str, np.ndarray]:
    return {"w": np.full((2, 3), weight, np.float32), "bn.num_batches_tracked": np.array(5, np.int64)}


def _update(arrays: dict[str, np.ndarray], **metrics) -> RecordDict:
    return RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                       "metrics": MetricRecord({"num-examples": 10, **metrics})})  # fmt: skip


def _damaged_bytes() -> RecordDict:
    content = _update(_model_record(9.0))
    content["arrays"]["w"] = Array(dtype="float32", shape=(2, 3), stype=SType.NUMPY, data=b"\x00\x01")
    return content


HOSTILE_UPDATES = {
    "NaN weights": (_update({**_model_record(9.0), "w": np.full((2, 3), np.nan, np.float32)}), "NaN or infinite"),
    "a wrong shape": (_update({**_model_record(9.0), "w": np.zeros((3, 2), np.float32)}), r"shape \(3, 2\)"),
    "text for numbers": (_update({**_model_record(9.0), "w": np.full((2, 3), "x")}), "real numbers"),
    "a missing array": (_update({"w": np.zeros((2, 3), np.float32)}), r"missing \['bn.num_batches_tracked'\]"),
    "an unknown array": (_update({**_model_record(9.0), "extra": np.zeros(1, np.float32)}), r"unknown \['extra'\]"),
    "a huge weight": (_update(_model_record(9.0), **{"num-examples": math.inf}), "finite number > 0"),
    "a negative weight": (_update(_model_record(9.0), **{"num-examples": -10}), "finite number > 0"),
    "no weight": (RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in _model_record(9.0).items()}),
                              "metrics": MetricRecord({"loss": 1.0})}), "'num-examples' must be"),  # fmt: skip
    "a second ArrayRecord": (RecordDict({**dict(_update(_model_record(9.0)).items()), "more": ArrayRecord()}), "one ArrayRecord"),
    "damaged bytes": (_damaged_bytes(), "cannot be read"),
}


@pytest.mark.parametrize("method", ["fedavg", "fednca", "scaffold"])
@pytest.mark.parametrize("case", list(HOSTILE_UPDATES), ids=list(HOSTILE_UPDATES))
def test_a_malformed_training_update_is_refused_and_the_round_averages_the_others(tmp_path, capsys, method, case):
    # Two honest sites (weights 1 and 3, 10 examples each) and one hostile: the average is exactly 2, as
    # if the hostile site had dropped out, and the refusal names the site, the round and what was wrong.
    from fedskew.strategies import build_strategy
    from fedskew.strategies.fednca import FedNCA
    from test_privacy import SitesOnline

    cfg = RunConfig.from_run_config({"method": method})
    model = torch.nn.Linear(3, 2, bias=False)
    etf = torch.eye(2)
    strategy = build_strategy(cfg, 3, model, etf=etf)
    strategy.attach(RunRecorder.create(cfg, multilabel=True, base=tmp_path))
    sent = ArrayRecord({k: Array(v) for k, v in _model_record(0.0).items()})
    outgoing = strategy.configure_train(1, sent, ConfigRecord(), SitesOnline(3))
    hostile_content, reason = HOSTILE_UPDATES[case]
    echo = {"etf-crc32": strategy.etf_crc32} if isinstance(strategy, FedNCA) else {}

    def honest_reply(weight: float, to: Message) -> Message:
        arrays = _model_record(weight)
        if method == "scaffold":
            arrays["scaffold-control-delta.weight"] = np.zeros((2, 3), np.float32)
        return Message(_update(arrays, **echo), reply_to=to)

    if method == "scaffold":  # its replies carry the control deltas as well; give the hostile one them too
        hostile_arrays = hostile_content["arrays"] if list(hostile_content.array_records) == ["arrays"] else None
        if hostile_arrays is not None and case != "an unknown array":
            hostile_arrays["scaffold-control-delta.weight"] = Array(np.zeros((2, 3), np.float32))
    replies = [honest_reply(1.0, outgoing[0]), honest_reply(3.0, outgoing[1]), Message(hostile_content, reply_to=outgoing[2])]
    arrays, _ = strategy.aggregate_train(1, replies)

    averaged = arrays.to_torch_state_dict()
    assert torch.equal(averaged["w"], torch.full((2, 3), 2.0))
    (dropped,) = strategy.recorder.dropped
    assert dropped["site"] == str(outgoing[2].metadata.dst_node_id) and dropped["round"] == 1
    assert re.search(reason, dropped["reason"]) and "round 1 update refused" in dropped["reason"]
    assert dropped["reason"] in capsys.readouterr().out


def _report(**metrics) -> RecordDict:
    return RecordDict({"metrics": MetricRecord({"val_accuracy": 0.5, "val_balanced_accuracy": 0.5, "num-examples": 10,
                                                "unit-weight": 1, **metrics})})  # fmt: skip


HOSTILE_REPORTS = {
    "an accuracy above 1": (_report(val_accuracy=5.0), r"'val_accuracy' must be a number in \[0, 1\]"),
    "a NaN accuracy": (_report(val_accuracy=math.nan), r"'val_accuracy' must be a number in \[0, 1\]"),
    "no weight": (RecordDict({"metrics": MetricRecord({"val_accuracy": 0.5, "val_balanced_accuracy": 0.5})}), "must be a finite number > 0"),
    "an extra metric": (_report(val_loss=0.1), r"its metrics are \["),
    "arrays as well": (RecordDict({**dict(_report().items()), "arrays": ArrayRecord()}), "expected only a MetricRecord"),
}


@pytest.mark.parametrize("case", list(HOSTILE_REPORTS), ids=list(HOSTILE_REPORTS))
def test_a_malformed_validation_report_is_refused_and_the_others_are_averaged(tmp_path, case):
    # Two honest single-label sites report accuracy 0.6 and 1.0 on 10 examples each: 0.8 whatever the third sent.
    from fedskew.strategies import build_strategy
    from test_privacy import SitesOnline

    cfg = RunConfig.from_run_config({"method": "fedavg", "dataset": "digits", "mosaic-grid": 0, "partition": "iid"})
    strategy = build_strategy(cfg, 3, torch.nn.Linear(1, 1))
    strategy.attach(RunRecorder.create(cfg, multilabel=False, base=tmp_path))
    sent = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    outgoing = strategy.configure_evaluate(1, sent, ConfigRecord(), SitesOnline(3))
    hostile, reason = HOSTILE_REPORTS[case]
    replies = [Message(_report(val_accuracy=0.6), reply_to=outgoing[0]), Message(_report(val_accuracy=1.0), reply_to=outgoing[1]),
               Message(hostile, reply_to=outgoing[2])]  # fmt: skip
    metrics = strategy.aggregate_evaluate(1, replies)
    assert metrics["val_accuracy"] == pytest.approx(0.8)
    (dropped,) = strategy.recorder.dropped
    assert re.search(reason, dropped["reason"]) and "round 1 validation report refused" in dropped["reason"]


def test_an_integer_counter_answering_its_averaged_float_is_accepted():
    # After one average the server sends BatchNorm's step counter as a float; a site's model holds it as an
    # int64 and sends that back: the same array, not a malformed one.
    sent = ArrayRecord({"w": Array(np.zeros((2, 3), np.float32)), "bn.num_batches_tracked": Array(np.array(5.0))})
    assert training_reply_problem(_update(_model_record(1.0)), arrays_layout(sent), "num-examples", None) is None
