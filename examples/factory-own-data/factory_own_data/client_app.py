"""A site: the user's own data, FederatedFactory's site side from fedskew.factory.site_handlers (train and
audit the site's generators, upload them) and the survey the server identifies the site by."""

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedskew.factory.site_handlers import site_upload
from fedskew.protocol import FACTORY_MESSAGE, handler_name
from factory_own_data.task import settings, site_data

app = ClientApp()


def this_site(context: Context):
    return site_data(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))


@app.query("survey")
def survey(msg: Message, context: Context) -> Message:
    site = this_site(context)
    counts = np.bincount(site.train_labels, minlength=site.num_classes).tolist()
    return Message(RecordDict({"survey": ConfigRecord({"site-id": site.site_id, "label-counts": counts})}), reply_to=msg)


@app.train(handler_name(FACTORY_MESSAGE))
def upload(msg: Message, context: Context) -> Message:
    run = settings(int(context.run_config["generator-steps"]))
    return Message(site_upload(run, this_site(context), torch.device("cpu")), reply_to=msg)
