"""The server's side of FederatedFactory's exchanges: who each site is (from its survey), one custom message
per site, and every reply checked before it is used (the strategy, fedskew.strategies.factory, runs the rounds)."""

from __future__ import annotations

import math
import traceback
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedskew.factory.classifier import check_expert_weights, run_classifier
from fedskew.factory.intensity import check_histograms
from fedskew.factory.library import (
    MAX_IMAGE_COUNT,
    GeneratorModule,
    Library,
    UploadRejected,
    check_uploader,
    validate_upload,
    withheld_modules,
)
from fedskew.factory.run import FactorySettings
from fedskew.factory.site import generator_payload_limit, guide_config, planned_modules
from fedskew.factory.synthesis import Expert
from fedskew.protocol import (
    EXPERT_KEY,
    FACTORY_MESSAGE,
    GUIDE_MANIFEST_KEY,
    GUIDE_PREFIX,
    INTENSITY_KEY,
    METRICS_KEY,
    P2P_MESSAGE,
    decode_manifest,
    decode_states,
    encode_modules,
    packed_size_limit,
    unpacked_weights,
)
from fedskew.strategies.recording import RecordingMixin


@dataclass(frozen=True)
class FactoryTask:
    """What the server knows of the task before any upload: the classes (and their names) and the image shape."""

    num_classes: int
    image_shape: tuple[int, int, int]
    class_names: tuple[str, ...]


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


# Metrics of an expert the server reads (the P2P round's mean training loss and validation accuracy).
EXPERT_METRICS = ("train_loss", "val_accuracy")


class FactoryFlow(RecordingMixin):
    """FederatedFactory's messages and reply checks (the strategy, fedskew.strategies.factory, sends and
    aggregates through them): one custom message per site identified by its survey; a reply the server cannot
    accept is rejected with its reason and the run goes on with the others. Bytes and dropouts are recorded
    when a RunRecorder is attached."""

    def __init__(
        self, run: FactorySettings, survey: dict[int, dict], task: FactoryTask, timeout: float, floor: int = 1,
    ):  # fmt: skip
        """`run`: what the sites' plans, seeds and models follow from; `survey`: each node's survey reply;
        `timeout` bounds each exchange; fewer than `floor` sites with an accepted reply end the run (TooFewSites)."""
        super().__init__(timeout=timeout)
        self.run, self.survey, self.task, self.min_available_nodes = run, survey, task, floor
        self.identities, self.refused = site_identities(survey, task.num_classes)
        self.grid: Grid | None = None  # the Grid of the round, for the exchanges within it (site validation)
        # What the rounds found (summary.json's "factory" section in fedskew's app).
        self.report: dict = {}
        # The accepted sites' per-class real pixel histograms, summed (factory.match-intensity; else None).
        self.real_histograms: np.ndarray | None = None
        # The accepted sites' autoguidance guides (factory.guide-steps; else None).
        self.guides: Library | None = None

    def received(self, server_round: int, replies: Iterable[Message]) -> list[Message]:
        """The replies without an error, their bytes counted; a site that sent an error or nothing is dropped."""
        replies = self._count_in(server_round, replies)
        self._record_missing(server_round, "reply")
        for reply in replies:
            if reply.has_error():
                print(f"site {reply.metadata.src_node_id} sent no result: {reply.error.reason}", flush=True)
        return [r for r in replies if not r.has_error()]

    def exchange(self, server_round: int, messages: list[Message]) -> list[Message]:
        """An exchange within a round (site validation), through the round's Grid."""
        return self.received(server_round, self.grid.send_and_receive(self._count_out(messages), timeout=self.timeout))

    def checked(self, server_round: int, replies: Iterable[Message], what: str, check):
        """(identity, reply, check(identity, reply)) for every reply that passes `check`, and the rejections.
        `check` raises UploadRejected for a bad reply; any other error is a server bug: its traceback is
        printed and the reply rejected with that error, so one site never costs the run. Fewer accepted replies
        than the floor (min-available-sites) end the run with TooFewSites naming each rejection."""
        accepted, rejected, refusals = [], [], []
        for reply in self.received(server_round, replies):
            node = reply.metadata.src_node_id
            identity = self.identities.get(node)
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

    def library_messages(self) -> list[Message]:
        """Round 1: the upload request to every site with a valid survey identity."""
        return [
            Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=node, message_type=FACTORY_MESSAGE)
            for node in self.identities
        ]

    def checked_library(self, replies: Iterable[Message]) -> tuple[Library, list[dict]]:
        """Round 1's replies: the library of every upload that passed validation and the rejections (refused
        identities included)."""
        cfg, task = self.run, self.task
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

        accepted, rejected = self.checked(1, replies, "upload", check)
        modules = [m for _, _, (checked, _, _, _) in accepted for m in checked]
        histograms = [h for _, _, (_, _, h, _) in accepted if h is not None]
        self.report["withheld"] = [w for _, _, (_, _, _, site_withheld) in accepted for w in site_withheld]
        self.real_histograms = sum(histograms) if histograms else None
        guides = sorted((g for _, _, (_, site_guides, _, _) in accepted for g in site_guides), key=lambda g: (g.site_id, g.classes))
        self.guides = Library(tuple(guides), task.num_classes, image_shape, tuple(task.class_names)) if guided else None
        self.report["site_metrics"] = [
            {"node": str(identity.node), **reported_metrics(reply), "site-id": identity.site_id} for identity, reply, _ in accepted
        ]
        modules.sort(key=lambda m: (m.site_id, m.classes))
        library = Library(tuple(modules), task.num_classes, image_shape, tuple(task.class_names))
        return library, self.refused + rejected

    def expert_messages(self, library: Library) -> list[Message]:
        """Round 2: the library relayed to every identified site."""
        manifest = library.manifest()
        # One RecordDict per message (Flower would otherwise share one object), all with the same records.
        return [
            Message(encode_modules(manifest, list(library.modules)), dst_node_id=node, message_type=P2P_MESSAGE)
            for node in self.identities
        ]

    def checked_experts(self, replies: Iterable[Message]) -> tuple[list[Expert], list[dict]]:
        """Round 2's replies: the experts that pass their checks, by site id, and the rejections."""
        cfg, task = self.run, self.task
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

        accepted, rejected = self.checked(2, replies, "expert", check)
        return sorted((expert for _, _, expert in accepted), key=lambda e: e.site_id), rejected


def reported_metrics(reply: Message) -> dict:
    """The metrics a site sent along (untrusted: recorded, never used to identify it)."""
    return dict(reply.content[METRICS_KEY]) if METRICS_KEY in reply.content.metric_records else {}
