"""SCAFFOLD and FedDyn: the site and server updates on hand-worked numbers, and the site state
that carries them between rounds."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from test_privacy import SitesOnline
from torch import nn

from fedskew.client_tasks import drift_correction
from fedskew.config import RunConfig
from fedskew.drift import feddyn_server_update, scaffold_server_update, scaffold_site_update
from fedskew.results import RunRecorder
from fedskew.site_state import SiteState, SiteStateError
from fedskew.strategies.drift import FedDyn


class OneWeight(nn.Module):
    """Loss 0.5 w^2: the gradient is w itself, so every step can be worked out by hand."""

    def __init__(self, w: float):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w]))

    def loss(self) -> torch.Tensor:
        return 0.5 * (self.w**2).sum()


class DictStore:
    def __init__(self, **initial):
        self.saved = dict(initial)

    def get(self, name):
        return self.saved.get(name)

    def put(self, name, tensors):
        self.saved[name] = tensors


def run_plain_sgd(model: OneWeight, steps: int, lr: float, before_step) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        model.loss().backward()
        before_step()
        optimizer.step()


def w(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([value])}


def test_scaffold_site_round_by_hand():
    # c_i = 0, c = 0.5, x = 2, lr 0.1, 2 steps of g + (c - c_i) = w + 0.5:
    # w1 = 2 - 0.1 * 2.5 = 1.75; w2 = 1.75 - 0.1 * 2.25 = 1.525
    # c_i+ = c_i - c + (x - y) / (K lr) = -0.5 + 0.475 / 0.2 = 1.875 (the mean raw gradient (2 + 1.75) / 2)
    cfg = RunConfig.from_run_config({"method": "scaffold", "lr": 0.1, "mosaic-grid": 2})
    model, store = OneWeight(2.0), DictStore()
    hook, finish, restored = drift_correction(cfg, model, store, w(0.5), steps=2)
    assert not restored
    run_plain_sgd(model, 2, 0.1, hook)
    assert model.w.item() == pytest.approx(1.525, abs=1e-6)
    reply = finish()
    assert reply["scaffold-control-delta.w"].item() == pytest.approx(1.875, abs=1e-5)
    assert store.saved["scaffold-site-control"]["w"].item() == pytest.approx(1.875, abs=1e-5)


def test_scaffold_updates_by_hand():
    new, delta = scaffold_site_update(w(1.0), w(3.0), w(2.0), w(1.0), steps=5, lr=0.1)
    assert new["w"].item() == pytest.approx(1 - 3 + 1 / 0.5) and delta["w"].item() == pytest.approx(-1.0)
    # c+ = c + |S|/N * mean(delta_c): half of the sites answered
    assert scaffold_server_update(w(3.0), w(-1.0), participation=0.5)["w"].item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="steps >= 1 and lr > 0"):
        scaffold_site_update(w(1.0), w(3.0), w(2.0), w(1.0), steps=0, lr=0.1)


def test_feddyn_site_round_by_hand():
    # h_i = 0.5, alpha 0.1, x = 2, lr 0.1, gradient w - h_i + alpha (w - x):
    # w1 = 2 - 0.1 * 1.5 = 1.85; w2 = 1.85 - 0.1 * (1.85 - 0.5 + 0.1 * -0.15) = 1.7165
    # h_i+ = h_i - alpha (y - x) = 0.5 + 0.1 * 0.2835 = 0.52835
    cfg = RunConfig.from_run_config({"method": "feddyn", "lr": 0.1, "feddyn-alpha": 0.1, "mosaic-grid": 2})
    model, store = OneWeight(2.0), DictStore(**{"feddyn-site-gradient": w(0.5)})
    hook, finish, restored = drift_correction(cfg, model, store, None, steps=2)
    assert restored
    run_plain_sgd(model, 2, 0.1, hook)
    assert model.w.item() == pytest.approx(1.7165, abs=1e-6)
    assert finish() == {}
    assert store.saved["feddyn-site-gradient"]["w"].item() == pytest.approx(0.52835, abs=1e-6)


def test_feddyn_server_update_by_hand():
    # h+ = h - alpha * participation * (mean_y - x) = 0 - 0.1 * 1 * (1.7165 - 2) = 0.02835
    # theta = mean_y - h+ / alpha = 1.7165 - 0.2835 = 1.433
    h, theta = feddyn_server_update(w(0.0), w(2.0), w(1.7165), alpha=0.1, participation=1.0)
    assert h["w"].item() == pytest.approx(0.02835, abs=1e-6)
    assert theta["w"].item() == pytest.approx(1.433, abs=1e-5)


def test_scaffold_refuses_a_control_variate_for_another_model():
    cfg = RunConfig.from_run_config({"method": "scaffold", "mosaic-grid": 2})
    with pytest.raises(ValueError, match=r"server's SCAFFOLD control variate does not match.*missing \['w'\]"):
        drift_correction(cfg, OneWeight(1.0), DictStore(), {"v": torch.zeros(1)}, steps=1)


def site_context(node_config: dict, state: RecordDict | None = None) -> Context:
    return Context(run_id=7, node_id=1, node_config=node_config, state=state or RecordDict(), run_config={})


def test_site_state_lives_in_context_state_and_on_disk_with_state_dir(tmp_path):
    in_memory = SiteState(site_context({}))
    in_memory.put("x", w(1.5))
    assert in_memory.get("x")["w"].item() == 1.5 and "x" in in_memory.records.array_records

    SiteState(site_context({"state-dir": str(tmp_path)})).put("x", w(2.5))
    assert (tmp_path / "run-7" / "x.safetensors").is_file()
    # a restarted SuperNode: an empty context, the same state-dir
    assert SiteState(site_context({"state-dir": str(tmp_path)})).get("x")["w"].item() == 2.5
    (tmp_path / "run-7" / "x.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(SiteStateError, match=r"run-7/x.safetensors is unreadable.*delete it"):
        SiteState(site_context({"state-dir": str(tmp_path)})).get("x")


def test_feddyn_strategy_corrects_the_average_with_the_share_of_sites_that_answered(tmp_path, monkeypatch):
    # Two of four sites answer, one fails: the server update sees participation 2/4, worked out by hand.
    # alpha 0.5, h = 0, sent x = 1, mean y = (2 + 4) / 2 = 3: h+ = -0.5 * 0.5 * (3 - 1) = -0.5;
    # theta = 3 - h+ / alpha = 4. Keys outside the server state (a BN counter) stay the plain average.
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # messages outside a Flower runtime
        monkeypatch.setattr(TaskIdentity, name, value)
    strategy = FedDyn({"w": torch.Size([1])}, num_sites=4, alpha=0.5, fraction_train=1.0, fraction_evaluate=0.0)
    strategy.attach(RunRecorder.create(RunConfig(), multilabel=True, base=tmp_path))
    sent = ArrayRecord({"w": Array(np.ones(1, np.float32)), "n": Array(np.zeros(1, np.float32))})
    (outgoing, *_) = strategy.configure_train(1, sent, ConfigRecord(), SitesOnline(4))

    def reply(w: float) -> Message:
        arrays = ArrayRecord({"w": Array(np.full(1, w, np.float32)), "n": Array(np.full(1, w, np.float32))})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 10})}), reply_to=outgoing)

    failed = Message(Error(code=0, reason="site went offline"), reply_to=outgoing)
    arrays, _ = strategy.aggregate_train(1, [reply(2.0), reply(4.0), failed])
    new = arrays.to_torch_state_dict()
    assert new["w"].item() == pytest.approx(4.0) and new["n"].item() == pytest.approx(3.0)
    assert strategy.h["w"].item() == pytest.approx(-0.5)
