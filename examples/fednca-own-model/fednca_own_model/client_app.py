"""A site: the user's own model and data, FedNCA-ML's site side from fedskew.fednca_site (the ETF
read from the server's message, the model around the backbone, the loss, the ETF's echo)."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedskew.fednca_site import etf_echo, etf_from_message
from fednca_own_model.task import NUM_CLASSES, build_model, label_accuracy, site_data, train

app = ClientApp()


def global_model(msg: Message):
    """The server's model: the ETF from the message, the global weights loaded."""
    etf = etf_from_message(msg.content, NUM_CLASSES)
    model = build_model(etf)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model, etf


@app.train()
def train_site(msg: Message, context: Context) -> Message:
    model, etf = global_model(msg)
    loader = site_data(int(context.node_config["partition-id"]))
    config = msg.content["config"]
    loss = train(model, loader, epochs=int(config["local-epochs"]), lr=float(config["lr"]))
    # The echo lets the server confirm that this site trained against its ETF.
    metrics = MetricRecord({"train-loss": loss, "num-examples": len(loader.dataset), **etf_echo(etf)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate_site(msg: Message, context: Context) -> Message:
    model, _ = global_model(msg)
    loader = site_data(int(context.node_config["partition-id"]))
    metrics = MetricRecord({"label-accuracy": label_accuracy(model, loader), "num-examples": len(loader.dataset)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
