"""FedNCA-ML's control variates (fednca.control-variates): the server's c and each site's correction on
hand-worked numbers, the site's mean gradient against the gradient taken directly, the correction's hook,
and the strategy's exchange with sites that answer well, badly or not at all."""

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from test_drift import OneWeight, run_plain_sgd, w
from test_privacy import SitesOnline

from fedskew.client_tasks import _site_model, local_optimisation, site_mean_gradient, train_site
from fedskew.config import RunConfig
from fedskew.data.sites import simulated_site
from fedskew.drift import control_shifts, gradient_shift, weighted_control
from fedskew.models.build import build_model, server_etf
from fedskew.results import RunRecorder
from fedskew.strategies.fednca import CONTROL_SHIFT_KEY, ETF_KEY, GRADIENT_QUERY, FedNCA
from fedskew.strategies.recording import TooFewSites
from fedskew.training import make_loader

CORRECTED = {"method": "fednca", "mosaic-grid": 2, "fednca.control-variates": True}


def test_server_control_and_site_shifts_by_hand():
    # c = (10 * 1 + 30 * 3) / 40 = 2.5; shifts c - c_i = 1.5 and -0.5; weights sum to the mean.
    controls, weights = {"a": w(1.0), "b": w(3.0)}, {"a": 10, "b": 30}
    shifts = control_shifts(controls, weights)
    assert weighted_control(controls, weights)["w"].item() == pytest.approx(2.5)
    assert shifts["a"]["w"].item() == pytest.approx(1.5) and shifts["b"]["w"].item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="at least one site"):
        weighted_control({}, {})


def test_the_shift_is_added_to_every_gradient():
    # Loss 0.5 w^2 from w = 2, lr 0.1, gradient w + 1: w1 = 2 - 0.3 = 1.7, w2 = 1.7 - 0.27 = 1.43.
    model = OneWeight(2.0)
    run_plain_sgd(model, steps=2, lr=0.1, before_step=gradient_shift(model, w(1.0), "test shift"))
    assert model.w.item() == pytest.approx(1.43)


@pytest.mark.parametrize("shift, message", [
    ({"w": torch.zeros(2)}, r"test shift: 'w' has shape \(2,\); valid: finite values of the parameter's shape \(1,\)"),
    ({"w": torch.tensor([float("nan")])}, r"'w' has shape \(1,\) and NaN or infinite values"),
    ({"v": torch.zeros(1)}, r"test shift does not match the model's parameters: missing \['w'\], unknown \['v'\]"),
])
def test_a_malformed_shift_is_refused_with_what_is_wrong(shift, message):
    with pytest.raises(ValueError, match=message):
        gradient_shift(OneWeight(2.0), shift, "test shift")


def test_a_sites_mean_gradient_is_its_loss_gradient_at_the_global_weights():
    # One batch holds the whole site, so the mean over batches is the one gradient, taken here directly.
    cfg = RunConfig.from_run_config({**CORRECTED, "batch-size": 4096})
    site = simulated_site(cfg, 0, 3)
    state, etf = model_state(cfg, site)
    model = _site_model(cfg, site, state, etf)
    gradient, weights = site_mean_gradient(cfg, site, state, server_round=1, etf=etf)
    assert weights["num-examples"] == len(site.train_labels)
    _, _, loss_fn = local_optimisation(cfg, model, 1, 1, augment_seed=0)
    (x, y), = make_loader(site.train_images, site.train_labels, 4096, shuffle=False)
    model.train()
    loss_fn(model, x, y).backward()
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert gradient.keys() == trainable.keys()
    for name, p in trainable.items():
        # float32 sums of the same terms in the same order: equal up to rounding
        torch.testing.assert_close(gradient[name], p.grad, rtol=1e-5, atol=1e-6)
    assert any(g.abs().max() > 0 for g in gradient.values())


def model_state(cfg, site):
    """A FedNCA-ML model's initial weights (seed 0) and its ETF, as the server sends them."""
    torch.manual_seed(0)
    etf = server_etf(cfg, site.num_classes, site.train_images.shape[1:])
    return build_model(cfg, site.num_classes, site.train_images.shape[1:], etf=etf).state_dict(), etf.numpy()


def test_a_site_sends_its_gradient_and_takes_a_correction_only_when_its_run_config_says_so():
    cfg = RunConfig.from_run_config({"method": "fednca", "mosaic-grid": 2})
    site = simulated_site(cfg, 0, 3)
    state, etf = model_state(cfg, site)
    with pytest.raises(ValueError, match="asks for this site's mean gradient, but this site's run config has method "
                                         "'fednca' with fednca.control-variates off"):
        site_mean_gradient(cfg, site, state, server_round=1, etf=etf)
    with pytest.raises(ValueError, match="carries a gradient correction, but this site's run config"):
        train_site(cfg, site, state, server_round=1, proximal_mu=0.0, etf=etf, control_shift={})


def test_control_variates_are_refused_beside_differential_privacy():
    with pytest.raises(ValueError, match=r"key 'fednca.control-variates' = True is invalid; valid: false with "
                                         r"dp.mode = 'local' \(each site's mean gradient would reach the server"):
        RunConfig.from_run_config({**CORRECTED, "dp.mode": "local", "dp.noise-multiplier": 1.0})


class GradientSites(SitesOnline):
    """Sites 1-3 online; each answers the gradient query with `answers[node]` (a RecordDict or an Error; None:
    no answer before the timeout)."""

    def __init__(self, answers):
        super().__init__(len(answers))
        self.answers = answers
        self.queries = []

    def send_and_receive(self, messages, timeout=None):
        self.queries = list(messages)
        return [Message(self.answers[m.metadata.dst_node_id], reply_to=m) for m in messages
                if self.answers[m.metadata.dst_node_id] is not None]


def gradient_answer(value: float, examples: int) -> RecordDict:
    return RecordDict({"arrays": ArrayRecord({"w": Array(np.full(1, value, np.float32))}),
                       "metrics": MetricRecord({"num-examples": examples})})


def test_the_strategy_sends_each_answering_site_its_correction_and_leaves_out_a_bad_answer(tmp_path, monkeypatch):
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # messages outside a Flower runtime
        monkeypatch.setattr(TaskIdentity, name, value)
    strategy = FedNCA(torch.eye(2), control_layout={"w": (1,)}, timeout=5, fraction_train=1.0, fraction_evaluate=0.0,
                      min_available_nodes=1, min_train_nodes=1, weighted_by_key="num-examples")
    recorder = RunRecorder.create(RunConfig(), multilabel=True, base=tmp_path)
    strategy.attach(recorder)
    nan = RecordDict({"arrays": ArrayRecord({"w": Array(np.full(1, np.nan, np.float32))}),
                      "metrics": MetricRecord({"num-examples": 5})})
    grid = GradientSites({1: gradient_answer(1.0, 10), 2: gradient_answer(3.0, 30), 3: nan})
    sent = ArrayRecord({"w": Array(np.ones(1, np.float32))})
    messages = strategy.configure_train(1, sent, ConfigRecord(), grid)
    assert {q.metadata.message_type for q in grid.queries} == {GRADIENT_QUERY}
    assert all(ETF_KEY in q.content.array_records and q.content["config"]["server-round"] == 1 for q in grid.queries)
    shifts = {m.metadata.dst_node_id: m.content[CONTROL_SHIFT_KEY].to_torch_state_dict()["w"].item() for m in messages}
    # Site 3's NaN is refused, so c is the mean of sites 1 and 2 alone (by hand above) and site 3 sits out.
    assert shifts == pytest.approx({1: 1.5, 2: -0.5})
    assert all(ETF_KEY in m.content.array_records for m in messages)
    (dropped,) = recorder.dropped
    assert "site 3: round 1 mean gradient refused: array 'w' holds NaN or infinite values" in dropped["reason"]
    assert recorder.extra["control_variates"] == [{"round": 1, "sites_asked": 3, "sites_corrected": 2}]

    # No site answers: fewer than min-available-sites (1) answered, so the run ends saying so; each site recorded with the reason.
    offline = GradientSites({1: Error(code=0, reason="site went offline"), 2: Error(code=0, reason="site went offline"),
                             3: None})
    with pytest.raises(TooFewSites, match=r"round 2: 0 of 3 site\(s\) sent a usable mean gradient, fewer than min-available-sites = 1"):
        strategy.configure_train(2, sent, ConfigRecord(), offline)
    assert [(d["round"], d["reason"]) for d in recorder.dropped[1:]] == [(2, "site went offline")] * 2 + [
        (2, "site 3: round 2 mean gradient missing: no answer within the round timeout (5 s)")]
    assert recorder.extra["control_variates"][1] == {"round": 2, "sites_asked": 3, "sites_corrected": 0}


def test_a_real_flower_run_corrects_every_site_in_every_round(tiny_run_superlink, tmp_path):
    # In this file rather than beside the other Flower runs: pytest-xdist hands out whole files, and that one is
    # the suite's longest.
    results = tmp_path / "results"
    outcome = tiny_run_superlink.run_app({"num-server-rounds": 2, "batch-size": 64, "val-fraction": 0.2,
                                          "min-site-size": 5, **CORRECTED, "results-dir": str(results)}, num_supernodes=2)
    assert outcome.completed, outcome.output[-4000:]
    (run,) = [p for p in results.iterdir() if p.is_dir()]
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["train"]["gradient-corrected"] for r in rounds[1:]] == [1.0, 1.0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["control_variates"] == [{"round": r, "sites_asked": 2, "sites_corrected": 2} for r in (1, 2)]
