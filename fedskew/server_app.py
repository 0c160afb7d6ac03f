"""fedskew ServerApp: parse the run config, survey the sites, build the method's strategy, start it."""

from __future__ import annotations

import sys

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import InMemoryGrid

from fedskew.config import ConfigError, RunConfig
from fedskew.data.image_dataset import ImageDataset
from fedskew.fidelity import record_fidelity
from fedskew.methods import method_of
from fedskew.models.model_file import run_model_card
from fedskew.report import try_write_report
from fedskew.results import RunRecorder
from fedskew.server_tasks import (
    SurveyFailed,
    TaskShape,
    check_partition,
    load_server_test_set,
    load_server_validation_set,
    one_line,
    run_data_name,
    run_rounds,
    survey_federation,
    train_centralized,
    wait_for_sites,
)
from fedskew.strategies.factory import FederatedFactory
from fedskew.training import pick_device

app = ServerApp()


def parse_run_config(context: Context) -> RunConfig:
    try:
        return RunConfig.from_run_config(context.run_config)
    except ConfigError:
        # The message names the key, its value and what is valid. Flower logs the failed run's exception with its
        # traceback, which would only point into the config's validation; Python prints no frame under this limit
        # (the process ends with this run).
        sys.tracebacklimit = 0
        raise


def federated_factory(cfg: RunConfig, survey: dict[int, dict], task: TaskShape | ImageDataset, test: ImageDataset | None,
                      device: torch.device) -> FederatedFactory:
    """The run's FederatedFactory: its run config's settings, the sites of its survey, its test split."""
    return FederatedFactory(
        survey, task.num_classes, task.image_shape, task.class_names, cfg.factory, seed=cfg.seed,
        p2p=method_of(cfg).p2p, feature_side=cfg.feature_side, device=device, timeout=cfg.round_timeout,
        min_sites=min(cfg.min_available_sites, len(survey)),
        test_images=None if test is None else test.test_images, test_labels=None if test is None else test.test_labels,
    )  # fmt: skip


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = parse_run_config(context)
    device = pick_device(cfg.device)
    recorder = RunRecorder.create(cfg, multilabel=cfg.label_kind == "multi")
    try:
        test = load_server_test_set(cfg)
        node_ids = wait_for_sites(grid, cfg.min_available_sites, cfg.round_timeout)
        if isinstance(grid, InMemoryGrid):  # simulation: the sites' partition is the server's to check first
            check_partition(cfg, len(node_ids))
        survey, task = survey_federation(grid, node_ids, cfg, test, recorder)
        recorder.name_by_data(run_data_name(cfg, survey, task.class_names))
        print(f"fedskew: {cfg.method} on {recorder.extra['data']}, results in {recorder.path}", flush=True)
        recorder.multilabel = task.multilabel  # with labels = "auto" only the data tells
        recorder.model_card = run_model_card(cfg, task.class_names, task.multilabel, task.image_shape)
        validation = load_server_validation_set(cfg, task)
        num_sites = next(iter(survey.values()))["num-sites"]
        # Flower simulates 2 sites unless told otherwise, and an app cannot change that: say it in the log.
        print(f"fedskew: {len(survey)} site(s) take part (in simulation: --federation-config \"num-supernodes=N\"; "
              "Flower's default is 2)", flush=True)  # fmt: skip
        torch.manual_seed(cfg.seed)
        family = method_of(cfg).family
        recorder.total_rounds = None if family == "factory" else cfg.num_server_rounds  # FederatedFactory counts its own rounds
        if family == "factory":
            strategy = federated_factory(cfg, survey, task, test, device)
            strategy.attach(recorder)
            strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=strategy.num_rounds, timeout=cfg.round_timeout)
            if cfg.factory.fidelity:
                record_fidelity(cfg, recorder, device)
        elif family == "centralized":
            train_centralized(cfg, task, num_sites, device, recorder, validation)
        else:
            run_rounds(grid, cfg, survey, task, test, validation, recorder, device)
    except BaseException as exc:
        # Found before round 1 (a setting the data rules out, too few usable sites): the message says all.
        preflight = isinstance(exc, (ConfigError, SurveyFailed))
        reason = one_line(str(exc) if preflight else f"{type(exc).__name__}: {exc}")
        recorder.write_summary("failed", reason=reason)
        try_write_report(recorder.path)
        print(f"fedskew: run failed: {reason}; results in {recorder.path}", flush=True)
        if preflight:
            sys.tracebacklimit = 0  # as in parse_run_config: no frame of the server's checks in Flower's log
        raise
    recorder.write_summary("completed")
    recorder.plot_curves()
    try_write_report(recorder.path)
    print(f"fedskew: run completed, results in {recorder.path}", flush=True)
