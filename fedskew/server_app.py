"""fedskew ServerApp: parse the run config, survey the sites, build the method's strategy, start it."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedskew.config import RunConfig
from fedskew.data.sites import load_task_dataset
from fedskew.models.build import build_model, server_etf
from fedskew.results import RunRecorder
from fedskew.server_tasks import make_evaluate_fn, survey_sites, train_centralized, wait_for_sites, write_partition
from fedskew.strategies import build_strategy
from fedskew.training import pick_device

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_run_config(context.run_config)
    device = pick_device(cfg.device)
    dataset = load_task_dataset(cfg)
    recorder = RunRecorder.create(cfg, multilabel=dataset.multilabel)
    print(f"fedskew: {cfg.method} on {dataset.name}, results in {recorder.path}", flush=True)
    try:
        node_ids = wait_for_sites(grid, cfg.min_available_sites, cfg.round_timeout)
        survey = survey_sites(grid, node_ids, cfg.round_timeout)
        write_partition(recorder, survey, dataset.class_names)
        num_sites = next(iter(survey.values()))["num-sites"]
        torch.manual_seed(cfg.seed)
        etf = server_etf(cfg, dataset.num_classes, dataset.image_shape) if cfg.method == "fednca" else None
        model = build_model(cfg, dataset.num_classes, dataset.image_shape, etf=etf).to(device)
        if cfg.method == "centralized":
            train_centralized(cfg, model, num_sites, device, recorder)
        else:
            strategy = build_strategy(cfg, len(node_ids), etf=etf)
            strategy.attach(recorder)
            strategy.start(
                grid=grid,
                initial_arrays=ArrayRecord(model.state_dict()),
                num_rounds=cfg.num_server_rounds,
                timeout=cfg.round_timeout,
                train_config=ConfigRecord({"local-epochs": cfg.local_epochs}),
                evaluate_fn=make_evaluate_fn(
                    model, dataset, device, recorder, lambda: (strategy.last_train_metrics, strategy.last_val_metrics)
                ),
            )
    except BaseException as exc:
        recorder.write_summary("failed", reason=f"{type(exc).__name__}: {exc}")
        raise
    recorder.write_summary("completed")
    recorder.plot_curves()
    print(f"fedskew: run completed, results in {recorder.path}", flush=True)
