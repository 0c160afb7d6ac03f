"""fedskew ServerApp: parse the run config, survey the sites, build the method's strategy, start it."""

from __future__ import annotations

import sys

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedskew.config import ConfigError, RunConfig
from fedskew.models.model_file import run_model_card
from fedskew.report import try_write_report
from fedskew.results import RunRecorder
from fedskew.server_tasks import (
    agreed_task_shape,
    load_server_test_set,
    load_server_validation_set,
    make_evaluate_fn,
    refuse_sites,
    run_rounds,
    survey_sites,
    train_centralized,
    wait_for_sites,
    write_partition,
)
from fedskew.strategies.factory import run_factory
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


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = parse_run_config(context)
    device = pick_device(cfg.device)
    recorder = RunRecorder.create(cfg, multilabel=cfg.label_kind == "multi")
    print(f"fedskew: {cfg.method} on {cfg.dataset}, results in {recorder.path}", flush=True)
    try:
        test = load_server_test_set(cfg)
        node_ids = wait_for_sites(grid, cfg.min_available_sites, cfg.round_timeout)
        survey = survey_sites(grid, node_ids, cfg.round_timeout)
        task, refused = agreed_task_shape(cfg, survey, test)
        survey = refuse_sites(recorder, survey, refused)
        recorder.multilabel = task.multilabel  # with labels = "auto" only the data tells
        recorder.model_card = run_model_card(cfg, task.class_names, task.multilabel, task.image_shape)
        write_partition(recorder, survey, task.class_names)
        validation = load_server_validation_set(cfg, task)
        num_sites = next(iter(survey.values()))["num-sites"]
        # Flower simulates 2 sites unless told otherwise, and an app cannot change that: say it in the log.
        print(f"fedskew: {len(survey)} site(s) take part (in simulation: --federation-config \"num-supernodes=N\"; "
              "Flower's default is 2)", flush=True)  # fmt: skip
        torch.manual_seed(cfg.seed)
        if cfg.method in ("factory", "factory-p2p"):
            run_factory(grid, cfg, survey, task, test, recorder, device)
        elif cfg.method == "centralized":
            train_centralized(cfg, task, num_sites, device, recorder, validation)
        else:
            run_rounds(grid, cfg, survey, task, test, validation, recorder, device)
    except BaseException as exc:
        recorder.write_summary("failed", reason=f"{type(exc).__name__}: {exc}")
        try_write_report(recorder.path)
        raise
    recorder.write_summary("completed")
    recorder.plot_curves()
    try_write_report(recorder.path)
    print(f"fedskew: run completed, results in {recorder.path}", flush=True)
