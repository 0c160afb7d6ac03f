"""fedskew's strategies in someone else's ServerApp: built from plain arguments, started with Flower's own
`start`, never attached to a RunRecorder; they still screen the replies and hold the floor, and a validation
report may hold the user's own metrics. Sites here are a fake Grid that answers like ClientApps would."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import Result
from flwr.supercore.task_identity import TaskIdentity

from fedskew.drift import SCAFFOLD_DELTA_PREFIX
from fedskew.fednca_site import etf_echo, etf_from_message
from fedskew.strategies import FedDyn, FedNCA, RecordedFedAvg, Scaffold

ETF = np.array([[1.0, -1.0]], dtype=np.float32)  # a simplex ETF for 2 classes in 1 dimension


def one_weight(value: float) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.full(1, value, np.float32))})


class ThreeSites:
    """Nodes 1-3: site k trains the sent weight w to w + k (SCAFFOLD's delta c = 1) on 10 examples, or to NaN when
    it is `broken`; it validates with the user's own metric 'loss' = k."""

    def __init__(self, broken: int | None = None):
        self.broken = broken
        self.etfs_seen: list[torch.Tensor] = []

    def get_node_ids(self) -> list[int]:
        return [1, 2, 3]

    def send_and_receive(self, messages, timeout=None):
        return [Message(self.answer(m.metadata.dst_node_id, m.metadata.message_type, m.content), reply_to=m)
                for m in messages]

    def answer(self, node: int, message_type: str, content: RecordDict) -> RecordDict:
        if "etf" in content.array_records:
            self.etfs_seen.append(etf_from_message(content, num_classes=2))
        if message_type == MessageType.EVALUATE:
            return RecordDict({"metrics": MetricRecord({"num-examples": 10, "loss": float(node)})})
        sent = content["arrays"].to_torch_state_dict()["w"].item()
        arrays = {"w": np.full(1, np.nan if node == self.broken else sent + node, np.float32)}
        if "scaffold-control" in content.array_records:
            arrays[SCAFFOLD_DELTA_PREFIX + "w"] = np.ones(1, np.float32)
        metrics = {"num-examples": 10, **(etf_echo(ETF) if "etf" in content.array_records else {})}
        return RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                           "metrics": MetricRecord(metrics)})


@pytest.fixture(autouse=True)
def messages_outside_a_flower_runtime(monkeypatch):
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


# Two rounds from w = 0; the sites' mean update is w + 2 (sites add 1, 2, 3, equally weighted).
# FedDyn, alpha 0.5, every site answering: round 1 x = 0, mean y = 2: h = -0.5 * 2 = -1, theta = 2 + 1 / 0.5 = 4;
# round 2 x = 4, mean y = 6: h = -1 - 0.5 * 2 = -2, theta = 6 + 2 / 0.5 = 10.
@pytest.mark.parametrize("strategy, final_w", [
    (RecordedFedAvg(), 4.0),
    (FedNCA(ETF), 4.0),
    (FedNCA(torch.from_numpy(ETF)), 4.0),
    (Scaffold({"w": torch.Size([1])}, num_sites=3), 4.0),
    (FedDyn({"w": torch.Size([1])}, num_sites=3, alpha=0.5), 10.0),
], ids=["fedavg", "fednca-numpy-etf", "fednca-torch-etf", "scaffold", "feddyn"])
def test_a_strategy_never_attached_runs_flowers_start_and_returns_its_result(strategy, final_w):
    sites = ThreeSites()
    result = strategy.start(grid=sites, initial_arrays=one_weight(0.0), num_rounds=2, timeout=5)
    assert isinstance(result, Result)
    assert result.arrays.to_torch_state_dict()["w"].item() == pytest.approx(final_w)
    # The user's own validation metric, averaged over the sites by examples: (1 + 2 + 3) / 3.
    assert [dict(result.evaluate_metrics_clientapp[r])["loss"] for r in (1, 2)] == pytest.approx([2.0, 2.0])
    if isinstance(strategy, Scaffold):  # c = 0 + 1 * mean delta c (1), twice
        assert strategy.control["w"].item() == pytest.approx(2.0)
    if isinstance(strategy, FedNCA):  # every training and evaluation message carried the server's ETF
        assert len(sites.etfs_seen) == 12 and all(torch.equal(e, torch.from_numpy(ETF)) for e in sites.etfs_seen)


def test_a_strategy_never_attached_still_refuses_an_unusable_reply_and_holds_the_floor():
    strategy = FedNCA(ETF, min_available_nodes=2, min_train_nodes=2)
    result = strategy.start(grid=ThreeSites(broken=3), initial_arrays=one_weight(0.0), num_rounds=1, timeout=5)
    assert result.arrays.to_torch_state_dict()["w"].item() == pytest.approx(1.5)  # sites 1 and 2 only
    (dropped,) = strategy.dropped
    assert dropped["round"] == 1 and "site 3: round 1 update refused: array 'w' holds NaN" in dropped["reason"]
    with pytest.raises(RuntimeError, match="2 of 3 site\\(s\\) sent a usable training reply, fewer than "
                                           r"min-available-sites = 3 .*site 3: round 1 update refused"):
        FedNCA(ETF, min_available_nodes=3, min_train_nodes=3).start(
            grid=ThreeSites(broken=3), initial_arrays=one_weight(0.0), num_rounds=1, timeout=5)



class SitesAnsweringInOrder:
    """Nodes 1-6, each training the sent weights into its own float32 update (magnitudes 1e-3 to 1e3, so that a
    float32 sum depends on its order) on its own number of examples; replies come back in `order`."""

    def __init__(self, order: list[int]):
        self.order = order
        rng = np.random.default_rng(0)
        self.updates = {node: (rng.standard_normal(256) * 10.0 ** rng.integers(-3, 4, 256)).astype(np.float32)
                        for node in range(1, 7)}

    def get_node_ids(self) -> list[int]:
        return list(self.order)

    def send_and_receive(self, messages, timeout=None):
        by_node = {m.metadata.dst_node_id: m for m in messages}
        return [Message(RecordDict({"arrays": ArrayRecord({"w": Array(self.updates[node])}),
                                    "metrics": MetricRecord({"num-examples": 10 + node})}), reply_to=by_node[node])
                for node in self.order if node in by_node]


def test_the_average_does_not_depend_on_the_order_the_sites_answer_in():
    # Flower samples the nodes in a random order and sums float32 updates in the order of the replies; the same
    # seed must give the same model whatever that order.
    start = ArrayRecord({"w": Array(np.zeros(256, np.float32))})
    averages = [RecordedFedAvg(fraction_evaluate=0.0).start(grid=SitesAnsweringInOrder(order), initial_arrays=start,
                                                            num_rounds=1, timeout=5).arrays["w"].numpy()
                for order in ([1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1], [3, 1, 6, 2, 5, 4])]
    assert all(np.array_equal(averages[0], other) for other in averages[1:])


# --- FederatedFactory: one custom round through start, its sites answering as in tests/test_hostile.py ---------

from test_hostile import CFG, SITES, TASK, ScriptedGrid, expert_reply, honest, impostor, survey_of  # noqa: E402, F401 - honest: a fixture

from fedskew.factory.classifier import build_classifier  # noqa: E402
from fedskew.models.ensemble import ExpertEnsemble  # noqa: E402
from fedskew.protocol import P2P_MESSAGE, encode_modules  # noqa: E402
from fedskew.strategies import FederatedFactory  # noqa: E402
from fedskew.strategies.recording import TooFewSites  # noqa: E402
from fedskew.training import evaluate  # noqa: E402

# A few synthetic images from a few sampler steps and one epoch: enough to train a classifier through every step.
TINY_FACTORY = CFG.factory.model_copy(update={"samples_per_class": 8, "sampler_steps": 2, "classifier_epochs": 1,
                                              "classifier_val_fraction": 0.25})
TEST_IMAGES = np.random.default_rng(0).random((6, *TASK.image_shape), dtype=np.float32)
TEST_LABELS = np.array([0, 1] * 3)


def factory_sites(honest):
    """Node 11 (site 0) uploads its generator; node 12 (site 1) sends site 0's under site 0's ids."""
    return ScriptedGrid(lambda node, _: encode_modules(*honest[0]) if node == 11 else impostor(honest))


def test_federated_factory_never_attached_runs_flowers_start_refuses_the_impostor_and_returns_its_classifier(
    honest, tmp_path
):
    strategy = FederatedFactory(survey_of(SITES), TASK.num_classes, TASK.image_shape, TASK.class_names, TINY_FACTORY,
                                feature_side=CFG.feature_side, timeout=5, test_images=TEST_IMAGES, test_labels=TEST_LABELS,
                                output_dir=tmp_path)  # fmt: skip
    result = strategy.start(grid=factory_sites(honest), initial_arrays=ArrayRecord(), num_rounds=1)
    assert isinstance(result, Result)
    (rejection,) = strategy.report["rejected"]
    assert rejection["node"] == "12" and "claims site-id 0, but its node answered the survey as site 1" in rejection["reason"]
    assert [m["module-id"] for m in strategy.report["modules"]] == ["site0-class0"]
    # The classifier trained on 8 synthetic images of the one class a generator was accepted for.
    assert result.train_metrics_clientapp[1]["synthetic_images"] == 8
    assert (tmp_path / "library" / "manifest.json").is_file() and (tmp_path / "synthetic.safetensors").is_file()
    # Result.arrays is that classifier, and the server-side metrics are its own on the test images.
    model = build_classifier(TINY_FACTORY.classifier, TASK.image_shape, TASK.num_classes, CFG.feature_side)
    model.load_state_dict(result.arrays.to_torch_state_dict())
    expected = evaluate(model, TEST_IMAGES, TEST_LABELS, device=torch.device("cpu"))
    assert dict(result.evaluate_metrics_serverapp[1])["accuracy"] == expected["accuracy"]


def test_federated_factory_never_attached_ends_below_its_floor_naming_the_rejection(honest):
    strategy = FederatedFactory(survey_of(SITES), TASK.num_classes, TASK.image_shape, TASK.class_names, TINY_FACTORY,
                                feature_side=CFG.feature_side, timeout=5, min_sites=2)  # fmt: skip
    with pytest.raises(TooFewSites, match=r"round 1: 1 of 2 site\(s\) sent a usable upload, fewer than min-available-sites "
                                          r"= 2 .*site 1 \(node 12\): upload rejected: the upload claims site-id 0"):
        strategy.start(grid=factory_sites(honest), initial_arrays=ArrayRecord(), num_rounds=1)
    with pytest.raises(ValueError, match="FederatedFactory runs 1 round"):
        strategy.start(grid=factory_sites(honest), initial_arrays=ArrayRecord(), num_rounds=3)


def test_federated_factory_with_p2p_returns_the_product_of_experts_and_the_experts_mean_metrics(honest):
    experts = {11: build_classifier("small-cnn", TASK.image_shape, TASK.num_classes, CFG.feature_side).state_dict(),
               12: build_classifier("small-cnn", TASK.image_shape, TASK.num_classes, CFG.feature_side).state_dict()}

    def answer(node, message):
        if message.metadata.message_type == P2P_MESSAGE:  # node 11 reports loss 0.25, node 12 loss 0.5
            return expert_reply(experts[node], {"train_loss": (node - 10) / 4, "val_accuracy": 0.5})
        return encode_modules(*honest[SITES[node][0]])

    strategy = FederatedFactory(survey_of(SITES), TASK.num_classes, TASK.image_shape, TASK.class_names, TINY_FACTORY,
                                p2p=True, feature_side=CFG.feature_side, timeout=5, test_images=TEST_IMAGES,
                                test_labels=TEST_LABELS)  # fmt: skip
    result = strategy.start(grid=ScriptedGrid(answer), initial_arrays=ArrayRecord(), num_rounds=2)
    assert strategy.report["rejected"] == [] and strategy.p2p_report["rejected"] == []
    assert dict(result.train_metrics_clientapp[2]) == {"train_loss": 0.375, "val_accuracy": 0.5}
    # Result.arrays is the Product of the two experts as sent, in site order; round 2's server metrics are its own.
    sent = ExpertEnsemble([build_classifier("small-cnn", TASK.image_shape, TASK.num_classes, CFG.feature_side)
                           for _ in experts])  # fmt: skip
    for expert, state in zip(sent.experts, experts.values()):
        expert.load_state_dict(state)
    arrays = result.arrays.to_torch_state_dict()
    assert set(arrays) == set(sent.state_dict()) and all(torch.equal(arrays[k], v) for k, v in sent.state_dict().items())
    expected = evaluate(sent, TEST_IMAGES, TEST_LABELS, device=torch.device("cpu"))
    assert dict(result.evaluate_metrics_serverapp[2])["accuracy"] == expected["accuracy"]
