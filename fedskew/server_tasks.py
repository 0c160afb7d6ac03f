"""Server-side work of a run, kept out of server_app.py so it reads as build-and-start:
waiting for sites, the site survey that records the partition, the rounds of the weight-averaging
methods, server-side evaluation, and the centralised (pooled-data) upper bound."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from torch import nn

from fedskew.analysis import write_fednca_analysis
from fedskew.app_signing import with_unverified_app_cause
from fedskew.client_tasks import local_optimisation, validation_report
from fedskew.config import (
    FEDERATED_EVALUATION, MAX_CLASSES, MAX_SITE_IMAGES, MAX_SITES, ConfigError, RunConfig, check_label_kind,
    current_run_config, sites_dir,
)
from fedskew.data.plots import plot_cooccurrence, plot_label_counts
from fedskew.data.site_folder import load_test_set, pooled_site_data, site_folders, site_names
from fedskew.data.sites import load_partition, load_task_dataset
from fedskew.data.sources import ImageDataset
from fedskew.factory.library import _shown
from fedskew.methods import method_of, methods_where
from fedskew.metrics import DEFAULT_THRESHOLD, choose_threshold, counted_f1, counted_thresholds
from fedskew.models.build import build_model, server_etf, start_backbone
from fedskew.privacy import check_resumed_privacy, private_strategy
from fedskew.protocol import SURVEY_QUERY, VAL_COUNTS_KEY
from fedskew.results import RESUME_MUST_MATCH, RunRecorder, read_json, write_json
from fedskew.strategies import build_strategy
from fedskew.strategies.messages import declared_sites
from fedskew.training import evaluate, make_loader, train_local

T = TypeVar("T")


def wait_for_sites(grid: Grid, minimum: int, timeout: float, poll: float = 1.0) -> list[int]:
    """Node ids once at least `minimum` sites are connected; a clear error after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        node_ids = sorted(grid.get_node_ids())
        if len(node_ids) >= minimum:
            return node_ids
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {len(node_ids)} site(s) connected after {timeout:.0f} s; "
                f"min-available-sites = {minimum}. Start more SuperNodes or lower min-available-sites."
            )
        time.sleep(poll)


# Flower puts a failed ClientApp's exception in its error reply: "<class 'X'>:<'message'>"; in simulation the
# message is Ray's whole traceback of the actor, in terminal colours.
FLOWER_ERROR = re.compile(r"<class '(?P<type>[\w.()]+)'>:<'(?P<message>.*)'>", re.DOTALL)
TERMINAL_COLOUR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RAISED_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception))(?:: (?P<message>.*))?$", re.MULTILINE)


def one_line(text: str) -> str:
    """`text` on one line, without terminal colour codes or other control characters (a site's text must not
    steer the server's terminal): a log line, summary.json's reason."""
    return " ".join("".join(c if c.isprintable() else " " for c in TERMINAL_COLOUR.sub("", text)).split())


def site_failure(reason: str) -> str:
    """The one line that says why a site's ClientApp failed, from Flower's error reply: the exception the
    site's code raised (the first one a traceback names: the others re-raise it) as `Type: message`."""
    reason = with_unverified_app_cause(TERMINAL_COLOUR.sub("", reason))
    match = FLOWER_ERROR.fullmatch(reason.strip())
    kind, message = (match["type"], match["message"]) if match else ("", reason)
    raised = RAISED_LINE.search(message) if "Traceback" in message or 'File "' in message else None
    if raised:
        kind, message = raised["type"], raised["message"] or ""
    kind, message = kind.rsplit(".", 1)[-1], one_line(message)
    return (f"{kind}: {message}" if kind and message else kind or message) or "(the site gave no reason)"


class SurveyRefusal(ValueError):
    """Why a site's survey reply cannot be used; the site is refused, the run goes on without it."""


SURVEY_SIDE_LIMIT = 8192  # pixels per image side: far above any dataset here (MedMNIST+ tops at 224)
DATA_SOURCES = ("partition", "site-folder")  # a simulated site's share of the dataset, or a deployed site's folder


def _whole(record: Mapping, key: str, low: int, high: int) -> int:
    value = record.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SurveyRefusal(f"'{key}' must be an int in {low}..{high}, found {_shown(value)}")
    return value


def _wholes(record: Mapping, key: str, length: int, high: int) -> list[int]:
    value = record.get(key)
    if not (isinstance(value, list) and len(value) == length
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= high for v in value)):  # fmt: skip
        raise SurveyRefusal(f"'{key}' must be {length} ints in 0..{high}, found {_shown(value)}")
    return list(value)


def parse_survey(record: Mapping | None, cfg: RunConfig) -> dict:
    """A site's survey reply (its ConfigRecord 'survey' as a mapping; None: the reply has none), checked
    completely against itself and the run config, as plain Python values under the keys site_survey
    writes (nothing else is kept); SurveyRefusal says what is wrong. The counts must be counts a site of
    the size it declares can hold: single-label counts sum to train-size, no multi-label count exceeds
    it, and the co-occurrence matrix is symmetric with the label counts on its diagonal and no pair
    counted more often than either of its labels. Whether the site's task (label kind, classes, image
    shape) is the run's is `agreed_task_shape`'s to decide."""
    if not isinstance(record, Mapping):
        raise SurveyRefusal("holds no ConfigRecord 'survey'")
    num_sites = _whole(record, "num-sites", 1, MAX_SITES)
    survey = {
        "site-id": _whole(record, "site-id", 0, num_sites - 1),
        "num-sites": num_sites,
        "train-size": _whole(record, "train-size", 1, MAX_SITE_IMAGES),
        "val-size": _whole(record, "val-size", 0, MAX_SITE_IMAGES),
        "unassigned": _whole(record, "unassigned", 0, MAX_SITE_IMAGES),
        "num-classes": _whole(record, "num-classes", 1, MAX_CLASSES),
        "multilabel": _whole(record, "multilabel", 0, 1),
    }
    k, size = survey["num-classes"], survey["train-size"]
    if cfg.num_classes not in (0, k):
        raise SurveyRefusal(f"'num-classes' = {k}, but the run config's num-classes = {cfg.num_classes}")
    if record.get("data-source") not in DATA_SOURCES:
        raise SurveyRefusal(f"'data-source' must be one of {list(DATA_SOURCES)}, found {_shown(record.get('data-source'))}")
    survey["data-source"] = record["data-source"]
    shape = record.get("image-shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in shape)
            and 1 <= shape[0] <= 4 and all(1 <= side <= SURVEY_SIDE_LIMIT for side in shape[1:])):  # fmt: skip
        raise SurveyRefusal(f"'image-shape' must be [channels 1..4, height, width 1..{SURVEY_SIDE_LIMIT}], found {_shown(shape)}")
    survey["image-shape"] = list(shape)
    counts = survey["label-counts"] = _wholes(record, "label-counts", k, size)
    if not survey["multilabel"] and sum(counts) != size:
        raise SurveyRefusal(f"single-label 'label-counts' must sum to train-size = {size}, found {sum(counts)}")
    if "class-names" in record:  # optional: a site without class names sends none
        names = record["class-names"]
        if not (isinstance(names, list) and len(names) == k and all(isinstance(n, str) and 0 < len(n) <= 200 for n in names)
                and len(set(names)) == k):  # fmt: skip
            raise SurveyRefusal(f"'class-names' must be {k} distinct names of 1..200 characters, found {_shown(names)}")
        survey["class-names"] = list(names)
    if survey["multilabel"]:
        pairs = np.array(_wholes(record, "cooccurrence", k * k, size), dtype=np.int64).reshape(k, k)
        if not (np.array_equal(pairs, pairs.T) and np.array_equal(np.diag(pairs), counts)
                and (pairs <= np.minimum.outer(np.diag(pairs), np.diag(pairs))).all()):  # fmt: skip
            raise SurveyRefusal("'cooccurrence' must be a symmetric matrix with 'label-counts' on its diagonal and no "
                                "pair counted more often than either of its labels")
        survey["cooccurrence"] = pairs.ravel().tolist()
    elif "cooccurrence" in record:
        raise SurveyRefusal("'cooccurrence' is sent by multi-label sites only, but this site reports 'multilabel' = 0")
    return survey


def survey_sites(grid: Grid, node_ids: list[int], cfg: RunConfig) -> tuple[dict[int, dict], dict[int, str]]:
    """Ask every site for its label statistics (counts only: no data leaves a site). Returns (node -> its
    parsed survey, node -> why it is refused): a site whose ClientApp failed (the one line saying why) or
    whose reply `parse_survey` refuses."""
    messages = [Message(RecordDict({"config": ConfigRecord()}), message_type=SURVEY_QUERY, dst_node_id=n) for n in node_ids]
    survey, refused = {}, {}
    for reply in grid.send_and_receive(messages, timeout=cfg.round_timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            refused[node] = f"site {node} failed the survey: {site_failure(reply.error.reason)}"
            continue
        try:
            survey[node] = parse_survey(reply.content.config_records.get("survey"), cfg)
        except SurveyRefusal as refusal:
            refused[node] = f"site {node} refused: its survey reply {refusal}"
    for node in sorted(set(node_ids) - set(survey) - set(refused)):
        refused[node] = f"site {node} did not answer the survey within round-timeout = {cfg.round_timeout:g} s"
    return survey, refused


class SurveyFailed(ValueError):
    """Too few sites are left after the survey for the run to go on; the message is one line saying why."""


def require_sites(cfg: RunConfig, survey: dict[int, dict], refused: dict[int, str]) -> None:
    """The run goes on with the sites left after the survey if they are at least min-available-sites;
    else SurveyFailed, one line. When every site was refused for the same reason (a setting that fails at
    every site, such as a label space the sites do not hold), the line is that reason."""
    if len(survey) >= cfg.min_available_sites:
        return
    # Each reason reads "site <node> <why>"; without the node, the sites' whys are the same or not.
    whys = {reason.split(" ", 2)[2] for reason in refused.values()}
    if not survey and len(whys) == 1:
        raise SurveyFailed(f"every site ({len(refused)}) {whys.pop()}")
    raise SurveyFailed(
        f"{len(survey)} site(s) left after the survey, fewer than min-available-sites = {cfg.min_available_sites}: "
        + " | ".join(refused[node] for node in sorted(refused))
    )


def refuse_sites(recorder: RunRecorder, survey: dict[int, dict], refused: dict[int, str]) -> dict[int, dict]:
    """Record each refused site like a dropped one (round 0: the survey) and return the survey without them."""
    for node, reason in refused.items():
        print(reason, flush=True)
        recorder.record_dropout(0, str(node), reason)
    return {node: s for node, s in survey.items() if node not in refused}


def shared_site_ids(survey: dict[int, dict]) -> dict[int, str]:
    """node -> why it is refused, for every node whose survey claims a site id that another node claims too. The
    site id seeds a site's validation split and training and names it in the results, and the server cannot
    tell which claimant is the site, so none of them keeps it (a deployed SuperNode without node config
    site-id claims 0)."""
    claimants: dict[int, list[int]] = {}
    for node, declared in sorted(survey.items()):
        claimants.setdefault(declared["site-id"], []).append(node)
    return {
        node: f"site {node} refused: nodes {', '.join(map(str, nodes))} all claim site-id {site_id}; give each site its "
        f"own with node config site-id (--node-config \"site-id=K num-sites=N\", K in 0..N-1)"
        for site_id, nodes in claimants.items() if len(nodes) > 1 for node in nodes
    }  # fmt: skip


def survey_federation(
    grid: Grid, node_ids: list[int], cfg: RunConfig, test: ImageDataset | None, recorder: RunRecorder
) -> tuple[dict[int, dict], TaskShape | ImageDataset]:
    """Everything before round 1 that the sites' answers decide: (node -> survey of the sites that take part,
    the run's task). A site whose survey failed or is refused (`survey_sites`), whose task is not the run's
    (`agreed_task_shape`) or whose site id another node claims too (`shared_site_ids`), is recorded as dropped
    in round 0 and the run goes on
    without it, as long as min-available-sites remain (`require_sites`); the partition record is written from
    the sites that remain."""
    survey, refused = survey_sites(grid, node_ids, cfg)
    survey = refuse_sites(recorder, survey, refused)
    require_sites(cfg, survey, refused)
    task, mismatched = agreed_task_shape(cfg, survey, test)
    survey = refuse_sites(recorder, survey, mismatched)
    shared = shared_site_ids(survey)
    survey = refuse_sites(recorder, survey, shared)
    refused = {**refused, **mismatched, **shared}
    require_sites(cfg, survey, refused)
    write_partition(recorder, survey, task.class_names, site_names(cfg))
    return survey, task


def run_data_name(cfg: RunConfig, survey: dict[int, dict], class_names: tuple[str, ...]) -> str:
    """What the run is named by (its log, results folder and report): the run config's dataset, unless the
    sites answered the survey from their own folders while the dataset does not name them (a deployment,
    where `dataset` keeps its default): then "site-folders-" and the task's class names (their count when
    the classes are unnamed or their names too long for a folder name)."""
    if sites_dir(cfg.dataset) is not None or all(s["data-source"] == "partition" for s in survey.values()):
        return cfg.dataset
    named = "-".join(class_names)
    unnamed = class_names == tuple(str(k) for k in range(len(class_names)))
    return f"site-folders-{len(class_names)}-classes" if unnamed or len(named) > 60 else f"site-folders-{named}"


def check_partition(cfg: RunConfig, num_sites: int) -> None:
    """ConfigError (one line naming the settings) when the run's partition of its dataset over `num_sites`
    simulated sites cannot be drawn: checked by the server before the survey, since every simulated site
    draws the same partition and would fail alike."""
    if sites_dir(cfg.dataset) is not None:
        return  # each simulated site is one of the sites' folders: nothing is partitioned
    config_checked(f"partition = {cfg.partition!r} of dataset {cfg.dataset!r} over {num_sites} sites (num-supernodes) "
                   "cannot be drawn", lambda: load_partition(cfg, num_sites))  # fmt: skip


def config_checked(what: str, load: Callable[[], T]) -> T:
    """load(), whose ValueError is about data the run config names (`what`: the key and its value): raised as
    the ConfigError that ends a run before round 1 with one line, "invalid run config: <what>: <why>"."""
    try:
        return load()
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"invalid run config: {what}: {err}") from None


def write_partition(
    recorder: RunRecorder, survey: dict[int, dict], class_names: tuple[str, ...], names: dict[int, str] | None = None
) -> None:
    """partition.json + heatmap (and per-site co-occurrence for multi-label data) from the survey; `names`:
    site id -> the name of its folder (`site_names`), recorded beside the id."""
    sites = sorted(survey.values(), key=lambda s: s["site-id"])
    counts = np.array([s["label-counts"] for s in sites], dtype=np.int64)
    k = len(class_names)
    payload = {
        "sites": [
            {
                "site-id": s["site-id"],
                **({"site-name": names[s["site-id"]]} if names and s["site-id"] in names else {}),
                "train-size": s["train-size"],
                "val-size": s["val-size"],
                "label-counts": s["label-counts"],
                **({"cooccurrence": np.reshape(s["cooccurrence"], (k, k)).tolist()} if "cooccurrence" in s else {}),
            }
            for s in sites
        ],
        "unassigned": sites[0].get("unassigned", 0) if sites else 0,
        "class-names": list(class_names),
    }
    write_json(recorder.path / "partition.json", payload)
    plot_label_counts(counts, class_names, recorder.path / "partition.png", "training labels per site")
    if all("cooccurrence" in s for s in sites):
        matrices = [np.reshape(s["cooccurrence"], (k, k)) for s in sites]
        plot_cooccurrence(matrices, class_names, recorder.path / "cooccurrence.png")


def resume_point(
    cfg: RunConfig, recorder: RunRecorder, reference: dict[str, torch.Tensor]
) -> tuple[int, dict[str, torch.Tensor] | None]:
    """(rounds already done, global model) of `resume-from`, after checking that the earlier run
    shares every setting that shapes the partition, the model and the ETF and that its checkpoint fits
    this run's model (`reference`: its state dict); (0, None) without it."""
    if not cfg.resume_from:
        return 0, None
    previous = Path(cfg.resume_from)
    if not method_of(cfg).resumable:
        raise ValueError(f"resume-from works with {', '.join(methods_where(resumable=True))}; this run's method is {cfg.method!r}")
    if not (previous / "config.json").is_file():
        raise FileNotFoundError(f"resume-from = {str(previous)!r} holds no config.json; valid: a fedskew run directory")
    earlier = read_json(previous / "config.json")
    if not isinstance(earlier, dict):
        raise ValueError(f"resume-from: {previous / 'config.json'} is not a run config (a JSON object)")
    earlier, now = current_run_config(earlier), cfg.to_run_config()
    differing = [f"{k}: {earlier.get(k)!r} -> {now[k]!r}" for k in RESUME_MUST_MATCH if k in now and earlier.get(k) != now[k]]
    if differing:
        raise ValueError("resume-from: these settings differ from the earlier run's: " + "; ".join(differing))
    check_resumed_privacy(earlier, now)
    done, state = recorder.continue_from(previous, reference)
    if done >= cfg.num_server_rounds:
        raise ValueError(f"resume-from: the earlier run already completed {done} of num-server-rounds = {cfg.num_server_rounds}")
    print(f"fedskew: resuming {previous} after round {done}", flush=True)
    return done, state


def scalar_metrics(metrics: dict) -> MetricRecord:
    return MetricRecord({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and np.isfinite(v)})


@dataclass(frozen=True)
class RoundEvaluation:
    """One round's metrics: test (at the round's decision threshold), the sites' validation, the server's
    validation (val-data; None without it), and for multi-label data the threshold and what chose it."""

    test: dict
    val: dict
    server_val: dict | None
    threshold: float | None = None
    threshold_chosen_by: str = ""


def decision_threshold(
    setting: str | float, site_counts: np.ndarray | None, server_counts: np.ndarray | None, thresholds: tuple[float, ...]
) -> tuple[float, str]:
    """(the round's multi-label decision threshold, what chose it). A fixed run-config threshold is used as
    given. Chosen on validation, it comes from val-data when the run has it, because val-data is what
    chooses the round there, so the round and its threshold come from the same split; else from the sites'
    summed validation counts. The test split never chooses it."""
    if setting != "validation":
        return float(setting), "run-config threshold (fixed)"
    if server_counts is not None:
        return choose_threshold(server_counts, thresholds), "the server's validation split (val-data)"
    if site_counts is not None:
        return choose_threshold(site_counts, thresholds), "the sites' validation splits (their summed counts)"
    return DEFAULT_THRESHOLD, "none: no validation data this round, so 0.5"


def report_counts(report: dict, thresholds: tuple[float, ...]) -> np.ndarray:
    """The (thresholds, classes, 3) counts of a multi-label validation_report."""
    return np.asarray(report[VAL_COUNTS_KEY], dtype=np.int64).reshape(len(thresholds), -1, 3)


def evaluate_round(
    model: nn.Module,
    test: ImageDataset | None,
    device: torch.device,
    *,
    multilabel: bool,
    threshold_setting: str | float,
    site_val: dict,
    site_counts: np.ndarray | None,
    validation: ImageDataset | None,
) -> RoundEvaluation:
    """A round's evaluation, the same for the federated methods and the centralised bound: the server's
    validation split (when val-data gives one) and, for multi-label data, the decision threshold chosen
    on validation (`decision_threshold`) with the validation F1 derived from the counts at it, then the
    test split at that threshold. `site_val`: the sites' aggregated validation scalars; `site_counts`:
    their summed threshold counts (None: none reported)."""
    server_report = None if validation is None else validation_report(
        model, validation.test_images, validation.test_labels, device=device, threshold=threshold_setting
    )  # fmt: skip
    if not multilabel:
        test_metrics = {} if test is None else evaluate(model, test.test_images, test.test_labels, device=device)
        return RoundEvaluation(test_metrics, site_val, server_report)
    thresholds = counted_thresholds(threshold_setting)
    server_counts = None if server_report is None else report_counts(server_report, thresholds)
    threshold, chosen_by = decision_threshold(threshold_setting, site_counts, server_counts, thresholds)

    def scores(counts: np.ndarray) -> dict:
        return {f"val_{k}": v for k, v in counted_f1(counts, thresholds, threshold).items()}

    return RoundEvaluation(
        test={} if test is None else evaluate(model, test.test_images, test.test_labels, device=device, threshold=threshold),
        val=site_val if site_counts is None else {**site_val, **scores(site_counts)},
        server_val=None if server_counts is None else scores(server_counts),
        threshold=threshold,
        threshold_chosen_by=chosen_by,
    )


def record_evaluation(recorder: RunRecorder, server_round: int, state: dict, result: RoundEvaluation, train: dict) -> None:
    """Checkpoint the round's model (with its threshold, for its model file) and record the round."""
    if result.threshold is not None:
        recorder.extra["threshold_chosen_by"] = result.threshold_chosen_by
    recorder.save_checkpoint(state, server_round, threshold=result.threshold)
    recorder.record_round(server_round, result.test, train=train, val=result.val, server_val=result.server_val,
                          threshold=result.threshold)  # fmt: skip


def make_evaluate_fn(
    model: nn.Module,
    test: ImageDataset | None,
    device: torch.device,
    recorder: RunRecorder,
    round_metrics: Callable[[], tuple[dict, dict, np.ndarray | None]],
    round_offset: int = 0,
    validation: ImageDataset | None = None,
    threshold_setting: str | float = "validation",
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """After every round: evaluate the global model (`evaluate_round`: with no test data, the sites'
    aggregated validation metrics are the round's evaluation), checkpoint it, and record the round.
    `round_metrics` gives the round's (aggregated train metrics, aggregated validation metrics, summed
    validation threshold counts). `round_offset` numbers the rounds of a resumed run after the earlier
    ones. Flower calls this after the round's federated evaluation, so the validation metrics are current."""

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        # Loaded into the model first: aggregation (Flower's DP wrappers among it) can hand back integer
        # buffers such as BatchNorm's num_batches_tracked as floats; the model's own dtypes are what is saved.
        model.load_state_dict(arrays.to_torch_state_dict())
        if server_round == 0 and round_offset:
            # The resumed model: already recorded by the earlier run.
            return scalar_metrics({} if test is None else evaluate(model, test.test_images, test.test_labels, device=device))
        train, val, counts = round_metrics()
        result = evaluate_round(model, test, device, multilabel=recorder.multilabel, threshold_setting=threshold_setting,
                                site_val=val, site_counts=counts, validation=validation)  # fmt: skip
        record_evaluation(recorder, round_offset + server_round, model.state_dict(), result, train)
        return scalar_metrics(result.test)

    return evaluate_fn


def run_rounds(
    grid: Grid,
    cfg: RunConfig,
    survey: dict[int, dict],
    task: TaskShape | ImageDataset,
    test: ImageDataset | None,
    validation: ImageDataset | None,
    recorder: RunRecorder,
    device: torch.device,
) -> None:
    """The weight-averaging methods (FedNCA-ML and the baselines): the model (resumed when the run is),
    the method's strategy wrapped for differential privacy when configured, and its rounds. `survey`: the
    sites that take part (refused ones left out); every reply of theirs is held to what they declared in it."""
    etf = server_etf(cfg, task.num_classes, task.image_shape) if method_of(cfg).server_etf else None
    recorder.etf = etf  # stored in the model files: the model is unusable without it
    model = build_model(cfg, task.num_classes, task.image_shape, etf=etf)
    done, resumed_state = resume_point(cfg, recorder, model.state_dict())
    if resumed_state is not None:
        model.load_state_dict(resumed_state)
    else:  # a resumed run has its weights; pretraining them again would be thrown away
        start_backbone(cfg, model, task.image_shape, device)
    model.to(device)
    strategy = build_strategy(cfg, len(survey), model, etf=etf)
    thresholds = counted_thresholds(cfg.threshold)
    strategy.attach(recorder, round_offset=done, declared=declared_sites(survey),
                    counts_shape=(len(thresholds), task.num_classes, 3) if task.multilabel else None)  # fmt: skip
    num_examples = sum(int(s["train-size"]) for s in survey.values())
    private_strategy(cfg, strategy, len(survey), num_examples, recorder).start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=cfg.num_server_rounds - done,
        timeout=cfg.round_timeout,
        train_config=ConfigRecord({"local-epochs": cfg.local_epochs}),
        evaluate_fn=make_evaluate_fn(
            model, test, device, recorder,
            lambda: (strategy.last_train_metrics, strategy.last_val_metrics, strategy.last_val_counts),
            round_offset=done, validation=validation, threshold_setting=cfg.threshold,
        ),  # fmt: skip
    )
    if method_of(cfg).fednca_model and test is not None and model.use_ladm:
        # The final global model is in `model`: evaluate_fn loaded every round's weights into it.
        recorder.extra["neural_collapse"] = write_fednca_analysis(model, test, recorder.path, device, cfg.seed)


def train_centralized(
    cfg: RunConfig,
    task: TaskShape | ImageDataset,
    num_sites: int,
    device: torch.device,
    recorder: RunRecorder,
    validation: ImageDataset | None = None,
) -> None:
    """The upper bound: the model of the method it bounds (`centralized-model`), with that method's
    losses and optimiser, on the pooled site training data for the same sample passes (rounds x local
    epochs over every site's data), evaluated on the same test split. One optimiser and learning-rate
    schedule span the whole run, as one site would train if it held all the data. The SGD model's
    constant rate decays here along a cosine to 0 at the last step: at a constant rate its test score
    swung by up to 16 points between its last epochs, so its final round could read below the method
    it bounds."""
    images, labels, val_images, val_labels = pooled_site_data(cfg, num_sites)
    test = load_server_test_set(cfg)  # None with test-data = "federated": validation is the evaluation
    etf = server_etf(cfg, task.num_classes, task.image_shape) if cfg.fednca_model else None
    recorder.etf = etf  # stored in the model files: the model is unusable without it
    model = start_backbone(cfg, build_model(cfg, task.num_classes, task.image_shape, etf=etf), task.image_shape,
                           device).to(device)
    recorder.record_round(0, {} if test is None else evaluate(model, test.test_images, test.test_labels, device=device))

    def after_round(server_round: int, stats: dict) -> None:
        site_val, site_counts = pooled_validation(cfg, model, val_images, val_labels, device)
        result = evaluate_round(model, test, device, multilabel=task.multilabel, threshold_setting=cfg.threshold,
                                site_val=site_val, site_counts=site_counts, validation=validation)  # fmt: skip
        record_evaluation(recorder, server_round, model.state_dict(), result, stats)

    train_pooled(cfg, model, images, labels, device, after_round)


def train_pooled(
    cfg: RunConfig, model: nn.Module, images: np.ndarray, labels: np.ndarray, device: torch.device,
    after_round: Callable[[int, dict], None],
) -> None:  # fmt: skip
    """The centralised bound's training of `model` on the pooled (images, labels): one shuffled loader, one
    optimiser and schedule over the run's rounds x local epochs; `after_round(round, train_local's stats)`
    after each round's epochs."""
    loader = make_loader(images, labels, cfg.batch_size, shuffle=True, seed=cfg.seed)
    optimizer, scheduler, loss_fn = local_optimisation(cfg, model, cfg.local_epochs * len(loader), server_round=1, augment_seed=cfg.seed)
    if scheduler is None:  # the SGD model: the same steps, ending stable instead of at the full rate
        total_steps = cfg.num_server_rounds * cfg.local_epochs * len(loader)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    for server_round in range(1, cfg.num_server_rounds + 1):
        stats = train_local(
            model, loader, epochs=cfg.local_epochs, optimizer=optimizer, scheduler=scheduler, loss_fn=loss_fn,
            device=device,
        )
        after_round(server_round, stats)


def pooled_validation(
    cfg: RunConfig, model: nn.Module, images: np.ndarray, labels: np.ndarray, device: torch.device
) -> tuple[dict, np.ndarray | None]:
    """(validation scalars, threshold counts) on the pooled site validation splits: what the sites would
    report between them, so the centralised bound's round and threshold are chosen on validation like
    every other method's."""
    if len(labels) == 0:
        return {}, None
    report = validation_report(model, images, labels, device=device, threshold=cfg.threshold)
    if VAL_COUNTS_KEY in report:
        return {}, report_counts(report, counted_thresholds(cfg.threshold))
    return report, None


def load_server_validation_set(cfg: RunConfig, task: TaskShape | ImageDataset) -> ImageDataset | None:
    """The server's validation set (run-config val-data), read like test-data; it must hold the task's
    label kind, classes and image shape. None when val-data is empty."""
    if not cfg.val_data:
        return None
    validation = config_checked(f"val-data = {cfg.val_data!r}", lambda: load_test_set(cfg, cfg.val_data))
    found = (validation.multilabel, validation.num_classes, validation.image_shape)
    if found != (task.multilabel, task.num_classes, task.image_shape):
        raise ConfigError(
            f"run-config val-data = {cfg.val_data!r} holds {'multi' if found[0] else 'single'}-label data with "
            f"{found[1]} classes of shape {found[2]}, but the sites' task has {'multi' if task.multilabel else 'single'}"
            f"-label data with {task.num_classes} classes of shape {task.image_shape}; give validation data of the task"
        )
    return validation


# --- deployment: where the server's test data comes from, and federated evaluation -------------------


def load_server_test_set(cfg: RunConfig) -> ImageDataset | None:
    """The server's test data by run-config test-data: empty = the dataset's test split (simulation, or a
    centre that holds the dataset); a path = that site-layout folder or MedMNIST-layout npz;
    "federated" = none (None): the sites' validation metrics are the evaluation. With dataset sites:<dir>
    (test-data then given) the site folders are checked here, before any site is waited for."""
    if sites_dir(cfg.dataset) is not None:
        config_checked(f"dataset = {cfg.dataset!r}", lambda: site_folders(cfg))
    if cfg.test_data == FEDERATED_EVALUATION:
        return None
    if cfg.test_data:
        return config_checked(f"test-data = {cfg.test_data!r}", lambda: load_test_set(cfg, cfg.test_data))
    dataset = config_checked(f"dataset = {cfg.dataset!r}", lambda: load_task_dataset(cfg))
    if cfg.num_classes not in (0, dataset.num_classes):
        raise ConfigError(
            f"key 'num-classes' = {cfg.num_classes} is invalid; {dataset.name} has {dataset.num_classes} classes "
            "(valid: 0 or that number)"
        )
    return dataset


@dataclass(frozen=True)
class TaskShape:
    """What the server needs to build the model when it holds no data (same names as ImageDataset)."""

    num_classes: int
    image_shape: tuple[int, int, int]
    class_names: tuple[str, ...]
    multilabel: bool
    name: str


def _reported_task(survey: dict) -> TaskShape:
    """The task shape one site reported (class names are optional: older or nameless sites send none)."""
    num_classes = int(survey["num-classes"])
    names = tuple(str(n) for n in survey.get("class-names", ())) or tuple(str(k) for k in range(num_classes))
    return TaskShape(
        num_classes, tuple(int(v) for v in survey["image-shape"]), names, bool(survey.get("multilabel", False)), "site data"
    )


def _kind(multilabel: bool) -> str:
    return "multi-label" if multilabel else "single-label"


def _task_differences(site: TaskShape, run: TaskShape) -> list[str]:
    """How a site's task differs from the run's. Class names count only when both sides name their
    classes (a site without classes.txt has names '0'..'K-1')."""
    unnamed = tuple(str(k) for k in range(run.num_classes))
    differences = []
    if site.multilabel != run.multilabel:
        differences.append(f"its data is {_kind(site.multilabel)} but the run is {_kind(run.multilabel)}")
    if site.num_classes != run.num_classes:
        differences.append(f"it has {site.num_classes} classes but the run has {run.num_classes}")
    elif site.class_names != run.class_names and unnamed not in (site.class_names, run.class_names):
        differences.append(f"its class names {list(site.class_names)} differ from the run's {list(run.class_names)}")
    if site.image_shape != run.image_shape:
        differences.append(f"its images are {site.image_shape} (C, H, W) but the run's are {run.image_shape}")
    return differences


def _majority(cfg: RunConfig, reported: dict[int, TaskShape]) -> TaskShape:
    """The task most sites report (the lowest node id breaks ties), of the kind the config fixes if it does."""
    kind = cfg.label_kind
    candidates = [t for _, t in sorted(reported.items()) if kind is None or t.multilabel == (kind == "multi")]
    pool = candidates or [t for _, t in sorted(reported.items())]
    key = lambda t: (t.multilabel, t.num_classes, t.image_shape, t.class_names)  # noqa: E731
    return max(pool, key=lambda t: sum(key(o) == key(t) for o in pool))


def agreed_task_shape(
    cfg: RunConfig, survey: dict[int, dict], test: ImageDataset | None
) -> tuple[TaskShape | ImageDataset, dict[int, str]]:
    """(the run's task, refused sites -> reason). The task (label kind, label space, image shape) is the
    server's test data when it has some, else the run config's label kind and what most sites report.
    A site that differs is refused with the reason and the run goes on without it (it would otherwise
    fail every round with shape errors); the run stops only when no site fits, or the agreed label kind
    does not fit the method."""
    reported = {node: _reported_task(s) for node, s in survey.items()}
    if test is not None:
        run, source = TaskShape(test.num_classes, test.image_shape, test.class_names, test.multilabel, test.name), (
            f"the server's test data ({test.name})"
        )
    elif reported:
        run, source = _majority(cfg, reported), "the sites' majority"
    else:
        raise RuntimeError("no site answered the survey and the server has no test data: nothing defines the model")
    check_label_kind(cfg, run.multilabel, source)
    refused = {}
    for node, site in sorted(reported.items()):
        differences = _task_differences(site, run)
        if differences:
            refused[node] = (
                f"site {node} refused: {'; '.join(differences)} (run task from {source}). Fix the site's labels.csv / "
                "classes.txt / images, or set run-config labels, num-classes and image-size"
            )
    if reported and len(refused) == len(reported):
        raise SurveyFailed("every site was refused: " + " | ".join(refused.values()))
    return (test if test is not None else run), refused
