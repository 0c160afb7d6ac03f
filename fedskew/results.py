"""A run's results directory: config, partition, per-round metrics, summary, curves, checkpoint.

Every line of metrics.jsonl is flushed as soon as its round ends, so an interrupted or failed
run keeps everything up to its last round; summary.json is rewritten after every round and
says whether the run completed or failed, and why.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from fedskew.config import SITES_DATASET, ConfigError, RunConfig, sites_dir  # noqa: E402
from fedskew.metrics import headline_metric  # noqa: E402
from fedskew.models.build import weights_mismatch  # noqa: E402
from fedskew.models.model_file import ModelCard, save_model_file, weights_only  # noqa: E402
from fedskew.progress import format_duration  # noqa: E402

CHECKPOINT = "model.safetensors"  # the final model (FederatedFactory: the server's classifier)
SELECTED_MODEL = "model-selected.safetensors"  # the model of the best-validation round
# Settings that shape the data, the partition, the model or the ETF: a resumed run must share them.
RESUME_MUST_MATCH = (
    "method", "dataset", "image-size", "mosaic-grid", "partition", "alpha", "classes-per-site", "missing-classes",
    "min-site-size", "val-fraction", "model", "feature-side", "seed", "num-classes", "fednca.ladm",
    "fednca.learnable-queries", "fednca.projection-dim", "fednca.heads", "pretrained",
)

# Metrics shown in the per-round log line and the curves, by label kind.
HEADLINE = {True: ("f1_macro", "auc_macro", "map"), False: ("accuracy", "balanced_accuracy", "auroc_macro")}
# Metrics that are bookkeeping of the aggregation, not measurements of the model.
BOOKKEEPING = ("unit-weight", "num-examples", "etf-crc32")
TENSORBOARD_DIR = "tensorboard"


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric, per-round measurements of a metrics record (per-class lists and bookkeeping left out)."""
    return {
        key: float(value) for key, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in BOOKKEEPING
    }  # fmt: skip


def open_tensorboard(path: Path):
    """torch's SummaryWriter on `path`; a clear error when the optional tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "invalid run config: key 'log-tensorboard' = True needs the tensorboard package; install it with "
            "pip install 'fedskew[tensorboard]' (or pip install tensorboard), or set log-tensorboard=false"
        ) from None
    return SummaryWriter(log_dir=str(path))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return _json_safe(value.item())
    return value


def write_json(path: Path, payload: Any) -> Path:
    path.write_text(json.dumps(_json_safe(payload), indent=2) + "\n")
    return path


def read_json(path: Path) -> Any:
    """A JSON file of an earlier run; ValueError naming the file when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None


def run_dir_name(method: str, dataset: str, now: datetime | None = None) -> str:
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S-%f")
    folders = sites_dir(dataset)
    # Site folders are named by their folder of folders, not by its whole path.
    named = dataset if folders is None else f"{SITES_DATASET}-{Path(folders).expanduser().resolve().name}"
    return f"{stamp}-{method}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', named)}"


@dataclass
class RunRecorder:
    """Collects what a run produces and writes it under `path` as it goes."""

    path: Path
    multilabel: bool
    method: str
    started: float = field(default_factory=time.perf_counter)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    tensorboard: Any = None  # a SummaryWriter with log-tensorboard = true
    created: datetime | None = None  # when the run started: the time stamp of its folder's name
    total_rounds: int | None = None  # the rounds the run will record, when they are known in advance
    # Set by a method whose model is chosen inside its own training (FederatedFactory's classifier
    # epochs on a held-out split): its final round is the selected one, for the reason given here.
    selected_within: str | None = None
    # What makes the saved weights a self-contained model file (set once the task is known).
    model_card: ModelCard | None = None
    etf: torch.Tensor | None = None
    _round_start: float = field(default_factory=time.perf_counter)
    _saved: tuple[int, dict[str, torch.Tensor], float | None] | None = None  # (round, weights, threshold) of the latest checkpoint
    _selected_round: int | None = None

    @classmethod
    def create(cls, cfg: RunConfig, multilabel: bool, base: Path | None = None) -> RunRecorder:
        created = datetime.now(timezone.utc)
        path = Path(base or cfg.results_dir) / run_dir_name(cfg.method, cfg.dataset, created)
        path.mkdir(parents=True, exist_ok=False)
        write_json(path / "config.json", cfg.to_run_config())
        writer = open_tensorboard(path / TENSORBOARD_DIR) if cfg.log_tensorboard else None
        return cls(path=path, multilabel=multilabel, method=cfg.method, tensorboard=writer, created=created,
                   extra={"data": cfg.dataset})  # fmt: skip

    def name_by_data(self, data: str) -> None:
        """Name the run by the data it runs on (summary.json's "data", the report's title, the results folder)
        once the site survey tells it; the folder, created under the run config's dataset so that a run failing
        before the survey has one too, is renamed."""
        self.extra["data"] = data
        path = self.path.with_name(run_dir_name(self.method, data, self.created))
        if path == self.path:
            return
        self.path = self.path.rename(path)
        if self.tensorboard is not None:  # its event file was opened under the old name
            self.tensorboard.close()
            self.tensorboard = open_tensorboard(path / TENSORBOARD_DIR)

    # --- communication -------------------------------------------------------------------
    def count_bytes(self, direction: str, site: str, nbytes: int) -> None:
        book = self.bytes_sent if direction == "sent" else self.bytes_received
        book[site] = book.get(site, 0) + nbytes

    def record_dropout(self, server_round: int, site: str, reason: str) -> None:
        self.dropped.append({"round": server_round, "site": site, "reason": reason})

    # --- rounds ----------------------------------------------------------------------------
    def record_round(
        self,
        server_round: int,
        test: dict[str, Any],
        train: dict[str, Any] | None = None,
        val: dict[str, Any] | None = None,
        server_val: dict[str, Any] | None = None,
        threshold: float | None = None,
    ) -> dict[str, Any]:
        """One round's entry; `server_val` (the server's val-data metrics, when given) chooses the best round;
        `threshold` (multi-label) is the decision threshold the round's F1 and accuracy are taken at."""
        now = time.perf_counter()
        entry = {
            "round": server_round,
            "round_seconds": now - self._round_start,
            "elapsed_seconds": now - self.started,
            "train": train or {},
            "val": val or {},
            "test": test,
        }
        if server_val is not None:
            entry["server_val"] = server_val
        if threshold is not None:
            entry["threshold"] = threshold
        if "privacy" in self.extra:  # differential privacy: the epsilon spent up to this round
            entry["privacy"] = {k: self.extra["privacy"][k] for k in ("epsilon", "delta", "mode")}
        self._round_start = now
        self.rounds.append(entry)
        with (self.path / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps(_json_safe(entry)) + "\n")
        if self.tensorboard is not None:
            self.log_tensorboard(entry)
        self.write_summary("running")
        self._save_selected()
        print(self.round_line(entry), flush=True)
        return entry

    def log_tensorboard(self, entry: dict[str, Any]) -> None:
        """One scalar per metric (`train/...`, `val/...`, `server_val/...`, `test/...`) and the round time, at step = round."""
        for split in ("train", "val", "server_val", "test"):
            for key, value in scalar_metrics(entry.get(split, {})).items():
                self.tensorboard.add_scalar(f"{split}/{key}", value, entry["round"])
        self.tensorboard.add_scalar("time/round_seconds", entry["round_seconds"], entry["round"])
        self.tensorboard.flush()

    def round_line(self, entry: dict[str, Any]) -> str:
        """The run's one progress line a round: its metrics, its time, and with `total_rounds` how far the run is
        and when it ends at this round's pace."""
        parts = [f"[{self.method}] round {entry['round']:>3}"]
        if "train_loss" in entry["train"]:
            parts.append(f"train loss {entry['train']['train_loss']:.4f}")
        parts.append(" ".join(f"{k} {entry['test'][k]:.4f}" for k in HEADLINE[self.multilabel] if k in entry["test"]))
        if "threshold" in entry:
            parts.append(f"threshold {entry['threshold']:.2f}")
        parts.append(f"{entry['round_seconds']:.1f}s")
        if self.total_rounds and 0 < entry["round"] < self.total_rounds:
            left = (self.total_rounds - entry["round"]) * entry["round_seconds"]
            parts.append(f"{entry['round']}/{self.total_rounds} rounds, ETA {format_duration(left)}")
        return " | ".join(parts)

    def selection_key(self) -> str:
        """The validation metric that picks the best round (never a test metric)."""
        return "val_" + headline_metric(self.multilabel)

    def best_round(self) -> tuple[dict[str, Any] | None, str]:
        """(the selected round, which split chose it). Rounds are chosen on validation metrics only: the
        server's validation split (val-data) when the run has one, else the sites' federated validation
        metrics (weighted by examples); the test metrics are just reported at that round. Without
        validation metrics the final round is reported and `selected_by` says so."""
        trained = [r for r in self.rounds if r["round"] > 0]
        if not trained:
            return None, "nothing yet: no round completed"
        if self.selected_within:
            return trained[-1], self.selected_within
        key = self.selection_key()
        split, source = (
            ("server_val", "the server's validation split (val-data)") if any("server_val" in r for r in trained)
            else ("val", "the sites' validation splits, weighted by examples")
        )  # fmt: skip
        scored = [r for r in trained if isinstance(r.get(split, {}).get(key), (int, float)) and math.isfinite(r[split][key])]
        if not scored:
            return trained[-1], "the final round: no validation metrics were recorded (val-fraction = 0 or none reported)"
        # max keeps the earliest of equally good rounds.
        return max(scored, key=lambda r: r[split][key]), f"{key}: {source}"

    def write_summary(self, status: str, reason: str | None = None) -> Path:
        final = self.rounds[-1] if self.rounds else None
        best, selected_by = self.best_round()
        summary = {
            "method": self.method,
            "status": status,
            "reason": reason,
            "rounds_completed": max((r["round"] for r in self.rounds), default=0),
            "wall_seconds": time.perf_counter() - self.started,
            "final": final["test"] if final else None,
            "best_round": best["round"] if best else None,
            "best": best["test"] if best else None,
            "selected_by": selected_by,
            # Multi-label: the decision threshold of the selected round (the one its model file predicts with).
            **({"threshold": best["threshold"]} if best and "threshold" in best else {}),
            "bytes": {
                "sent_total": sum(self.bytes_sent.values()),
                "received_total": sum(self.bytes_received.values()),
                "sent_per_site": self.bytes_sent,
                "received_per_site": self.bytes_received,
            },
            "dropped": self.dropped,
            **self.extra,
        }
        return write_json(self.path / "summary.json", summary)

    # --- artefacts -------------------------------------------------------------------------
    def save_checkpoint(
        self, state_dict: dict[str, torch.Tensor], server_round: int | None = None, name: str = CHECKPOINT,
        threshold: float | None = None,
    ) -> Path:  # fmt: skip
        """The global model, written atomically (a crash never leaves half a file) as a self-contained
        model file once `model_card` is set, with the round's multi-label decision `threshold` (None:
        the card's own); with the round it completes, also the marker `resume-from` continues after.
        The best-validation round's model is kept as SELECTED_MODEL as well."""
        path = self.path / name
        weights = {k: v.detach().cpu().clone() for k, v in state_dict.items()}
        saved_round = server_round if server_round is not None else (self.rounds[-1]["round"] if self.rounds else 0)
        self._write_model(path, weights, saved_round, threshold)
        if server_round is not None:
            write_json(self.path / "checkpoint.json", {"round": server_round, "model": CHECKPOINT})
        self._saved = (saved_round, weights, threshold)
        self._save_selected()
        return path

    def _write_model(
        self, path: Path, weights: dict[str, torch.Tensor], server_round: int, threshold: float | None, selected_by: str = ""
    ) -> None:  # fmt: skip
        if self.model_card is None:
            partial = path.with_suffix(".partial")
            save_file({k: v.contiguous() for k, v in weights.items()}, str(partial))
            partial.replace(path)
        else:
            save_model_file(path, weights, self.model_card.at_round(server_round, selected_by, threshold), self.etf)

    def _save_selected(self) -> None:
        """Write SELECTED_MODEL when the latest checkpoint is of the best round (checkpoints and round
        records come in either order)."""
        best, selected_by = self.best_round()
        if best is None or self._saved is None or self._saved[0] != best["round"] or self._selected_round == best["round"]:
            return
        self._write_model(self.path / SELECTED_MODEL, self._saved[1], best["round"], self._saved[2], selected_by)
        self._selected_round = best["round"]

    def continue_from(self, previous: Path, reference: dict[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
        """Adopt a previous run's completed rounds and return (last round, its global model), after checking
        that its checkpoint fits the model of this run (`reference`: its state dict); ValueError (or
        FileNotFoundError) names the file and what is wrong."""
        marker = previous / "checkpoint.json"
        if not marker.is_file():
            raise FileNotFoundError(
                f"resume-from: {previous} has no checkpoint.json; valid: a results directory of a run that "
                "completed at least one round"
            )
        recorded = read_json(marker)
        last = recorded.get("round") if isinstance(recorded, dict) else None
        if not isinstance(last, int) or isinstance(last, bool) or last < 1:
            raise ValueError(f"resume-from: {marker} must hold the completed round as an int >= 1, got {last!r}")
        try:
            state = weights_only(previous / CHECKPOINT)
        except (OSError, SafetensorError, ValueError) as err:
            raise ValueError(f"resume-from: {previous / CHECKPOINT} is not a readable checkpoint ({err})") from None
        problem = weights_mismatch(state, reference)
        if problem:
            raise ValueError(f"resume-from: {previous / CHECKPOINT} does not fit this run's model: {problem}")
        metrics = previous / "metrics.jsonl"
        try:
            lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
            raise ValueError(f"resume-from: cannot read {metrics}: {err}") from None
        self.rounds = [r for r in lines if isinstance(r, dict) and isinstance(r.get("round"), int) and r["round"] <= last]
        with (self.path / "metrics.jsonl").open("w") as fh:
            fh.writelines(json.dumps(_json_safe(r)) + "\n" for r in self.rounds)
        self.extra["resumed_from"] = {"run": str(previous), "round": last}
        if (previous / SELECTED_MODEL).is_file():
            # The earlier run's best round stays selected until a resumed round beats it on validation.
            shutil.copy2(previous / SELECTED_MODEL, self.path / SELECTED_MODEL)
            self._selected_round = self.best_round()[0]["round"] if self.rounds else None
        return last, state

    def plot_curves(self) -> Path:
        rounds = [r["round"] for r in self.rounds]
        keys = HEADLINE[self.multilabel]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for key in keys:
            axes[0].plot(rounds, [r["test"].get(key, np.nan) for r in self.rounds], marker="o", label=key)
        axes[0].set(xlabel="round", ylabel="test metric", title=f"{self.method}: test metrics")
        axes[0].legend()
        axes[0].grid(alpha=0.3)
        losses = [(r["round"], r["train"]["train_loss"]) for r in self.rounds if "train_loss" in r["train"]]
        if losses:
            axes[1].plot(*zip(*losses), marker="o", color="tab:red")
        axes[1].set(xlabel="round", ylabel="mean local training loss", title="training loss")
        axes[1].grid(alpha=0.3)
        fig.tight_layout()
        path = self.path / "curves.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
