"""What the ClientApp's handlers add to the plain functions they call, measured side by side in one process.

    python -m bench.clientapp_cost --calls 20

One simulated site (single-class digit sites, 8 px, 3 local epochs: the tiny-work setting of the overhead
figure in docs/performance.md) trains and validates the same weights `--calls` times through the
ClientApp's `train` and `evaluate` handlers (a Flower Message in, a Message out: the ArrayRecord turned
into a state dict and back, the run config read) and as many times through `train_site` and
`evaluate_site` directly, after warm-up calls; one torch thread. Prints CPU ms per call of each, and of the
pieces a handler adds: the ArrayRecord turned into a state dict, that state dict loaded into the model, a
state dict turned into an ArrayRecord (the reply), and the run config read.
"""

from __future__ import annotations

import argparse
import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedskew.client_app import evaluate, train
from fedskew.client_tasks import evaluate_site, load_site, train_site
from fedskew.config import RunConfig
from fedskew.models.build import build_model

RUN_CONFIG = {"method": "fedavg", "mosaic-grid": 0, "partition": "classes-per-site", "classes-per-site": 1,
              "num-server-rounds": 4, "local-epochs": 3}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # messages outside a Flower runtime
        setattr(TaskIdentity, name, value)
    cfg = RunConfig.from_run_config(RUN_CONFIG)
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 10}, state=RecordDict(),
                      run_config=RUN_CONFIG)  # fmt: skip
    site = load_site(cfg, context.node_config)
    state = build_model(cfg, site.num_classes, site.train_images.shape[1:]).state_dict()

    def message(kind: str) -> Message:
        content = RecordDict({"arrays": ArrayRecord(state), "config": ConfigRecord({"server-round": 2})})
        return Message(content, dst_node_id=1, message_type=kind)

    record, model = ArrayRecord(state), build_model(cfg, site.num_classes, site.train_images.shape[1:])
    sides = {
        "ArrayRecord -> state dict": record.to_torch_state_dict,
        "load_state_dict": lambda: model.load_state_dict(state),
        "state dict -> ArrayRecord": lambda: ArrayRecord(state),
        "run config": lambda: RunConfig.from_run_config(RUN_CONFIG),
        "train handler": lambda: train(message(MessageType.TRAIN), context),
        "train_site": lambda: train_site(cfg, site, state, server_round=2, proximal_mu=0.0),
        "evaluate handler": lambda: evaluate(message(MessageType.EVALUATE), context),
        "evaluate_site": lambda: evaluate_site(cfg, site, state),
    }
    for call in sides.values():  # warm-up: caches, allocator, first-call imports
        call()
    totals = dict.fromkeys(sides, 0.0)
    for _ in range(args.calls):  # interleaved, so machine load hits every side alike
        for name, call in sides.items():
            start = time.process_time()
            call()
            totals[name] += time.process_time() - start
    results = {name: 1000 * total / args.calls for name, total in totals.items()}
    print(" | ".join(f"{name} {ms:.2f} CPU ms" for name, ms in results.items()))
    print(f"handler overhead per call: training {results['train handler'] - results['train_site']:.1f} ms, "
          f"validation {results['evaluate handler'] - results['evaluate_site']:.1f} ms")


if __name__ == "__main__":
    main()
