"""Property-based checks (hypothesis) of every decoder that takes input from outside the server process:
whatever it is given, it raises only its documented rejection type, within a bounded time (the deadline)
and memory (traced allocations), and identity checks refuse impostors and duplicate site ids. Inputs
hypothesis once found are kept as @example regression cases."""

import dataclasses
import json
import tracemalloc

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from fedskew.config import RunConfig
from fedskew.data.site_folder import SiteFolderError, read_labelled_folder
from fedskew import unlearn as unlearn_module
from fedskew.factory.library import (
    GeneratorModule,
    PlannedModule,
    UploadRejected,
    library_from_manifest,
    validate_upload,
)
from fedskew.models.edm2 import CPU_PRESET, GeneratorConfig, build_generator
from fedskew.models.generator_io import state_dict_checksum
from fedskew.results import RunRecorder
from fedskew.protocol import decode_manifest, unpacked_weights
from fedskew.strategies.factory_flow import site_identities

# Small budgets: the whole file runs in well under a minute on a loaded 2-core machine.
FAST = settings(max_examples=25, deadline=3000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=10, deadline=5000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# No decoder may hold more than this in traced (Python and numpy) allocations for inputs of these sizes.
MEMORY_BOUND = 64 << 20

TINY = dataclasses.replace(CPU_PRESET, model_channels=8, num_blocks=1, batch_size=8, total_images=8, t_ref=8, t_rampup=0)
STATE = {k: v.clone() for k, v in build_generator(TINY).state_dict().items()}
MODULE = GeneratorModule("site1-class3", 1, (3,), (20,), TINY, state_dict_checksum(STATE), 0.0, STATE)
PLAN = [PlannedModule(MODULE.module_id, MODULE.classes, MODULE.image_counts, TINY)]
UPLOAD = {"site-id": 1, "image-shape": [1, 8, 8], "modules": [MODULE.metadata()]}
LIBRARY = {"num-classes": 10, "image-shape": [1, 8, 8], "class-names": [str(k) for k in range(10)], "modules": [MODULE.metadata()]}

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)


def rejected_only_as(expected: tuple[type[BaseException], ...], decode, *args, **kwargs):
    """decode(*args, **kwargs), or None when it raised one of `expected` (any other error fails the test);
    its traced memory stays bounded either way."""
    tracemalloc.start()
    try:
        return decode(*args, **kwargs)
    except expected:
        return None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < MEMORY_BOUND, f"{decode.__name__} held {peak} bytes"


def mutated(document, path: list, value):
    """A deep copy of `document` with the value at `path` (keys / indices, the last one created) replaced."""
    copy = json.loads(json.dumps(document))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


def paths(document, prefix=()):
    """Every key path into a JSON document."""
    yield list(prefix)
    children = document.items() if isinstance(document, dict) else enumerate(document) if isinstance(document, list) else ()
    for key, child in children:
        yield from paths(child, (*prefix, key))


UPLOAD_PATHS = [p for p in paths(UPLOAD) if p]
LIBRARY_PATHS = [p for p in paths(LIBRARY) if p]


# --- generator uploads ----------------------------------------------------------------------------------------


@FAST
@given(st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
@example("[" * 5000 + "]" * 5000)
@example('{"site-id": 1' + "0" * 5000 + "}")
@example('{"a": NaN, "b": Infinity}')
def test_any_manifest_text_decodes_or_is_rejected(text):
    content = RecordDict({"manifest": ConfigRecord({"json": text})})
    rejected_only_as((UploadRejected,), decode_manifest, content)


@FAST
@given(st.binary(max_size=2000))
@example(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
@example(b"\xff" * 8 + b"{")
def test_any_packed_payload_decodes_or_is_rejected(blob):
    record = ArrayRecord({"safetensors": Array(np.frombuffer(blob, dtype=np.uint8))})
    rejected_only_as((UploadRejected,), unpacked_weights, record, "generator 'x'", 4096)


@SLOW
@given(st.sampled_from(UPLOAD_PATHS), json_values)
@example(["modules", 0, "config", "seed"], 2**64)
@example(["modules", 0, "config", "model_channels"], 2**40)
@example(["modules", 0, "config", "num_blocks"], 10**6)
@example(["modules", 0, "image-counts"], [10**400])
@example(["modules", 0, "module-id"], "site1-class3\n")
@example(["modules", 0, "memorization"], float("nan"))
def test_any_change_to_an_honest_upload_is_rejected_or_changes_nothing_the_server_uses(path, value):
    manifest = mutated(UPLOAD, path, value)
    states = {MODULE.module_id: dict(STATE)}
    try:
        (module,) = validate_upload(manifest, states, site_id=1, plan=PLAN, image_shape=(1, 8, 8), max_memorization=0.5)
    except UploadRejected:
        return
    # Accepted: then everything the server uses is the plan's, whatever the site declared.
    assert (module.module_id, module.site_id, module.classes, module.image_counts, module.config) == (
        "site1-class3", 1, (3,), (20,), TINY
    )


@FAST
@given(st.integers() | st.text(max_size=5) | st.none() | st.floats())
def test_an_upload_claiming_any_other_site_is_refused(claimed):
    if claimed == 1 and type(claimed) is int:
        return
    manifest = mutated(UPLOAD, ["site-id"], claimed)
    with pytest.raises(UploadRejected, match="its node answered the survey as site 1"):
        validate_upload(manifest, {MODULE.module_id: dict(STATE)}, site_id=1, plan=PLAN, image_shape=(1, 8, 8))


@FAST
@given(st.dictionaries(st.integers(1, 50), st.fixed_dictionaries({"site-id": st.integers(0, 4) | json_scalars,
                                                                   "label-counts": st.lists(st.integers(-2, 40), min_size=9, max_size=11) | json_values})))  # fmt: skip
def test_survey_identities_are_distinct_and_every_claimant_of_a_shared_id_is_refused(survey):
    identities, refused = site_identities(survey, 10)
    site_ids = [i.site_id for i in identities.values()]
    assert len(site_ids) == len(set(site_ids))
    assert set(identities) | {int(r["node"]) for r in refused} == set(survey)
    claims = [s["site-id"] for s in survey.values() if type(s["site-id"]) is int]  # True == 1, but is no claim
    for node, identity in identities.items():
        assert claims.count(identity.site_id) == 1 and survey[node]["site-id"] == identity.site_id


@SLOW
@given(st.sampled_from(LIBRARY_PATHS), json_values)
@example(["num-classes"], "10")
@example(["image-shape"], "1x8x8")
@example(["modules", 0, "classes"], "3")
def test_any_change_to_a_relayed_library_is_rejected_or_keeps_it_valid(path, value):
    rejected_only_as((UploadRejected,), library_from_manifest, mutated(LIBRARY, path, value), {MODULE.module_id: dict(STATE)})


@FAST
@given(st.dictionaries(st.text(max_size=20), json_values, max_size=25))
@example({**TINY.to_dict(), "dropout": "0.1"})
@example({**TINY.to_dict(), "channel_mult": 3})
def test_any_generator_config_builds_or_is_a_value_error(data):
    rejected_only_as((ValueError,), GeneratorConfig.from_dict, data)


@FAST
@given(st.sampled_from(sorted(TINY.to_dict())), json_values)
def test_any_generator_config_field_value_builds_or_is_a_value_error(field, value):
    rejected_only_as((ValueError,), GeneratorConfig.from_dict, {**TINY.to_dict(), field: value})


# --- site folders -------------------------------------------------------------------------------------------------


@FAST
@given(st.binary(max_size=400) | st.text(max_size=200).map(lambda t: ("file,labels\n" + t).encode()))
@example("file,labels\na.png,²\n".encode())
@example("file,labels\na.png,٣\n".encode())
@example(b"file,labels\na.png,1\n\xe9")
def test_any_labels_csv_reads_or_is_a_site_folder_error(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("site")
    (folder / "images").mkdir()
    Image.new("L", (4, 4)).save(folder / "images" / "a.png")
    (folder / "labels.csv").write_bytes(data)
    read = rejected_only_as((SiteFolderError,), read_labelled_folder, folder, multilabel=False, num_classes=10)
    if read is not None:  # accepted: one image labelled with an id written in ASCII digits, in range
        (row,) = [r for r in data.decode("utf-8-sig").splitlines()[1:] if r.strip(", \t")]
        assert read.labels.tolist() == [int(row.split(",")[1])] and row.split(",")[1].strip().isascii()


@FAST
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=5),
    st.sampled_from([np.uint8, np.float32, np.float64, np.int64, np.bool_, np.complex64]),
    st.lists(st.integers(0, 5), min_size=0, max_size=3),
    st.sampled_from([np.int64, np.float32, np.uint8, np.bool_]),
)
@example([4, 8, 8, 5], np.uint8, [4, 1], np.int64)
def test_any_site_npz_reads_or_is_a_site_folder_error(tmp_path_factory, image_shape, image_dtype, label_shape, label_dtype):
    folder = tmp_path_factory.mktemp("npz")
    np.savez(folder / "site.npz", train_images=np.zeros(image_shape, image_dtype), train_labels=np.zeros(label_shape, label_dtype))
    read = rejected_only_as((SiteFolderError,), read_labelled_folder, folder, multilabel=False, num_classes=10)
    if read is not None:  # accepted: grey or colour images, one class id in range per image
        assert read.images.shape[1] in (1, 3) and len(read.images) == len(read.labels) > 0
        assert read.labels.min() >= 0 and read.labels.max() < 10


# --- resume checkpoints and unlearn inputs ---------------------------------------------------------------------------


@FAST
@given(st.binary(max_size=200), st.binary(max_size=600), st.binary(max_size=200))
@example(b'{"round": "abc"}', b"", b"")
def test_any_checkpoint_resumes_or_is_refused_with_a_value_error(tmp_path_factory, marker, weights, metrics):
    earlier, new = tmp_path_factory.mktemp("earlier"), tmp_path_factory.mktemp("new")
    (earlier / "checkpoint.json").write_bytes(marker)
    (earlier / "model.safetensors").write_bytes(weights)
    (earlier / "metrics.jsonl").write_bytes(metrics)
    recorder = RunRecorder(path=new, multilabel=False, method="fedavg")
    rejected_only_as((ValueError,), recorder.continue_from, earlier, torch.nn.Linear(3, 2).state_dict())


@FAST
@given(json_values | st.fixed_dictionaries({"classifier": st.just("small-cnn"), "experts": st.lists(json_values, max_size=3)}))
@example({"classifier": "small-cnn", "experts": [{"site-id": 0, "file": "../../../x.safetensors"}]})
def test_any_experts_manifest_loads_or_is_a_value_error(tmp_path_factory, manifest):
    run = tmp_path_factory.mktemp("run")
    (run / "experts").mkdir()
    (run / "experts" / "manifest.json").write_text(json.dumps(manifest))
    cfg = RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "iid", "factory.classifier": "small-cnn"})
    rejected_only_as((ValueError,), unlearn_module._load_experts, run, cfg, 10, (1, 8, 8))
