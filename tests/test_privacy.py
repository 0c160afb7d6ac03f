"""Differential privacy: the accountant against independent computations, Flower's wrappers and mods
on hand-made updates (clipping, noise, counters, FedNCA-ML's ETF), and the dp.* config rules."""

import math

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent
from dp_accounting.rdp import RdpAccountant
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, compute_adaptive_noise_params
from flwr.supercore.task_identity import TaskIdentity
from scipy.optimize import brentq
from scipy.stats import norm

from fedskew.config import DEPLOYED_MAX_MEMORIZATION, ConfigError, RunConfig
from fedskew.privacy import (
    _central_wrapper,
    adaptive_round_multiplier,
    epsilon_spent,
    private_strategy,
    privacy_mod,
)
from fedskew.results import RunRecorder
from fedskew.strategies import RecordedFedAvg
from fedskew.strategies.fednca import ETF_KEY

DP_FEDAVG = {"method": "fedavg", "aggregation": "unweighted", "dp.mode": "central-server-clipping"}


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Epsilon of a mu-GDP mechanism (a composition of Gaussians is Gaussian with mu = sqrt(sum z^-2)):
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Dong, Roth & Su 2019, Cor. 2.13)."""
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 200)


@pytest.mark.parametrize("z, rounds, delta", [(1.0, 2, 1 / 530), (1.0, 20, 1e-5), (0.5, 10, 1e-5), (5.0, 3, 1e-5), (0.7, 1, 1e-3)])
def test_epsilon_matches_the_accountant_and_lies_between_the_exact_value_and_the_classic_rdp_bound(z, rounds, delta):
    reported = epsilon_spent([z] * rounds, delta)
    independent = RdpAccountant()
    independent.compose(GaussianDpEvent(z), rounds)
    assert reported == pytest.approx(independent.get_epsilon(delta), rel=1e-9)
    mu = math.sqrt(rounds) / z
    # RDP converts to an upper bound of the exact epsilon; dp-accounting's conversion is never looser
    # than Mironov's classic one, minimised over all orders: mu^2 / 2 + mu sqrt(2 log(1/delta)).
    assert exact_gaussian_epsilon(mu, delta) <= reported <= mu**2 / 2 + mu * math.sqrt(2 * math.log(1 / delta))


def test_no_release_spends_nothing_and_releases_with_more_noise_spend_less():
    assert epsilon_spent([], 1e-5) == 0.0
    assert epsilon_spent([2.0, 2.0], 1e-5) < epsilon_spent([1.0, 2.0], 1e-5) < epsilon_spent([1.0, 1.0], 1e-5)


def test_adaptive_clipping_accounts_the_combined_multiplier_flower_splits():
    # Flower splits a requested multiplier z into z_update and the count's noise; together they are z again.
    count_std, z_update = compute_adaptive_noise_params(1.0, 40, None)
    assert adaptive_round_multiplier(z_update, count_std) == pytest.approx(1.0, rel=1e-12)


def record(named: dict) -> ArrayRecord:
    return ArrayRecord({key: Array(np.asarray(value)) for key, value in named.items()})


@pytest.fixture
def flower_identity(monkeypatch):
    """Messages outside a Flower runtime need a task identity."""
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _reply(to: Message, weights: np.ndarray, steps: int) -> Message:
    arrays = record({"w": weights.astype(np.float32), "bn.num_batches_tracked": np.array(steps, dtype=np.int64)})
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 10, "unit-weight": 1})}), reply_to=to)


class SitesOnline:
    """The one Grid call a strategy's configure_train makes: which sites are connected."""

    def __init__(self, num_sites: int):
        self.num_sites = num_sites

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.num_sites + 1))


def _server_round(cfg: RunConfig, num_sites: int, sent: dict, replies: list[dict], tmp_path, failed: int = 0):
    """One round of the wrapped strategy: configure for `num_sites`, aggregate the replies (site arrays)
    and `failed` error replies."""
    recorder = RunRecorder.create(cfg, multilabel=False, base=tmp_path)
    inner = RecordedFedAvg(weighted_by_key="unit-weight")
    inner.attach(recorder)
    strategy = private_strategy(cfg, inner, num_sites, 500, recorder)
    outgoing = list(strategy.configure_train(1, record(sent), ConfigRecord(), SitesOnline(num_sites)))
    metrics = MetricRecord({"num-examples": 10, "unit-weight": 1})
    answers = [Message(RecordDict({"arrays": record(r), "metrics": metrics}), reply_to=m) for r, m in zip(replies, outgoing)]
    failing = outgoing[len(replies):len(replies) + failed]
    failures = [Message(Error(code=0, reason="site went offline"), reply_to=m) for m in failing]
    arrays, _ = strategy.aggregate_train(1, answers + failures)
    # Flower samples the sites at random: the failures answer the last messages, to their sites
    return arrays, {**recorder.extra["privacy"], "dropped": recorder.dropped,
                    "asked": ",".join(str(m.metadata.dst_node_id) for m in failing)}


def test_server_clipping_bounds_each_site_keeps_counters_out_and_accounts_a_dropout(flower_identity, tmp_path):
    np.random.seed(0)
    cfg = RunConfig.from_run_config({**DP_FEDAVG, "dp.clipping-norm": 1.0, "dp.noise-multiplier": 1e-3})
    big, small = np.full(100, 1.0), np.full(100, 0.01)  # norms 10 (clipped to 1) and 0.1 (untouched)
    sent = {"w": np.zeros(100, np.float32), "bn.num_batches_tracked": np.array(7, dtype=np.int64)}
    replies = [{"w": u.astype(np.float32), "bn.num_batches_tracked": np.array(40, dtype=np.int64)} for u in (big, small)]
    arrays, privacy = _server_round(cfg, 3, sent, replies, tmp_path, failed=1)  # 3 sites asked, 2 answered
    averaged = arrays["w"].numpy()
    expected = (big / 10 + small) / 2
    noise_std = 1e-3 * 1.0 / 3  # Flower calibrates to the 3 sampled sites
    assert np.abs(averaged - expected).max() < 6 * noise_std
    assert int(arrays["bn.num_batches_tracked"].numpy()) == 7  # the server's counter, not the sites' 40
    # the average of 2 has sensitivity 1/2, the noise std 1e-3/3: the release's multiplier is 1e-3 x 2/3
    assert privacy["noise_multipliers"] == [pytest.approx(1e-3 * 2 / 3)]
    assert privacy["delta"] == pytest.approx(1 / 500) and privacy["mode"] == "central-server-clipping"
    # Flower's wrapper alone would skip the round; the failure is recorded like in any run
    assert privacy["dropped"] == [{"round": 1, "site": privacy["asked"], "reason": "site went offline"}]


@pytest.mark.parametrize("update_size, factor", [(5.0, math.exp(0.2 * 0.5)), (0.01, math.exp(-0.2 * 0.5))])
def test_adaptive_clipping_moves_the_norm_towards_the_target_share(flower_identity, tmp_path, update_size, factor):
    # every update clipped (norm 5 x sqrt(10) > 1): the norm must grow; none clipped: it must shrink.
    # Rule: C <- C exp(-lr (unclipped share - target)), lr 0.2, target 0.5.
    np.random.seed(3)
    cfg = RunConfig.from_run_config(
        {**DP_FEDAVG, "dp.clipping": "adaptive", "dp.noise-multiplier": 0.01, "dp.clipped-count-stddev": 0.01}
    )
    recorder = RunRecorder.create(cfg, multilabel=False, base=tmp_path)
    strategy = private_strategy(cfg, FedAvg(weighted_by_key="unit-weight"), 4, 500, recorder)
    sent = record({"w": np.zeros(10, np.float32)})
    (outgoing, *_) = strategy.configure_train(1, sent, ConfigRecord(), SitesOnline(4))
    metrics = MetricRecord({"unit-weight": 1})
    trained = record({"w": np.full(10, update_size, np.float32)})
    strategy.aggregate_train(1, [Message(RecordDict({"arrays": trained, "metrics": metrics}), reply_to=outgoing) for _ in range(4)])
    # the count's noise (std 0.01 over 4 sites) moves the exponent by 0.2 x 0.0025 per sd: 6 sd
    assert strategy.clipping_norm == pytest.approx(factor, rel=0.2 * 6 * 0.01 / 4)


def test_noise_pushing_a_running_variance_below_zero_is_clamped(flower_identity, tmp_path):
    np.random.seed(1)
    cfg = RunConfig.from_run_config({**DP_FEDAVG, "dp.noise-multiplier": 50.0})
    sent, trained = {"bn.running_var": np.ones(1000, np.float32)}, {"bn.running_var": np.full(1000, 1.1, np.float32)}
    arrays, _ = _server_round(cfg, 2, sent, [trained, trained], tmp_path)
    assert arrays["bn.running_var"].numpy().min() >= 0.0


def _site_call(flower_identity_unused, run_config: dict, update: np.ndarray, with_etf: bool):
    sent = {"w": np.zeros(update.shape, np.float32), "bn.num_batches_tracked": np.array(3, dtype=np.int64)}
    content = {"arrays": record(sent), "config": ConfigRecord({KEY_CLIPPING_NORM: 1.0, "server-round": 1})}
    if with_etf:
        content[ETF_KEY] = record({ETF_KEY: np.eye(4, dtype=np.float32)})
    msg = Message(RecordDict(content), dst_node_id=1, message_type="train")
    seen = {}

    def handler(m: Message, ctx: Context) -> Message:
        seen["records"] = sorted(m.content.array_records.keys())
        return _reply(m, update, steps=99)

    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)
    return privacy_mod(msg, context, handler), seen


@pytest.mark.parametrize("clipping", ["fixed", "adaptive"])
def test_site_clipping_hands_the_etf_to_training_and_clips_only_the_model(flower_identity, clipping):
    run_config = {"method": "fednca", "aggregation": "unweighted", "dp.mode": "central-client-clipping", "dp.clipping": clipping}
    reply, seen = _site_call(None, run_config, np.full(100, 1.0), with_etf=True)
    assert not reply.has_error(), reply.error
    assert seen["records"] == ["arrays", ETF_KEY]  # training saw the ETF
    assert list(reply.content.array_records.keys()) == ["arrays"]  # the reply carries the model only
    assert np.linalg.norm(reply.content["arrays"]["w"].numpy()) == pytest.approx(1.0, rel=1e-5)
    assert int(reply.content["arrays"]["bn.num_batches_tracked"].numpy()) == 3


def test_local_dp_adds_noise_of_twice_the_clipping_norm_times_the_multiplier(flower_identity):
    np.random.seed(2)
    n = 200_000
    run_config = {"method": "fedavg", "dp.mode": "local", "dp.clipping-norm": 0.5, "dp.noise-multiplier": 3.0}
    update = np.full(n, 1e-6)  # far inside the clipping norm (Flower's clipping divides by the update's norm)
    reply, _ = _site_call(None, run_config, update, with_etf=False)
    noise = reply.content["arrays"]["w"].numpy() - update
    # sample std of n Gaussians: relative standard error 1 / sqrt(2n); 6 of them
    assert noise.std() == pytest.approx(2 * 0.5 * 3.0, rel=6 / math.sqrt(2 * n))


def test_messages_other_than_training_and_dp_off_pass_untouched(flower_identity):
    reply, seen = _site_call(None, {"method": "fednca"}, np.full(100, 1.0), with_etf=True)
    assert seen["records"] == ["arrays", ETF_KEY]
    assert np.linalg.norm(reply.content["arrays"]["w"].numpy()) == pytest.approx(10.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"method": "factory", "mosaic-grid": 0, "partition": "iid", "dp.mode": "local"}, "key 'dp.mode' = 'local' is invalid"),
        ({"method": "fedavg", "dp.mode": "central-server-clipping"}, "key 'aggregation' = 'weighted' is invalid"),
        ({"method": "fedavg", "dp.mode": "local", "dp.clipping": "adaptive"}, "key 'dp.clipping' = 'adaptive' is invalid"),
        ({"method": "fedavg", "dp.mode": "central", "aggregation": "unweighted"}, "key 'dp.mode' = 'central' is invalid"),
        ({"method": "fedavg", "dp.noise-multiplier": 0.0}, "key 'dp.noise-multiplier' = 0.0 is invalid"),
    ],
)
def test_bad_dp_settings_are_refused_with_the_key_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_run_config(overrides)


def test_adaptive_clipping_with_too_few_sites_for_its_noise_names_the_keys():
    cfg = RunConfig.from_run_config({**DP_FEDAVG, "dp.clipping": "adaptive", "dp.noise-multiplier": 1.0})
    with pytest.raises(ValueError, match="dp.noise-multiplier.*dp.clipped-count-stddev"):
        _central_wrapper(cfg.dp, FedAvg(), num_sites=3)


def test_the_memorisation_audit_is_on_by_default_at_a_deployed_site_only():
    default = RunConfig().factory
    assert default.memorization_limit(deployed=True) == DEPLOYED_MAX_MEMORIZATION > 0
    assert default.memorization_limit(deployed=False) == 0.0
    chosen = RunConfig.from_run_config({"factory.max-memorization": 0.2}).factory
    assert chosen.memorization_limit(deployed=True) == chosen.memorization_limit(deployed=False) == 0.2
    off = RunConfig.from_run_config({"factory.max-memorization": 0.0}).factory
    assert off.memorization_limit(deployed=True) == 0.0
    with pytest.raises(ConfigError, match="key 'factory.max-memorization' = -0.5 is invalid"):
        RunConfig.from_run_config({"factory.max-memorization": -0.5})
