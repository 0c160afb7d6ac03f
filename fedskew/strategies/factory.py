"""FederatedFactory as a Flower Strategy: one upload round (`train.factory`) and, with `p2p`, one relay round
(`train.p2p`), both through Flower's `start`.

Round 1: every site trains and audits its generators and replies with one ArrayRecord per generator (its
weights packed into one array, see `fedskew.protocol.packed_weights`) plus a JSON manifest of their metadata; the
server validates each upload (a bad one is rejected with its reason and the run goes on with the rest),
samples a class-balanced synthetic set from the library, trains the classifier on it and evaluates it on the
real test images it was given. Every reply is bound to the node that sent it: its site id and label counts
come from that node's own survey reply (a site id claimed by two nodes is refused), and the modules it
may upload, their classes, image counts and configs follow from those and the settings, so a site
contributes only weights, checksums and its memorisation audit. Sizes are bounded before anything is
decoded: the manifest by characters and nesting, each payload by the run's model size.
Round 2 (P2P): Flower has no site-to-site channel, so the SuperLink relays the library to every site;
each site trains its own expert on real + synthetic images and returns it; the server evaluates the
Product of Experts and each expert alone.

Bytes are counted as Flower serialises each message (RecordingMixin), per site and direction, when a
RunRecorder is attached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from logging import INFO
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedskew.config import FactorySection, RunConfig
from fedskew.factory.library import GUIDES_DIR, Library, generators_privacy, write_library
from fedskew.factory.run import FactoryRun
from fedskew.factory.synthesis import EXPERTS_DIR, Expert, save_experts, train_library_classifier
from fedskew.models.ensemble import ExpertEnsemble
from fedskew.results import RunRecorder
from fedskew.strategies.factory_flow import FactoryFlow, FactoryTask
from fedskew.strategies.factory_validation import validate_at_sites
from fedskew.training import evaluate

LIBRARY_DIR = "library"
POE_MODEL = "model-poe.safetensors"


def metric_record(values: Mapping) -> MetricRecord:
    """The numbers among `values` as Flower's MetricRecord holds them (a flag as 0 or 1, a list of numbers as
    it is); text and nested reports stay in the strategy's `report`."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    record = {}
    for key, value in values.items():
        if isinstance(value, (bool, int, float)):
            record[key] = int(value) if isinstance(value, bool) else value
        elif isinstance(value, list) and value and all(number(v) for v in value):
            record[key] = [float(v) for v in value] if any(isinstance(v, float) for v in value) else value
    return MetricRecord(record)


class FederatedFactory(FactoryFlow, Strategy):
    """FederatedFactory (Moleri et al.; docs/factory.md) for Flower's `start`:
    `strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=strategy.num_rounds)`. It returns
    Flower's Result: `arrays` is the server's classifier after round 1 and, with `p2p`, the Product of
    Experts' state after round 2 (the run's final model, as fedskew's app reports it); `train_metrics_clientapp`
    holds the classifier's training statistics (round 1) and the experts' mean training loss and validation
    accuracy (round 2); `evaluate_metrics_serverapp` the test metrics of each round's model when `test_images`
    are given. Everything else the rounds found (uploads rejected or withheld, the sites' metrics, site
    validation, the P2P experts) is in `report` and `p2p_report`; sites that dropped out in `dropped`."""

    def __init__(
        self,
        survey: Mapping[int, Mapping],
        num_classes: int,
        image_shape: tuple[int, int, int],
        class_names: Iterable[str] | None = None,
        factory: FactorySection | None = None,
        *,
        seed: int = 0,
        p2p: bool = False,
        feature_side: int = RunConfig.model_fields["feature_side"].default,
        device: torch.device | str = "cpu",
        timeout: float = 3600.0,
        min_sites: int = 1,
        test_images: np.ndarray | None = None,
        test_labels: np.ndarray | None = None,
        output_dir: Path | str | None = None,
    ):
        """`survey`: node id -> that node's survey reply, from which each site's identity comes: "site-id" (an int)
        and "label-counts" (its training images per class), and "val-size" (its validation images) when
        factory.site-validation is on. `factory`: FederatedFactory's settings (run-config keys factory.*; None:
        their defaults); `seed`, `p2p` (a Product of Experts round follows), `feature_side` (the classifier's,
        run-config key feature-side): the sites must be given the same values (fedskew.factory.run.FactoryRun).
        `timeout` bounds every wait for the sites; fewer than `min_sites` sites with an accepted reply end the run
        with TooFewSites. `test_images`/`test_labels`: the real test split the models are evaluated on (None: not
        evaluated). `output_dir`: where the library, the synthetic set and the experts are written (None: nowhere;
        an attached RunRecorder's run folder takes its place)."""
        run = FactoryRun(factory=factory or FactorySection(), seed=seed, p2p=p2p, feature_side=feature_side)
        names = tuple(class_names) if class_names is not None else tuple(str(c) for c in range(num_classes))
        super().__init__(run, dict(survey), FactoryTask(num_classes, tuple(image_shape), names), timeout, floor=min_sites)
        if (test_images is None) != (test_labels is None):
            raise ValueError("FederatedFactory: pass test_images and test_labels together (or neither)")
        self.num_rounds = 2 if p2p else 1
        self.device = torch.device(device)
        self.test_images, self.test_labels = test_images, test_labels
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.library: Library | None = None
        self.p2p_report: dict = {}
        self.test_metrics: dict[int, dict] = {}  # round -> the test metrics of its model
        self.privacy: dict | None = None  # the DP guarantee of DP-SGD generators (generators_privacy)

    @property
    def folder(self) -> Path | None:
        return self.recorder.path if self.recorder is not None else self.output_dir

    def attach(self, recorder: RunRecorder, **options) -> None:
        """Record into `recorder`: its run folder receives the files, summary.json the report."""
        super().attach(recorder, **options)
        recorder.selected_within = (
            "factory.p2p-val-fraction: the Product of Experts, each expert's epoch chosen on a held-out share of its "
            "site's real + synthetic images"
            if self.run.p2p
            else "factory.classifier-val-fraction: the classifier's epoch is chosen on held-out synthetic images"
        )
        recorder.extra["factory"] = self.report

    def start(
        self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
        timeout: float | None = None, train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:  # fmt: skip
        """Flower's `start`, with FederatedFactory's defaults: no initial model (the classifier is trained from the
        library), its own number of rounds (refused otherwise), its own timeout, and the test metrics it measured
        as the server-side evaluation unless an `evaluate_fn` of one's own is given."""
        num_rounds = self.num_rounds if num_rounds is None else num_rounds
        if num_rounds != self.num_rounds:
            raise ValueError(f"FederatedFactory runs {self.num_rounds} round(s) (p2p={self.run.p2p}); num_rounds = "
                             f"{num_rounds} is invalid")  # fmt: skip
        return super().start(
            grid, ArrayRecord() if initial_arrays is None else initial_arrays, num_rounds,
            self.timeout if timeout is None else timeout, train_config, evaluate_config, evaluate_fn or self.tested,
        )  # fmt: skip

    def summary(self) -> None:
        log(INFO, "\t├── FederatedFactory: %d site(s) identified, %d refused, p2p %s, seed %d", len(self.identities),
            len(self.refused), self.run.p2p, self.run.seed)  # fmt: skip

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        self.grid = grid
        if server_round == 1:
            return self._count_out(self.library_messages())
        return self._count_out(self.expert_messages(self.library))

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord, MetricRecord]:
        if server_round == 1:
            return self.train_on_library(*self.checked_library(replies))
        return self.combine_experts(*self.checked_experts(replies))

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        return []  # the sites' real images are seen only through site validation (factory.site-validation)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def tested(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Flower's evaluate_fn: the test metrics the strategy measured for the round's model (`arrays`)."""
        metrics = self.test_metrics.get(server_round)
        return metric_record(metrics) if metrics else None

    def _tested(self, server_round: int, model: torch.nn.Module) -> dict:
        """The round's model on the real test split ({} when none was given)."""
        if self.test_images is None:
            metrics = {}
        else:
            metrics = evaluate(model, self.test_images, self.test_labels, device=self.device)
        self.test_metrics[server_round] = metrics
        return metrics

    def train_on_library(self, library: Library, rejected: list[dict]) -> tuple[ArrayRecord, MetricRecord]:
        """Round 1 after the checks: the library stored, the classifier trained on its class-balanced synthetic set
        (and chosen and calibrated at the sites with factory.site-validation), evaluated, recorded."""
        task, factory, folder = self.task, self.run.factory, self.folder
        self.library = library
        if folder is not None:
            write_library(library, folder / LIBRARY_DIR)
            if self.guides is not None:
                write_library(self.guides, folder / LIBRARY_DIR / GUIDES_DIR)
        missing = library.missing_classes()
        self.report.update(
            modules=[{k: v for k, v in m.metadata().items() if k != "config"} for m in library.modules],
            rejected=rejected,
            missing_classes=missing,
            missing_class_names=[task.class_names[c] for c in missing],
        )
        if any(m.privacy is not None for m in library.modules):
            self.privacy = generators_privacy(library, factory, self.run.p2p)
            if self.recorder is not None:
                self.recorder.extra["privacy"] = self.privacy
        if missing:
            print(f"classes without a generator (not learnable this run): {[task.class_names[c] for c in missing]}", flush=True)
        if not library.modules:
            raise RuntimeError("no generator upload passed validation; see 'rejected' and 'dropped' in summary.json")

        checkpoints = {} if factory.site_validation else None
        model, stats = train_library_classifier(self.run, library, self.device, folder, checkpoints, self.real_histograms, self.guides)
        if checkpoints is not None:
            model, self.report["site_validation"] = validate_at_sites(self, model, checkpoints, factory.calibration_rounds)
        server_metrics = self._tested(1, model)
        self.report["classifier"] = dict(stats)
        self.report["server_test"] = server_metrics
        if self.recorder is not None:
            self.recorder.record_round(1, server_metrics, train=stats, val={"val_accuracy": stats["val_accuracy"]})
            self.recorder.save_checkpoint(model.state_dict())
        return ArrayRecord(model.state_dict()), metric_record(stats)

    def combine_experts(self, experts: list[Expert], rejected: list[dict]) -> tuple[ArrayRecord, MetricRecord]:
        """Round 2 after the checks: the experts stored and combined as a Product of Experts, evaluated, recorded."""
        if not experts:
            raise RuntimeError("no site returned a valid expert in the P2P round; see 'dropped' in summary.json")
        task = self.task
        if self.folder is not None:
            save_experts(experts, self.run.factory.classifier, task.num_classes, task.image_shape, self.folder / EXPERTS_DIR)
        ensemble = ExpertEnsemble([e.model for e in experts])
        poe = self._tested(2, ensemble)
        self.p2p_report = {
            "poe_test": poe,
            "rejected": rejected,
            "experts": [
                {"site-id": e.site_id, "node": str(e.node), "train": e.metrics,
                 "test": {} if self.test_images is None else evaluate(e.model, self.test_images, self.test_labels, device=self.device)}
                for e in experts
            ],
        }  # fmt: skip
        mean = {k: float(np.mean([e.metrics[k] for e in experts])) for k in ("train_loss", "val_accuracy")}
        if self.recorder is not None:
            self.recorder.extra["p2p"] = self.p2p_report
            self.recorder.record_round(2, poe, train=mean)
            # The Product of Experts as one self-contained model file (model.safetensors stays the server's classifier).
            if self.recorder.model_card is not None:
                self.recorder.model_card = replace(self.recorder.model_card, experts=len(experts))
            self.recorder.save_checkpoint(ensemble.state_dict(), name=POE_MODEL)
        return ArrayRecord(ensemble.state_dict()), MetricRecord(mean)

