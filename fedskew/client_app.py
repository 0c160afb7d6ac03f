"""fedskew ClientApp: each handler loads the site's data and calls a plain function."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.clientapp import ClientApp

from fedskew.client_tasks import (
    evaluate_site, load_site, received_proximal_mu, site_mean_gradient, site_survey, train_site,
)
from fedskew.config import RunConfig
from fedskew.factory.site import UploadRefusal
from fedskew.factory.site_handlers import site_expert, site_scores, site_upload
from fedskew.privacy import privacy_mod
from fedskew.protocol import (
    CONTROL_SHIFT_KEY, ETF_KEY, FACTORY_MESSAGE, GRADIENT_QUERY, P2P_MESSAGE, SCAFFOLD_CONTROL_KEY, SURVEY_QUERY,
    VALIDATION_MESSAGE, handler_name,
)
from fedskew.site_state import SiteState
from fedskew.training import pick_device

app = ClientApp(mods=[privacy_mod])


def received_etf_array(msg: Message) -> np.ndarray | None:
    """FedNCA-ML's server-held ETF travels as its own ArrayRecord, never aggregated or returned."""
    if ETF_KEY not in msg.content.array_records:
        return None
    return msg.content[ETF_KEY].to_torch_state_dict()[ETF_KEY].numpy()


def received_arrays(msg: Message, key: str) -> dict | None:
    """The tensors of the ArrayRecord `key` when the message carries one: SCAFFOLD's server control variate, or
    FedNCA-ML's correction c - c_i (fednca.control-variates)."""
    if key not in msg.content.array_records:
        return None
    return msg.content[key].to_torch_state_dict()


@app.query(handler_name(SURVEY_QUERY))
def survey(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    # A ConfigRecord: the survey carries the class names as well as counts.
    return Message(RecordDict({"survey": ConfigRecord(site_survey(cfg, load_site(cfg, context.node_config)))}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    config = msg.content["config"]
    state, metrics = train_site(
        cfg,
        site,
        msg.content["arrays"].to_torch_state_dict(),
        server_round=int(config["server-round"]),
        proximal_mu=received_proximal_mu(cfg, config),
        etf=received_etf_array(msg),
        site_state=SiteState(context),
        server_control=received_arrays(msg, SCAFFOLD_CONTROL_KEY),
        control_shift=received_arrays(msg, CONTROL_SHIFT_KEY),
    )
    return Message(RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics)}), reply_to=msg)


@app.query(handler_name(GRADIENT_QUERY))
def mean_gradient(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    gradient, weights = site_mean_gradient(cfg, site, msg.content["arrays"].to_torch_state_dict(),
                                           server_round=int(msg.content["config"]["server-round"]), etf=received_etf_array(msg))
    return Message(RecordDict({"arrays": ArrayRecord(gradient), "metrics": MetricRecord(weights)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    metrics = evaluate_site(cfg, site, msg.content["arrays"].to_torch_state_dict(), etf=received_etf_array(msg))
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.train(handler_name(FACTORY_MESSAGE))
def factory_upload(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    try:
        return Message(site_upload(cfg, site, pick_device(cfg.device)), reply_to=msg)
    except UploadRefusal as refusal:
        # A deliberate refusal, not a crash: the server records the reason and goes on without this site.
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(refusal)), reply_to=msg)


@app.train(handler_name(P2P_MESSAGE))
def factory_p2p(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    return Message(site_expert(cfg, site, msg.content, pick_device(cfg.device)), reply_to=msg)


@app.query(handler_name(VALIDATION_MESSAGE))
def factory_validation(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    site = load_site(cfg, context.node_config)
    return Message(site_scores(cfg, site, msg.content, pick_device(cfg.device)), reply_to=msg)
