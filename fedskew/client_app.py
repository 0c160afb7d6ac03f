"""fedskew ClientApp: each handler loads the site's data and calls a plain function."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.clientapp import ClientApp

from fedskew.client_tasks import evaluate_site, load_site, site_survey, train_site
from fedskew.config import RunConfig
from fedskew.factory.site import MemorizationRefusal
from fedskew.strategies.factory import site_expert, site_upload
from fedskew.strategies.fednca import ETF_KEY
from fedskew.training import pick_device

app = ClientApp()


def received_etf_array(msg: Message) -> np.ndarray | None:
    """FedNCA-ML's server-held ETF travels as its own ArrayRecord, never aggregated or returned."""
    if ETF_KEY not in msg.content.array_records:
        return None
    return msg.content[ETF_KEY].to_torch_state_dict()[ETF_KEY].numpy()


@app.query("site_survey")
def survey(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    return Message(RecordDict({"survey": MetricRecord(site_survey(cfg, load_site(cfg, context.node_config)))}), reply_to=msg)


OPTIMIZER_STATE_KEY = "optimizer-state"


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    config = msg.content["config"]
    # FedNCA-ML's AdamW moments can stay at the site between rounds: node state persists, it is never sent.
    optimizer_state = None
    if cfg.method == "fednca" and cfg.fednca.keep_optimizer_state:
        kept = context.state.array_records.get(OPTIMIZER_STATE_KEY)
        optimizer_state = kept.to_torch_state_dict() if kept is not None else {}
    state, metrics = train_site(
        cfg,
        site,
        msg.content["arrays"].to_torch_state_dict(),
        server_round=int(config["server-round"]),
        proximal_mu=float(config.get("proximal-mu", 0.0)),
        etf=received_etf_array(msg),
        optimizer_state=optimizer_state,
    )
    if optimizer_state is not None:
        context.state[OPTIMIZER_STATE_KEY] = ArrayRecord(optimizer_state)
    return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    metrics = evaluate_site(cfg, site, msg.content["arrays"].to_torch_state_dict(), etf=received_etf_array(msg))
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.train("factory")
def factory_upload(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    try:
        return Message(site_upload(cfg, site, pick_device(cfg.device)), reply_to=msg)
    except MemorizationRefusal as refusal:
        # A deliberate refusal, not a crash: the server records the reason and goes on without this site.
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(refusal)), reply_to=msg)


@app.train("p2p")
def factory_p2p(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    return Message(site_expert(cfg, site, msg.content, pick_device(cfg.device)), reply_to=msg)
