"""The server: fedskew's FedNCA strategy started with Flower's own `start`, the ETF built for the
user's backbone, the global model evaluated on the server's test set after every round."""

from logging import INFO

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedskew.models.fednca import simplex_etf
from fedskew.strategies import FedNCA
from fednca_own_model.task import NUM_CLASSES, Backbone, build_model, label_accuracy, load_data

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    etf = simplex_etf(NUM_CLASSES, Backbone.feature_dim, seed=0)  # fixed for the whole run
    torch.manual_seed(0)
    model = build_model(etf)
    test = load_data(seed=0, size=512, frequencies=[0.5] * NUM_CLASSES)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        return MetricRecord({"label-accuracy": label_accuracy(model, test)})

    num_sites = len(list(grid.get_node_ids()))
    strategy = FedNCA(etf, fraction_evaluate=1.0, min_available_nodes=num_sites, min_train_nodes=num_sites,
                      min_evaluate_nodes=num_sites, timeout=300)
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=int(context.run_config["num-server-rounds"]),
        train_config=ConfigRecord({"local-epochs": int(context.run_config["local-epochs"]),
                                   "lr": float(context.run_config["lr"])}),
        evaluate_fn=evaluate,
    )
    final = result.evaluate_metrics_serverapp[max(result.evaluate_metrics_serverapp)]
    log(INFO, "final test label-accuracy: %.4f", final["label-accuracy"])
