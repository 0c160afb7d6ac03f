"""fedskew ClientApp: each handler loads the site's data and calls a plain function. The weight-averaging
methods' replies (`train_reply`, `mean_gradient_reply`, `evaluate_reply`) take the message content and the site's
data, so an in-process grid (bench.fednca_search) answers with the very code a SuperNode runs."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.clientapp import ClientApp

from fedskew.client_tasks import (
    TensorStore, evaluate_site, load_site, received_proximal_mu, site_mean_gradient, site_survey, train_site,
)
from fedskew.config import RunConfig
from fedskew.data.sites import SiteData
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


def received_etf_array(content: RecordDict) -> np.ndarray | None:
    """FedNCA-ML's server-held ETF travels as its own ArrayRecord, never aggregated or returned."""
    if ETF_KEY not in content.array_records:
        return None
    return content[ETF_KEY].to_torch_state_dict()[ETF_KEY].numpy()


def received_arrays(content: RecordDict, key: str) -> dict | None:
    """The tensors of the ArrayRecord `key` when the content carries one: SCAFFOLD's server control variate, or
    FedNCA-ML's correction c - c_i (fednca.control-variates)."""
    if key not in content.array_records:
        return None
    return content[key].to_torch_state_dict()


@app.query(handler_name(SURVEY_QUERY))
def survey(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    # A ConfigRecord: the survey carries the class names as well as counts.
    return Message(RecordDict({"survey": ConfigRecord(site_survey(cfg, load_site(cfg, context.node_config)))}), reply_to=msg)


def train_reply(cfg: RunConfig, site: SiteData, content: RecordDict, site_state: TensorStore) -> RecordDict:
    """A training message's reply: the site's round of `train_site` from the content's global weights."""
    config = content["config"]
    state, metrics = train_site(
        cfg,
        site,
        content["arrays"].to_torch_state_dict(),
        server_round=int(config["server-round"]),
        proximal_mu=received_proximal_mu(cfg, config),
        etf=received_etf_array(content),
        site_state=site_state,
        server_control=received_arrays(content, SCAFFOLD_CONTROL_KEY),
        control_shift=received_arrays(content, CONTROL_SHIFT_KEY),
    )
    return RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics)})


def mean_gradient_reply(cfg: RunConfig, site: SiteData, content: RecordDict) -> RecordDict:
    """A gradient query's reply (fednca.control-variates): the site's mean gradient at the content's weights."""
    gradient, weights = site_mean_gradient(cfg, site, content["arrays"].to_torch_state_dict(),
                                           server_round=int(content["config"]["server-round"]),
                                           etf=received_etf_array(content))
    return RecordDict({"arrays": ArrayRecord(gradient), "metrics": MetricRecord(weights)})


def evaluate_reply(cfg: RunConfig, site: SiteData, content: RecordDict) -> RecordDict:
    """An evaluation message's reply: the global weights' validation report on the site's split."""
    metrics = evaluate_site(cfg, site, content["arrays"].to_torch_state_dict(), etf=received_etf_array(content))
    return RecordDict({"metrics": MetricRecord(metrics)})


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    reply = train_reply(cfg, load_site(cfg, context.node_config), msg.content, SiteState(context))
    return Message(reply, reply_to=msg)


@app.query(handler_name(GRADIENT_QUERY))
def mean_gradient(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    return Message(mean_gradient_reply(cfg, load_site(cfg, context.node_config), msg.content), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg = RunConfig.from_run_config(context.run_config)
    return Message(evaluate_reply(cfg, load_site(cfg, context.node_config), msg.content), reply_to=msg)


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
