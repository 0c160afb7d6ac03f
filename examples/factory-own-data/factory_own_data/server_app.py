"""The server: the sites surveyed for who they are and what they hold, fedskew's FederatedFactory started
with Flower's own `start`, the classifier it trained on synthetic images alone tested on real ones."""

from logging import INFO

from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedskew.strategies import FederatedFactory
from factory_own_data.task import CLASS_NAMES, IMAGE_SHAPE, settings, test_set

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    nodes = list(grid.get_node_ids())
    questions = [Message(RecordDict(), dst_node_id=node, message_type="query.survey") for node in nodes]
    replies = grid.send_and_receive(questions, timeout=60)
    survey = {r.metadata.src_node_id: dict(r.content["survey"]) for r in replies if not r.has_error()}
    run = settings(int(context.run_config["generator-steps"]))
    test_images, test_labels = test_set()
    strategy = FederatedFactory(survey, len(CLASS_NAMES), IMAGE_SHAPE, CLASS_NAMES, run.factory, seed=run.seed,
                                timeout=600, min_sites=len(nodes), test_images=test_images, test_labels=test_labels)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=1)
    log(INFO, "classifier trained on %d synthetic images", result.train_metrics_clientapp[1]["synthetic_images"])
    log(INFO, "final test accuracy: %.4f", result.evaluate_metrics_serverapp[1]["accuracy"])
