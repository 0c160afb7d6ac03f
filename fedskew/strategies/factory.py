"""FederatedFactory over Flower: one upload round (`train.factory`) and, for `factory-p2p`, one relay
round (`train.p2p`).

Round 1: every site trains and audits its generators and replies with one ArrayRecord per generator
(its weights packed into one array, see `packed_weights`) plus a JSON manifest of their metadata; the
server validates each upload (a bad one is rejected with its reason and the run goes on with the rest),
writes library/, samples a class-balanced synthetic set, trains the classifier on it and evaluates it
on the real test split. Every reply is bound to the node that sent it: its site id and label counts
come from that node's own survey reply (a site id claimed by two nodes is refused), and the modules it
may upload, their classes, image counts and configs follow from those and the run config, so a site
contributes only weights, checksums and its memorisation audit. Sizes are bounded before anything is
decoded: the manifest by characters and nesting, each payload by the run's model size.
Round 2 (P2P): Flower has no site-to-site channel, so the SuperLink relays the library to every site;
each site trains its own expert on real + synthetic images and returns it; the server evaluates the
Product of Experts and each expert alone.

Bytes are counted as Flower serialises each message (RecordingMixin), per site and direction.
"""

from __future__ import annotations

import json
import math
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

from fedskew.config import RunConfig
from fedskew.data.sites import SiteData
from fedskew.data.sources import ImageDataset
from fedskew.factory.classifier import ClassifierRecipe, ExpertEnsemble, run_classifier, check_expert_weights, train_classifier
from fedskew.factory.library import (
    GUIDES_DIR,
    SYNTHETIC_FILE,
    GeneratorModule,
    MAX_IMAGE_COUNT,
    Library,
    UploadRejected,
    check_uploader,
    class_balanced_set,
    library_from_manifest,
    save_class_grids,
    save_synthetic,
    validate_upload,
    withheld_modules,
    write_library,
)
from fedskew.factory.intensity import check_histograms, class_histograms, match_intensity
from fedskew.factory.site import (
    guide_config,
    guide_steps,
    planned_module,
    planned_modules,
    train_site_expert,
    train_site_generators,
    trained_guides,
    uploaded_modules,
)
from fedskew.factory.timing import Elapsed, timed
from fedskew.fidelity import record_fidelity
from fedskew.models.edm2 import build_generator
from fedskew.results import RunRecorder, write_json
from fedskew.strategies.recording import RecordingMixin
from fedskew.training import evaluate

FACTORY_MESSAGE = "train.factory"
P2P_MESSAGE = "train.p2p"
MANIFEST_KEY = "manifest"
GENERATOR_PREFIX = "generator."
# Autoguidance guides (factory.guide-steps) travel beside the generators, under their own keys.
GUIDE_MANIFEST_KEY = "guide-manifest"
GUIDE_PREFIX = "guide."
EXPERT_KEY = "expert"
INTENSITY_KEY = "intensity"
METRICS_KEY = "metrics"
LIBRARY_DIR = "library"
EXPERTS_DIR = "experts"
SAMPLES_DIR = "samples"
POE_MODEL = "model-poe.safetensors"


class TaskLike(Protocol):
    num_classes: int
    image_shape: tuple[int, int, int]
    class_names: tuple[str, ...]


# --- wire format (shared by sites and server) --------------------------------------------------------


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


def generator_payload_limit(cfg: RunConfig, image_shape: tuple[int, int, int], num_classes: int) -> int:
    """The most bytes one packed generator of this run takes: its architecture follows from the run config
    and the image shape alone, so the limit is known before any upload arrives."""
    classes = tuple(range(num_classes)) if cfg.factory.conditional else (0,)
    probe = planned_module(cfg, 0, classes, (1,) * len(classes), image_shape, num_classes)
    return packed_size_limit(build_generator(probe.config, "meta").state_dict())


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


def encode_modules(manifest: dict, modules: list[GeneratorModule], content: RecordDict | None = None,
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


def site_upload(cfg: RunConfig, site: SiteData, device: torch.device) -> RecordDict:
    """Round 1 at a site: train and audit its generators and upload those within factory.max-memorization
    (the manifest names the withheld ones and why); raises an UploadRefusal when none is left or a
    generator would exceed factory.max-epsilon."""
    modules, metrics = train_site_generators(cfg, site, device)
    modules, withheld = uploaded_modules(cfg, site, modules)
    guides = []
    if guide_steps(cfg):
        modules, guides, withheld, guide_metrics = trained_guides(cfg, site, modules, withheld, device)
        metrics.update(guide_metrics)
    shape = list(site.train_images.shape[1:])
    manifest = {"site-id": site.site_id, "image-shape": shape, "modules": [m.metadata() for m in modules], "withheld": withheld}
    content = encode_modules(manifest, modules)
    if guides:
        guide_manifest = {"site-id": site.site_id, "image-shape": shape, "modules": [g.metadata() for g in guides]}
        encode_modules(guide_manifest, guides, content, GUIDE_MANIFEST_KEY, GUIDE_PREFIX)
    content[METRICS_KEY] = MetricRecord({**metrics, "modules": len(modules), "withheld": len(withheld), "site-id": site.site_id})
    if cfg.factory.match_intensity:
        histograms = class_histograms(site.train_images, site.train_labels, site.num_classes)
        content[INTENSITY_KEY] = ArrayRecord({INTENSITY_KEY: Array(histograms)})
    return content


def uploaded_histograms(content: RecordDict, identity: SiteIdentity, image_shape: tuple[int, int, int]) -> np.ndarray:
    """The per-class pixel histograms a site sent with its generators (factory.match-intensity), checked
    against its survey; UploadRejected otherwise."""
    if INTENSITY_KEY not in content.array_records or list(content[INTENSITY_KEY]) != [INTENSITY_KEY]:
        raise UploadRejected(f"factory.match-intensity is on but the upload has no '{INTENSITY_KEY}' histogram array")
    array = content[INTENSITY_KEY][INTENSITY_KEY]
    if array.dtype not in ("float64", "float32") or len(array.shape) != 3:
        raise UploadRejected(f"the intensity histograms must be one 3-d float array, got {array.dtype} {array.shape}")
    histograms = array.numpy().astype(np.float64)
    try:
        check_histograms(histograms, identity.label_counts, image_shape)
    except ValueError as err:
        raise UploadRejected(str(err)) from None
    return histograms


def site_expert(cfg: RunConfig, site: SiteData, content: RecordDict, device: torch.device) -> RecordDict:
    """Round 2 at a site: check the relayed library like the server checked the uploads (every module's
    config must be the one the run config makes), train the expert."""
    image_shape = tuple(site.train_images.shape[1:])
    manifest, states = decode_modules(content, generator_payload_limit(cfg, image_shape, site.num_classes))
    library = library_from_manifest(
        manifest, states,
        lambda site_id, classes, counts: planned_module(cfg, site_id, classes, counts, image_shape, site.num_classes),
    )  # fmt: skip
    if library.num_classes != site.num_classes or library.image_shape != image_shape:
        raise UploadRejected(
            f"the relayed library is for {library.num_classes} classes of {library.image_shape} images; "
            f"this site has {site.num_classes} classes of {image_shape}"
        )
    state, metrics = train_site_expert(cfg, site, library, device)
    return RecordDict({EXPERT_KEY: packed_weights(state), METRICS_KEY: MetricRecord({**metrics, "site-id": site.site_id})})


# --- the server's side ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SiteIdentity:
    """Who a node is, from its own survey reply: everything the server binds its uploads to."""

    node: int
    site_id: int
    label_counts: tuple[int, ...]


def site_identities(survey: dict[int, dict], num_classes: int) -> tuple[dict[int, SiteIdentity], list[dict]]:
    """Each node's site id and training label counts from its survey reply, and the refused nodes: a
    malformed reply, or a site-id that several nodes claim (the server cannot tell which one is the
    site, so none of them is trusted with it)."""
    identities, refused = {}, []
    claimants: dict[int, list[int]] = {}
    for node, reply in sorted(survey.items()):
        site_id, counts = reply.get("site-id"), reply.get("label-counts")
        if not isinstance(site_id, int) or isinstance(site_id, bool) or not 0 <= site_id < 2**31:
            refused.append({"node": str(node), "reason": f"survey site-id must be an int in 0..{2**31 - 1}, got {site_id!r}"})
            continue
        # A claim counts even from a reply refused for its counts: a shared id is never trusted to anyone.
        claimants.setdefault(site_id, []).append(node)
        if not (isinstance(counts, list) and len(counts) == num_classes
                  and all(isinstance(n, int) and 0 <= n <= MAX_IMAGE_COUNT for n in counts)):  # fmt: skip
            refused.append(
                {"node": str(node), "reason": f"survey label-counts must be {num_classes} ints in 0..{MAX_IMAGE_COUNT}, "
                 f"got {str(counts)[:200]}"}
            )  # fmt: skip
        else:
            identities[node] = SiteIdentity(node, site_id, tuple(counts))
    for site_id, nodes in claimants.items():
        if len(nodes) > 1:
            for node in (n for n in nodes if n in identities):
                del identities[node]
                refused.append(
                    {"node": str(node), "site-id": site_id, "reason": f"nodes {nodes} all claim site-id {site_id}; "
                     "each site needs its own (node config site-id), so none of them is trusted with it"}
                )  # fmt: skip
    return identities, refused


@dataclass
class Expert:
    node: int
    site_id: int
    model: torch.nn.Module
    metrics: dict


# Metrics of an expert the server reads (the P2P round's mean training loss and validation accuracy).
EXPERT_METRICS = ("train_loss", "val_accuracy")


class FactoryFlow(RecordingMixin):
    """Sends one custom message per site and collects the replies, counting bytes and dropouts. A reply
    the server cannot accept is rejected with its reason and the run goes on with the others."""

    def __init__(self, grid: Grid, recorder: RunRecorder, timeout: float, floor: int = 1):
        """`timeout` bounds each exchange (run-config round-timeout); fewer than `floor` sites with an accepted
        reply (min-available-sites) end the run."""
        self.grid, self.timeout, self.min_available_nodes = grid, timeout, floor
        # The accepted sites' per-class real pixel histograms, summed (factory.match-intensity; else None).
        self.real_histograms: np.ndarray | None = None
        # The accepted sites' autoguidance guides (factory.guide-steps; else None).
        self.guides: Library | None = None
        self.attach(recorder)

    def exchange(self, server_round: int, messages: list[Message]) -> list[Message]:
        replies = self.grid.send_and_receive(self._count_out(messages), timeout=self.timeout)
        replies = self._count_in(server_round, replies)
        self._record_missing(server_round, "reply")
        for reply in replies:
            if reply.has_error():
                print(f"site {reply.metadata.src_node_id} sent no result: {reply.error.reason}", flush=True)
        return [r for r in replies if not r.has_error()]

    def checked_replies(self, server_round: int, messages: list[Message], identities: dict[int, SiteIdentity], what: str, check):
        """(identity, reply, check(identity, reply)) for every reply that passes `check`, and the rejections.
        `check` raises UploadRejected for a bad reply; any other error is a server bug: its traceback is
        printed and the reply rejected with that error, so one site never costs the run. Fewer accepted replies
        than the floor (min-available-sites) end the run with TooFewSites naming each rejection."""
        accepted, rejected, refusals = [], [], []
        for reply in self.exchange(server_round, messages):
            node = reply.metadata.src_node_id
            identity = identities.get(node)
            try:
                if identity is None:
                    raise UploadRejected(f"node {node} was not asked for a reply")
                result = check(identity, reply)
            except UploadRejected as err:
                reason = str(err)
            except Exception as err:  # noqa: BLE001 - see the docstring
                traceback.print_exc()
                reason = f"the server failed while checking it ({type(err).__name__}: {err}); please report this fedskew bug"
            else:
                accepted.append((identity, reply, result))
                continue
            site = f"site {identity.site_id} (node {node})" if identity else f"node {node}"
            print(f"rejected the {what} of {site}: {reason}", flush=True)
            rejected.append({"node": str(node), **({"site-id": identity.site_id} if identity else {}), "reason": reason})
            refusals.append(f"{site}: {what} rejected: {reason}")
        self.require_floor(server_round, len(accepted), what, refusals)
        return accepted, rejected

    def collect_library(self, survey: dict[int, dict], task: TaskLike, cfg: RunConfig) -> tuple[Library, list[dict]]:
        """Round 1 to every site with a valid survey identity; returns the library of every upload that
        passed validation and the rejections (refused identities included)."""
        identities, refused = site_identities(survey, task.num_classes)
        image_shape = tuple(task.image_shape)
        max_bytes = generator_payload_limit(cfg, image_shape, task.num_classes)
        guided = guide_config(cfg)
        guide_max_bytes = generator_payload_limit(guided, image_shape, task.num_classes) if guided else 0

        def check_guides(identity: SiteIdentity, reply: Message, modules: list[GeneratorModule]) -> list[GeneratorModule]:
            """The guides of factory.guide-steps: exactly one for each generator accepted, as the plan makes it."""
            accepted = {m.module_id for m in modules}
            plan = [p for p in planned_modules(guided, identity.site_id, list(identity.label_counts), image_shape) if p.module_id in accepted]
            manifest = decode_manifest(reply.content, GUIDE_MANIFEST_KEY, GUIDE_PREFIX)
            check_uploader(manifest, identity.site_id)
            states = decode_states(reply.content, guide_max_bytes, [p.module_id for p in plan], GUIDE_PREFIX)
            return validate_upload(manifest, states, site_id=identity.site_id, plan=plan, image_shape=image_shape,
                                   max_memorization=cfg.factory.max_memorization)  # fmt: skip

        def check(identity: SiteIdentity, reply: Message) -> list[GeneratorModule]:
            plan = planned_modules(cfg, identity.site_id, list(identity.label_counts), image_shape)
            manifest = decode_manifest(reply.content)
            check_uploader(manifest, identity.site_id)  # an impostor is named as one before its weights are read
            withheld = withheld_modules(manifest, plan)
            withheld_ids = {w["module-id"] for w in withheld}
            states = decode_states(reply.content, max_bytes, [p.module_id for p in plan if p.module_id not in withheld_ids])
            histograms = uploaded_histograms(reply.content, identity, image_shape) if cfg.factory.match_intensity else None
            modules = validate_upload(
                manifest, states, site_id=identity.site_id, plan=plan, image_shape=image_shape,
                max_memorization=cfg.factory.max_memorization, max_epsilon=cfg.factory.max_epsilon,
            )  # fmt: skip
            guides = check_guides(identity, reply, modules) if guided else []
            for entry in withheld:
                print(f"site {identity.site_id} withheld {entry['module-id']}: {entry['reason']}", flush=True)
            return modules, guides, histograms, [{"site-id": identity.site_id, **w} for w in withheld]

        messages = [
            Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=node, message_type=FACTORY_MESSAGE)
            for node in identities
        ]
        accepted, rejected = self.checked_replies(1, messages, identities, "upload", check)
        modules = [m for _, _, (checked, _, _, _) in accepted for m in checked]
        histograms = [h for _, _, (_, _, h, _) in accepted if h is not None]
        self.recorder.extra.setdefault("factory", {})["withheld"] = [w for _, _, (_, _, _, site_withheld) in accepted for w in site_withheld]
        self.real_histograms = sum(histograms) if histograms else None
        guides = sorted((g for _, _, (_, site_guides, _, _) in accepted for g in site_guides), key=lambda g: (g.site_id, g.classes))
        self.guides = Library(tuple(guides), task.num_classes, image_shape, tuple(task.class_names)) if guided else None
        site_metrics = [
            {"node": str(identity.node), **reported_metrics(reply), "site-id": identity.site_id} for identity, reply, _ in accepted
        ]
        self.recorder.extra.setdefault("factory", {})["site_metrics"] = site_metrics
        modules.sort(key=lambda m: (m.site_id, m.classes))
        library = Library(tuple(modules), task.num_classes, image_shape, tuple(task.class_names))
        return library, refused + rejected

    def collect_experts(self, survey: dict[int, dict], library: Library, cfg: RunConfig, task: TaskLike) -> tuple[list[Expert], list[dict]]:
        """Round 2: relay the library to every identified site, collect and check their experts."""
        identities, _ = site_identities(survey, task.num_classes)  # the refused ones are reported in round 1
        reference = run_classifier(cfg, tuple(task.image_shape), task.num_classes).state_dict()
        max_bytes = packed_size_limit(reference)

        def check(identity: SiteIdentity, reply: Message) -> Expert:
            if EXPERT_KEY not in reply.content.array_records:
                raise UploadRejected("the reply has no expert weights")
            state = unpacked_weights(reply.content[EXPERT_KEY], "the expert", max_bytes)
            check_expert_weights(state, reference)
            metrics = reported_metrics(reply)
            unusable = [k for k in EXPERT_METRICS if not isinstance(metrics.get(k), (int, float)) or not math.isfinite(metrics[k])]
            if unusable:
                raise UploadRejected(f"the expert's metrics {unusable} are missing or not finite numbers")
            model = run_classifier(cfg, tuple(task.image_shape), task.num_classes)
            model.load_state_dict(state)
            return Expert(identity.node, identity.site_id, model.eval(), {**metrics, "site-id": identity.site_id})

        manifest = library.manifest()
        # One RecordDict per message (Flower would otherwise share one object), all with the same records.
        messages = [
            Message(encode_modules(manifest, list(library.modules)), dst_node_id=node, message_type=P2P_MESSAGE)
            for node in identities
        ]
        accepted, rejected = self.checked_replies(2, messages, identities, "expert", check)
        return sorted((expert for _, _, expert in accepted), key=lambda e: e.site_id), rejected


def reported_metrics(reply: Message) -> dict:
    """The metrics a site sent along (untrusted: recorded, never used to identify it)."""
    return dict(reply.content[METRICS_KEY]) if METRICS_KEY in reply.content.metric_records else {}


def test_metrics(model: torch.nn.Module, test: ImageDataset | None, device: torch.device) -> dict:
    """Metrics on the server's real test split ({} when the server holds none)."""
    return evaluate(model, test.test_images, test.test_labels, device=device) if test is not None else {}


def train_library_classifier(
    cfg: RunConfig, library: Library, device: torch.device, run_dir: Path, checkpoints: dict | None = None,
    real_histograms: np.ndarray | None = None, guides: Library | None = None,
) -> tuple[torch.nn.Module, dict]:
    """Synthesise the class-balanced set (autoguided by `guides` when given; its pixels matched to
    `real_histograms` when given; stored, with its plan), write the sample grids, train the classifier
    (`checkpoints`: see train_classifier)."""
    synthesis, training = Elapsed(), Elapsed()
    with timed(synthesis):
        synthetic = class_balanced_set(library, cfg.factory, cfg.seed, device, guides, cfg.factory.guidance_weight)
        if real_histograms is not None:
            synthetic = replace(synthetic, images=match_intensity(synthetic.images, synthetic.labels, real_histograms))
    save_synthetic(synthetic, run_dir / SYNTHETIC_FILE)
    save_class_grids(synthetic, run_dir / SAMPLES_DIR)
    with timed(training):
        model, stats = train_classifier(
            synthetic.images, synthetic.labels, library.num_classes, ClassifierRecipe.from_config(cfg),
            val_fraction=cfg.factory.classifier_val_fraction, seed=cfg.seed, device=device, checkpoints=checkpoints,
        )  # fmt: skip
    stats.update(
        **synthesis.as_metrics("synthesis"),
        **training.as_metrics("classifier"),
        synthetic_images=len(synthetic.labels),
        synthetic_per_class=np.bincount(synthetic.labels, minlength=library.num_classes).tolist(),
        intensity_matched=real_histograms is not None,
    )
    return model, stats


def save_experts(experts: list[Expert], cfg: RunConfig, task: TaskLike, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=False)
    entries = []
    for expert in experts:
        name = f"site-{expert.site_id}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in expert.model.state_dict().items()}, str(directory / name))
        entries.append({"site-id": expert.site_id, "node": str(expert.node), "file": name})
    write_json(
        directory / "manifest.json",
        {"classifier": cfg.factory.classifier, "num-classes": task.num_classes, "image-shape": list(task.image_shape),
         "experts": entries},
    )  # fmt: skip


def generators_privacy(library: Library, cfg: RunConfig) -> dict:
    """The run's DP guarantee from its DP-SGD generators: each image is in exactly one generator, so
    every upload, and the library, is (largest epsilon, largest delta)-DP for one training image. What
    else the run released from the sites' real images is listed beside it: the guarantee does not cover it."""
    guarantees = [m.privacy for m in library.modules]
    return {
        "mode": "dp-sgd-generators",
        "epsilon": max(g["epsilon"] for g in guarantees),
        "delta": max(g["delta"] for g in guarantees),
        "generators": len(guarantees),
        "accountant": guarantees[0]["accountant"],
        "unit": guarantees[0]["unit"],
        "not_covered": releases_outside_the_guarantee(cfg),
    }


def releases_outside_the_guarantee(cfg: RunConfig) -> list[str]:
    """What a run of `cfg` sends from the sites' real images besides the DP generators."""
    released = ["the survey's image counts per class", "each generator's memorization share (its manifest entry)"]
    if cfg.method == "factory-p2p":
        released.append("each site's expert classifier, trained on its real images without DP")
    if cfg.factory.site_validation:
        released.append("each site's per-class sums of the server's classifier on its real validation images")
    if cfg.factory.match_intensity:
        released.append("each site's pixel histograms per class")
    return released


def run_factory(
    grid: Grid,
    cfg: RunConfig,
    survey: dict[int, dict],
    task: TaskLike,
    test: ImageDataset | None,
    recorder: RunRecorder,
    device: torch.device,
) -> None:
    """method factory (round 1) or factory-p2p (rounds 1 and 2); results go to recorder.path."""
    flow = FactoryFlow(grid, recorder, cfg.round_timeout, floor=min(cfg.min_available_sites, len(survey)))
    recorder.selected_within = (
        "factory.classifier-val-fraction: the classifier's epoch is chosen on held-out synthetic images"
        if cfg.method == "factory"
        else "factory.p2p-val-fraction: the Product of Experts, each expert's epoch chosen on a held-out share of its "
        "site's real + synthetic images"
    )
    library, rejected = flow.collect_library(survey, task, cfg)
    write_library(library, recorder.path / LIBRARY_DIR)
    if flow.guides is not None:
        write_library(flow.guides, recorder.path / LIBRARY_DIR / GUIDES_DIR)
    missing = library.missing_classes()
    report = recorder.extra.setdefault("factory", {})
    report.update(
        modules=[{k: v for k, v in m.metadata().items() if k != "config"} for m in library.modules],
        rejected=rejected,
        missing_classes=missing,
        missing_class_names=[task.class_names[c] for c in missing],
    )
    if any(m.privacy is not None for m in library.modules):
        recorder.extra["privacy"] = generators_privacy(library, cfg)
    if missing:
        print(f"classes without a generator (not learnable this run): {[task.class_names[c] for c in missing]}", flush=True)
    if not library.modules:
        raise RuntimeError("no generator upload passed validation; see 'rejected' and 'dropped' in summary.json")

    checkpoints = {} if cfg.factory.site_validation else None
    model, stats = train_library_classifier(cfg, library, device, recorder.path, checkpoints, flow.real_histograms, flow.guides)
    if checkpoints is not None:
        # Imported here: the validation transport builds on this module's wire format.
        from fedskew.strategies.factory_validation import validate_at_sites

        model, report["site_validation"] = validate_at_sites(flow, survey, model, checkpoints, cfg, task)
    if cfg.factory.fidelity:
        record_fidelity(cfg, recorder, device)
    server_metrics = test_metrics(model, test, device)
    report["classifier"] = {k: v for k, v in stats.items()}
    report["server_test"] = server_metrics
    recorder.record_round(1, server_metrics, train=stats, val={"val_accuracy": stats["val_accuracy"]})
    recorder.save_checkpoint(model.state_dict())
    if cfg.method != "factory-p2p":
        return

    experts, expert_rejected = flow.collect_experts(survey, library, cfg, task)
    if not experts:
        raise RuntimeError("no site returned a valid expert in the P2P round; see 'dropped' in summary.json")
    save_experts(experts, cfg, task, recorder.path / EXPERTS_DIR)
    poe = test_metrics(ExpertEnsemble([e.model for e in experts]), test, device)
    recorder.extra["p2p"] = {
        "poe_test": poe,
        "rejected": expert_rejected,
        "experts": [
            {"site-id": e.site_id, "node": str(e.node), "train": e.metrics, "test": test_metrics(e.model, test, device)}
            for e in experts
        ],
    }
    mean = {k: float(np.mean([e.metrics[k] for e in experts])) for k in ("train_loss", "val_accuracy")}
    recorder.record_round(2, poe, train=mean)
    # The Product of Experts as one self-contained model file (model.safetensors stays the server's classifier).
    if recorder.model_card is not None:
        recorder.model_card = replace(recorder.model_card, experts=len(experts))
    recorder.save_checkpoint(ExpertEnsemble([e.model for e in experts]).state_dict(), name=POE_MODEL)
