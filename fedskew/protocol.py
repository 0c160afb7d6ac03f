"""The wire format shared by the ServerApp and the sites' ClientApp: message types, record keys, and how
weights and module metadata are packed into Flower records and checked on the way out. Both sides import
it; it imports nothing else of fedskew, so neither side reaches into the other's code for a key."""

from __future__ import annotations

import json
from typing import Protocol

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

# --- message types: Flower routes "<type>.<name>" to the ClientApp handler registered as @app.<type>(name) ---

SURVEY_QUERY = "query.site_survey"
GRADIENT_QUERY = "query.fednca_gradient"  # FedNCA-ML's control variates: each site's mean gradient
FACTORY_MESSAGE = "train.factory"
P2P_MESSAGE = "train.p2p"
VALIDATION_MESSAGE = "query.factory_validation"


def handler_name(message_type: str) -> str:
    """The name a ClientApp handler of `message_type` is registered under (`train.factory` -> `factory`)."""
    return message_type.partition(".")[2]


# --- record keys --------------------------------------------------------------------------------------------

EXAMPLES_KEY = "num-examples"
UNIT_WEIGHT_KEY = "unit-weight"  # reported as 1 with every reply: the weight of an unweighted average
VAL_COUNTS_KEY = "val-threshold-counts"
SINGLE_LABEL_VAL_KEYS = ("val_accuracy", "val_balanced_accuracy")
ETF_KEY = "etf"
ETF_ECHO_KEY = "etf-crc32"  # the training metric that names the ETF a site trained against
CONTROL_SHIFT_KEY = "control-shift"  # a site's c - c_i, sent with its training message
SCAFFOLD_CONTROL_KEY = "scaffold-control"
# FederatedFactory
MANIFEST_KEY = "manifest"
GENERATOR_PREFIX = "generator."
# Autoguidance guides (factory.guide-steps) travel beside the generators, under their own keys.
GUIDE_MANIFEST_KEY = "guide-manifest"
GUIDE_PREFIX = "guide."
EXPERT_KEY = "expert"
INTENSITY_KEY = "intensity"
METRICS_KEY = "metrics"
CLASSIFIER_KEY = "classifier"
SCORES_KEY = "scores"


class UploadRejected(ValueError):
    """An upload (or relayed library) that fails validation; the message says which module and why."""


class PackedModule(Protocol):
    """What `encode_modules` sends of a generator (fedskew.factory.library.GeneratorModule)."""

    module_id: str
    state: dict[str, torch.Tensor]


# --- packing ----------------------------------------------------------------------------------------------------


PACKED_KEY = "safetensors"
# A packed payload is its tensors' bytes plus a JSON header of ~100 bytes per tensor: 1 MiB is ample.
HEADER_ALLOWANCE = 1 << 20
# The module metadata nests 6 deep (manifest, modules, module, config, its lists, their numbers).
MANIFEST_DEPTH = 8
# One module's metadata is under 1 KB of JSON.
MANIFEST_CHARS_PER_MODULE = 16_384


def packed_weights(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A model's weights as one array (its safetensors bytes). Flower moves every array as its own object,
    one request each, and a SuperLink keeping its state in SQLite serialises those writes: three sites
    uploading four ~90-tensor generators at once made it fail with 'database is locked'."""
    blob = save_safetensors({name: tensor.detach().cpu().contiguous() for name, tensor in state.items()})
    return ArrayRecord({PACKED_KEY: Array(np.frombuffer(blob, dtype=np.uint8))})


def packed_size_limit(reference: dict[str, torch.Tensor]) -> int:
    """The most bytes the packed weights of a model shaped like `reference` (any device, meta too) take."""
    return sum(t.numel() * t.element_size() for t in reference.values()) + HEADER_ALLOWANCE


def unpacked_weights(record: ArrayRecord, what: str, max_bytes: int) -> dict[str, torch.Tensor]:
    """The weights `packed_weights` packed; UploadRejected (naming `what`) when the record is not that or
    is larger than `max_bytes` (checked before anything is copied or parsed)."""
    if list(record) != [PACKED_KEY]:
        raise UploadRejected(f"{what}: expected one array '{PACKED_KEY}' (the packed weights), got {sorted(record)[:5]}")
    array = record[PACKED_KEY]
    if array.dtype != "uint8" or len(array.shape) != 1:
        raise UploadRejected(f"{what}: the packed weights must be one uint8 vector, got {array.dtype} {array.shape}")
    if len(array.data) > max_bytes:
        raise UploadRejected(f"{what}: the packed weights take {len(array.data)} bytes; this run's model takes at most {max_bytes}")
    try:
        return load_safetensors(array.numpy().tobytes())
    except Exception as err:  # noqa: BLE001 - numpy and safetensors document no closed set of parse errors
        raise UploadRejected(f"{what}: the packed weights are not a readable safetensors payload ({err})") from None


def json_depth(value) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 1), without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        node, depth = pending.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        pending.extend((child, depth + 1) for child in children)
    return deepest


def parse_manifest(text, max_chars: int) -> dict:
    """The module metadata JSON, its size and nesting bounded; UploadRejected says what is wrong."""
    if not isinstance(text, str) or len(text) > max_chars:
        size = len(text) if isinstance(text, str) else type(text).__name__
        raise UploadRejected(f"the module metadata must be a JSON string of at most {max_chars} characters, got {size}")
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as err:  # ValueError: bad JSON, or an integer of over 4300 digits
        raise UploadRejected(f"the module metadata is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(manifest, dict) or json_depth(manifest) > MANIFEST_DEPTH:
        raise UploadRejected(f"the module metadata must be a JSON object nested at most {MANIFEST_DEPTH} deep")
    return manifest


def encode_modules(manifest: dict, modules: list[PackedModule], content: RecordDict | None = None,
                   key: str = MANIFEST_KEY, prefix: str = GENERATOR_PREFIX) -> RecordDict:
    """The manifest as JSON in a ConfigRecord and one ArrayRecord per generator (added to `content` under
    `key` and `prefix`: the guides' are GUIDE_MANIFEST_KEY and GUIDE_PREFIX)."""
    content = RecordDict() if content is None else content
    content[key] = ConfigRecord({"json": json.dumps(manifest)})
    for module in modules:
        content[prefix + module.module_id] = packed_weights(module.state)
    return content


def _generator_ids(content: RecordDict, prefix: str = GENERATOR_PREFIX) -> list[str]:
    return [key.removeprefix(prefix) for key in content.array_records if key.startswith(prefix)]


def decode_manifest(content: RecordDict, key: str = MANIFEST_KEY, prefix: str = GENERATOR_PREFIX) -> dict:
    """The module metadata of a message (at most MANIFEST_CHARS_PER_MODULE per generator it carries)."""
    if key not in content.config_records or "json" not in content[key]:
        raise UploadRejected(f"the message has no '{key}' record with the module metadata")
    return parse_manifest(content[key]["json"], MANIFEST_CHARS_PER_MODULE * (len(_generator_ids(content, prefix)) + 1))


def decode_states(content: RecordDict, max_bytes: int, expected_ids: list[str] | None = None,
                  prefix: str = GENERATOR_PREFIX) -> dict[str, dict[str, torch.Tensor]]:
    """Module id -> weights, each generator at most `max_bytes` packed and, given `expected_ids`, exactly
    those modules (checked before any is decoded); UploadRejected otherwise."""
    module_ids = _generator_ids(content, prefix)
    guides = prefix == GUIDE_PREFIX
    if expected_ids is not None and sorted(module_ids) != sorted(expected_ids):
        shown = sorted(module_ids)[:10]
        raise UploadRejected(f"weights came for {'guides' if guides else 'modules'} {shown}{' ...' if len(module_ids) > 10 else ''}; "
                             f"expected {sorted(expected_ids)}")  # fmt: skip
    return {m: unpacked_weights(content[prefix + m], f"{'guide' if guides else 'generator'} {m[:80]!r}", max_bytes) for m in module_ids}


def decode_modules(content: RecordDict, max_bytes: int) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(manifest, module id -> weights) of a message `encode_modules` made; UploadRejected otherwise."""
    return decode_manifest(content), decode_states(content, max_bytes)
