"""FederatedFactory over Flower: one upload round (`train.factory`) and, for `factory-p2p`, one relay
round (`train.p2p`).

Round 1: every site trains and audits its generators and replies with one ArrayRecord per generator
(its weights packed into one array, see `packed_weights`) plus a JSON manifest of their metadata; the
server validates each upload (a bad one is rejected with its reason and the run goes on with the rest),
writes library/, samples a class-balanced synthetic set, trains the classifier on it and evaluates it
on the real test split.
Round 2 (P2P): Flower has no site-to-site channel, so the SuperLink relays the library to every site;
each site trains its own expert on real + synthetic images and returns it; the server evaluates the
Product of Experts and each expert alone.

Bytes are counted as Flower serialises each message (RecordingMixin), per site and direction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

from fedskew.config import RunConfig
from fedskew.data.sites import SiteData
from fedskew.data.sources import ImageDataset
from fedskew.factory.classifier import ClassifierRecipe, ExpertEnsemble, build_classifier, check_expert_weights, train_classifier
from fedskew.factory.library import (
    SYNTHETIC_FILE,
    GeneratorModule,
    Library,
    UploadRejected,
    class_balanced_set,
    library_from_manifest,
    save_class_grids,
    save_synthetic,
    validate_upload,
    write_library,
)
from fedskew.factory.site import train_site_expert, train_site_generators
from fedskew.factory.timing import Elapsed, timed
from fedskew.results import RunRecorder, write_json
from fedskew.strategies.recording import RecordingMixin
from fedskew.training import evaluate

FACTORY_MESSAGE = "train.factory"
P2P_MESSAGE = "train.p2p"
MANIFEST_KEY = "manifest"
GENERATOR_PREFIX = "generator."
EXPERT_KEY = "expert"
METRICS_KEY = "metrics"
LIBRARY_DIR = "library"
EXPERTS_DIR = "experts"
SAMPLES_DIR = "samples"


class TaskLike(Protocol):
    num_classes: int
    image_shape: tuple[int, int, int]
    class_names: tuple[str, ...]


# --- wire format (shared by sites and server) --------------------------------------------------------


PACKED_KEY = "safetensors"


def packed_weights(state: dict[str, torch.Tensor]) -> ArrayRecord:
    """A model's weights as one array (its safetensors bytes). Flower moves every array as its own object,
    one request each, and a SuperLink keeping its state in SQLite serialises those writes: three sites
    uploading four ~90-tensor generators at once made it fail with 'database is locked'."""
    blob = save_safetensors({name: tensor.detach().cpu().contiguous() for name, tensor in state.items()})
    return ArrayRecord({PACKED_KEY: Array(np.frombuffer(blob, dtype=np.uint8))})


def unpacked_weights(record: ArrayRecord, what: str) -> dict[str, torch.Tensor]:
    """The weights `packed_weights` packed; UploadRejected (naming `what`) when the record is not that."""
    if list(record) != [PACKED_KEY]:
        raise UploadRejected(f"{what}: expected one array '{PACKED_KEY}' (the packed weights), got {sorted(record)}")
    try:
        return load_safetensors(record[PACKED_KEY].numpy().tobytes())
    except (SafetensorError, ValueError) as err:
        raise UploadRejected(f"{what}: the packed weights are not a readable safetensors payload ({err})") from None


def encode_modules(manifest: dict, modules: list[GeneratorModule]) -> RecordDict:
    """The manifest as JSON in a ConfigRecord and one ArrayRecord per generator."""
    content = RecordDict({MANIFEST_KEY: ConfigRecord({"json": json.dumps(manifest)})})
    for module in modules:
        content[GENERATOR_PREFIX + module.module_id] = packed_weights(module.state)
    return content


def decode_modules(content: RecordDict) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """(manifest, module id -> weights); UploadRejected when the message is not in that form."""
    if MANIFEST_KEY not in content.config_records or "json" not in content[MANIFEST_KEY]:
        raise UploadRejected(f"the message has no '{MANIFEST_KEY}' record with the module metadata")
    try:
        manifest = json.loads(str(content[MANIFEST_KEY]["json"]))
    except json.JSONDecodeError as err:
        raise UploadRejected(f"the module metadata is not valid JSON: {err}") from None
    module_ids = [key.removeprefix(GENERATOR_PREFIX) for key in content.array_records if key.startswith(GENERATOR_PREFIX)]
    states = {m: unpacked_weights(content[GENERATOR_PREFIX + m], f"generator {m!r}") for m in module_ids}
    return manifest, states


def site_upload(cfg: RunConfig, site: SiteData, device: torch.device) -> RecordDict:
    """Round 1 at a site: train and audit its generators; raises MemorizationRefusal instead of uploading
    a generator above factory.max-memorization."""
    modules, metrics = train_site_generators(cfg, site, device)
    manifest = {"site-id": site.site_id, "image-shape": list(site.train_images.shape[1:]), "modules": [m.metadata() for m in modules]}
    content = encode_modules(manifest, modules)
    content[METRICS_KEY] = MetricRecord({**metrics, "site-id": site.site_id})
    return content


def site_expert(cfg: RunConfig, site: SiteData, content: RecordDict, device: torch.device) -> RecordDict:
    """Round 2 at a site: check the relayed library like the server checked the uploads, train the expert."""
    manifest, states = decode_modules(content)
    library = library_from_manifest(manifest, states)
    if library.num_classes != site.num_classes or library.image_shape != tuple(site.train_images.shape[1:]):
        raise UploadRejected(
            f"the relayed library is for {library.num_classes} classes of {library.image_shape} images; "
            f"this site has {site.num_classes} classes of {tuple(site.train_images.shape[1:])}"
        )
    state, metrics = train_site_expert(cfg, site, library, device)
    return RecordDict({EXPERT_KEY: packed_weights(state), METRICS_KEY: MetricRecord({**metrics, "site-id": site.site_id})})


# --- the server's side ----------------------------------------------------------------------------------


@dataclass
class Expert:
    node: int
    site_id: int
    model: torch.nn.Module
    metrics: dict


class FactoryFlow(RecordingMixin):
    """Sends one custom message per site and collects the replies, counting bytes and dropouts."""

    def __init__(self, grid: Grid, recorder: RunRecorder, timeout: float):
        self.grid, self.timeout = grid, timeout
        self.attach(recorder)

    def exchange(self, server_round: int, messages: list[Message]) -> list[Message]:
        replies = self.grid.send_and_receive(self._count_out(messages), timeout=self.timeout)
        replies = self._count_in(server_round, replies)
        for reply in replies:
            if reply.has_error():
                print(f"site {reply.metadata.src_node_id} sent no result: {reply.error.reason}", flush=True)
        return [r for r in replies if not r.has_error()]

    def collect_library(self, node_ids: list[int], task: TaskLike, cfg: RunConfig) -> tuple[Library, list[dict]]:
        """Round 1; returns the library of every upload that passed validation and the rejections."""
        messages = [
            Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=node, message_type=FACTORY_MESSAGE)
            for node in node_ids
        ]
        modules, rejected, site_metrics = [], [], []
        for reply in self.exchange(1, messages):
            node = reply.metadata.src_node_id
            try:
                manifest, states = decode_modules(reply.content)
                accepted = validate_upload(
                    manifest, states, num_classes=task.num_classes, image_shape=tuple(task.image_shape),
                    max_memorization=cfg.factory.max_memorization,
                )  # fmt: skip
            except UploadRejected as err:
                print(f"rejected the upload of site node {node}: {err}", flush=True)
                rejected.append({"node": str(node), "reason": str(err)})
                continue
            modules.extend(accepted)
            reported = dict(reply.content[METRICS_KEY]) if METRICS_KEY in reply.content.metric_records else {}
            site_metrics.append({"node": str(node), **reported})
        self.recorder.extra.setdefault("factory", {})["site_metrics"] = site_metrics
        modules.sort(key=lambda m: (m.site_id, m.classes))
        return Library(tuple(modules), task.num_classes, tuple(task.image_shape), tuple(task.class_names)), rejected

    def collect_experts(self, node_ids: list[int], library: Library, cfg: RunConfig, task: TaskLike) -> tuple[list[Expert], list[dict]]:
        """Round 2: relay the library to every site, collect and check their experts."""
        reference = build_classifier(cfg.factory.classifier, tuple(task.image_shape), task.num_classes).state_dict()
        manifest = library.manifest()
        # One RecordDict per message (Flower would otherwise share one object), all with the same records.
        messages = [
            Message(encode_modules(manifest, list(library.modules)), dst_node_id=node, message_type=P2P_MESSAGE)
            for node in node_ids
        ]
        experts, rejected = [], []
        for reply in self.exchange(2, messages):
            node = reply.metadata.src_node_id
            metrics = dict(reply.content[METRICS_KEY]) if METRICS_KEY in reply.content.metric_records else {}
            try:
                if EXPERT_KEY not in reply.content.array_records:
                    raise UploadRejected("the reply has no expert weights")
                state = unpacked_weights(reply.content[EXPERT_KEY], "the expert")
                check_expert_weights(state, reference)
            except UploadRejected as err:
                print(f"rejected the expert of site node {node}: {err}", flush=True)
                rejected.append({"node": str(node), "reason": str(err)})
                continue
            model = build_classifier(cfg.factory.classifier, tuple(task.image_shape), task.num_classes)
            model.load_state_dict(state)
            experts.append(Expert(node, int(metrics.get("site-id", -1)), model.eval(), metrics))
        experts.sort(key=lambda e: e.site_id)
        return experts, rejected


def test_metrics(model: torch.nn.Module, test: ImageDataset | None, device: torch.device) -> dict:
    """Metrics on the server's real test split ({} when the server holds none)."""
    return evaluate(model, test.test_images, test.test_labels, device=device) if test is not None else {}


def train_library_classifier(
    cfg: RunConfig, library: Library, device: torch.device, run_dir: Path, checkpoints: dict | None = None
) -> tuple[torch.nn.Module, dict]:
    """Synthesise the class-balanced set (stored, with its plan), write the sample grids, train the
    classifier (`checkpoints`: see train_classifier)."""
    synthesis, training = Elapsed(), Elapsed()
    with timed(synthesis):
        synthetic = class_balanced_set(library, cfg.factory, cfg.seed, device)
    save_synthetic(synthetic, run_dir / SYNTHETIC_FILE)
    save_class_grids(synthetic, run_dir / SAMPLES_DIR)
    with timed(training):
        model, stats = train_classifier(
            synthetic.images, synthetic.labels, library.num_classes, ClassifierRecipe.from_section(cfg.factory),
            val_fraction=cfg.factory.classifier_val_fraction, seed=cfg.seed, device=device, checkpoints=checkpoints,
        )  # fmt: skip
    stats.update(
        **synthesis.as_metrics("synthesis"),
        **training.as_metrics("classifier"),
        synthetic_images=len(synthetic.labels),
        synthetic_per_class=np.bincount(synthetic.labels, minlength=library.num_classes).tolist(),
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


def run_factory(
    grid: Grid,
    cfg: RunConfig,
    node_ids: list[int],
    task: TaskLike,
    test: ImageDataset | None,
    recorder: RunRecorder,
    device: torch.device,
) -> None:
    """method factory (round 1) or factory-p2p (rounds 1 and 2); results go to recorder.path."""
    flow = FactoryFlow(grid, recorder, cfg.round_timeout)
    library, rejected = flow.collect_library(node_ids, task, cfg)
    write_library(library, recorder.path / LIBRARY_DIR)
    missing = library.missing_classes()
    report = recorder.extra.setdefault("factory", {})
    report.update(
        modules=[{k: v for k, v in m.metadata().items() if k != "config"} for m in library.modules],
        rejected=rejected,
        missing_classes=missing,
        missing_class_names=[task.class_names[c] for c in missing],
    )
    if missing:
        print(f"classes without a generator (not learnable this run): {[task.class_names[c] for c in missing]}", flush=True)
    if not library.modules:
        raise RuntimeError("no generator upload passed validation; see 'rejected' and 'dropped' in summary.json")

    checkpoints = {} if cfg.factory.site_validation else None
    model, stats = train_library_classifier(cfg, library, device, recorder.path, checkpoints)
    if checkpoints is not None:
        # Imported here: the validation transport builds on this module's wire format.
        from fedskew.strategies.factory_validation import validate_at_sites

        model, report["site_validation"] = validate_at_sites(flow, node_ids, model, checkpoints, cfg, task)
    server_metrics = test_metrics(model, test, device)
    report["classifier"] = {k: v for k, v in stats.items()}
    report["server_test"] = server_metrics
    recorder.record_round(1, server_metrics, train=stats, val={"val_accuracy": stats["val_accuracy"]})
    recorder.save_checkpoint(model.state_dict())
    if cfg.method != "factory-p2p":
        return

    experts, expert_rejected = flow.collect_experts(node_ids, library, cfg, task)
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
