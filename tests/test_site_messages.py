"""No site can stop or steer the federation by what it sends: for each kind of message a site sends during the
rounds (training reply, mean-gradient answer, validation report), hypothesis draws honest sites and one site
whose message is malformed or lies (a weight beyond what it declared in its survey, a unit weight other than
1, NaN, wrong arrays, counts beyond its validation split), drives the real server handler with them, and
checks that the liar is refused with a reason naming it and that the honest sites' result is exactly what it
is without the liar. Also: every wait for the sites is bounded by the round timeout, and a round with fewer
usable sites than min-available-sites ends the run with the reason."""

import functools
import math
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedskew.client_tasks import VAL_COUNTS_KEY
from fedskew.config import RunConfig
from fedskew.results import RunRecorder
from fedskew.strategies import build_strategy
from fedskew.strategies.fednca import CONTROL_SHIFT_KEY, FedNCA
from fedskew.strategies.messages import Declared
from fedskew.strategies.recording import TooFewSites

# node -> what it declared in its survey (site id, training images, validation images); node 3 is the liar.
DECLARED = {1: Declared(0, 40, 8), 2: Declared(1, 25, 6), 3: Declared(2, 30, 10)}
HONEST, LIAR = (1, 2), 3
SENT = {"w": np.zeros((2, 3), np.float32), "bn.num_batches_tracked": np.array(5, np.int64)}
EXAMPLES = st.integers(1, 10**6)  # scaled into 1..declared below
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def inside_a_run():
    """Messages are made inside a run (as in a ServerApp)."""
    names = ("_run_id", "_node_id", "_task_id")
    saved = {name: getattr(TaskIdentity, name) for name in names}
    for name, value in zip(names, (1, 0, 1)):
        setattr(TaskIdentity, name, value)
    yield
    for name, value in saved.items():
        setattr(TaskIdentity, name, value)


class Sites:
    """The Grid calls the strategies make: sites 1-3 connected; the gradient query answered from `answers`."""

    def __init__(self, answers=None, online=(1, 2, 3)):
        self.answers, self.online = answers or {}, list(online)

    def get_node_ids(self):
        return list(self.online)

    def send_and_receive(self, messages, timeout=None):
        return [Message(self.answers[m.metadata.dst_node_id], reply_to=m) for m in messages if m.metadata.dst_node_id in self.answers]


def strategy_for(overrides: dict, declared=DECLARED, model=None):
    cfg = RunConfig.from_run_config({"min-available-sites": 2, **overrides})
    model = model or torch.nn.Linear(3, 2, bias=False)
    strategy = build_strategy(cfg, len(declared), model, etf=torch.eye(2))
    strategy.attach(RunRecorder(path=Path(tempfile.mkdtemp()), multilabel=False, method=cfg.method), declared=declared)
    return strategy


def arrays_of(values: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(value) for name, value in values.items()})


def content(arrays: dict[str, np.ndarray], **metrics) -> RecordDict:
    return RecordDict({"arrays": arrays_of(arrays), "metrics": MetricRecord(metrics)})


def within(declared: int, drawn: int) -> int:
    """An honest weight: 1..declared."""
    return 1 + drawn % declared


def model_arrays(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((2, 3), value, np.float32), "bn.num_batches_tracked": np.array(9, np.int64)}


def weight_lies(key: str, declared: int):
    """Values of `key` a lying or broken site might send: beyond what it declared, not positive, not finite;
    for the unit weight anything but 1."""
    not_usable = st.sampled_from([0, -1, -0.5, math.inf, -math.inf, math.nan])
    if key == "unit-weight":
        return st.one_of(not_usable, st.integers(2, 2**62), st.floats(0, 1e300, exclude_min=True).filter(lambda v: v != 1))
    return st.one_of(not_usable, st.integers(declared + 1, 2**62), st.floats(declared + 0.5, 1e300))


@st.composite
def lying_reply(draw, weight_key: str, layout: dict[str, np.ndarray]):
    """(the liar's content, what its refusal says): a lie about its weight, or about its arrays."""
    declared = DECLARED[LIAR].train_size
    honest_weight = {"num-examples": declared, "unit-weight": 1}
    kind = draw(st.sampled_from(["weight", "nan", "shape", "missing", "unknown", "text"]))
    arrays = {name: np.full(value.shape, draw(st.floats(-1e3, 1e3, width=32)), value.dtype) for name, value in layout.items()}
    if kind == "weight":
        lie = draw(weight_lies(weight_key, declared))
        return content(arrays, **{**honest_weight, weight_key: lie}), f"metric '{weight_key}'"
    name = draw(st.sampled_from(sorted(layout)))
    if kind == "nan":
        spoiled = np.array(arrays[name], dtype=np.float32)
        spoiled.flat[draw(st.integers(0, spoiled.size - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        return content({**arrays, name: spoiled}, **honest_weight), f"'{name}' (holds NaN or infinite values|has shape)"
    if kind == "shape":
        return content({**arrays, name: np.zeros(arrays[name].size + 1, np.float32)}, **honest_weight), f"array '{name}' has shape"
    if kind == "missing":
        return content({k: v for k, v in arrays.items() if k != name}, **honest_weight), f"missing \\['{name}'\\]"
    if kind == "unknown":
        return content({**arrays, "extra": np.zeros(1, np.float32)}, **honest_weight), r"unknown \['extra'\]"
    return content({**arrays, name: np.full(arrays[name].shape, "x")}, **honest_weight), "real numbers"


def aggregate(strategy, replies_by_node: dict[int, RecordDict]):
    outgoing = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, arrays_of(SENT), ConfigRecord(), Sites())}
    return strategy.aggregate_train(1, [Message(c, reply_to=outgoing[node]) for node, c in replies_by_node.items()])


def assert_only_the_liar_refused(strategy, reason: str, what: str):
    (dropped,) = strategy.recorder.dropped
    assert (dropped["round"], dropped["site"], dropped["site-id"]) == (1, str(LIAR), DECLARED[LIAR].site_id)
    assert dropped["reason"].startswith(f"site 2 (node 3): round 1 {what} refused: ")
    assert re.search(reason, dropped["reason"]), dropped["reason"]


# --- training replies ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "aggregation"), [("fedavg", "weighted"), ("fedavg", "unweighted"), ("fedprox", "weighted")])
@PROPERTY
@given(data=st.data())
def test_a_lying_training_reply_is_refused_and_the_honest_average_is_unchanged(method, aggregation, data):
    weight_key = "num-examples" if aggregation == "weighted" else "unit-weight"
    honest = {
        node: content(model_arrays(data.draw(st.floats(-1e3, 1e3, width=32))),
                      **{"num-examples": within(DECLARED[node].train_size, data.draw(EXAMPLES)), "unit-weight": 1})
        for node in HONEST
    }  # fmt: skip
    lie, reason = data.draw(lying_reply(weight_key, SENT))
    overrides = {"method": method, "aggregation": aggregation}
    with_liar = strategy_for(overrides)
    arrays, _ = aggregate(with_liar, {**honest, LIAR: lie})
    expected, _ = aggregate(strategy_for(overrides), honest)
    for name, value in expected.to_torch_state_dict().items():
        assert torch.equal(arrays.to_torch_state_dict()[name], value), name
    assert_only_the_liar_refused(with_liar, reason, "update")


def test_a_site_claiming_1e18_examples_is_refused_not_made_the_whole_average():
    # The case: sites of 40 and 25 images (w = 1 and 3) and a third claiming 1e18 (w = 1000).
    strategy = strategy_for({"method": "fedavg"})
    arrays, _ = aggregate(strategy, {1: content(model_arrays(1.0), **{"num-examples": 40}),
                                     2: content(model_arrays(3.0), **{"num-examples": 25}),
                                     LIAR: content(model_arrays(1000.0), **{"num-examples": 10**18})})  # fmt: skip
    np.testing.assert_allclose(arrays["w"].numpy(), (40 * 1.0 + 25 * 3.0) / 65, rtol=1e-6)  # float32 averaging
    assert "'num-examples' = 1000000000000000000 exceeds the 30 images this site declared" in strategy.recorder.dropped[0]["reason"]


def test_unweighted_averaging_takes_every_site_at_weight_one():
    strategy = strategy_for({"method": "fedavg", "aggregation": "unweighted"})
    arrays, _ = aggregate(strategy, {1: content(model_arrays(1.0), **{"num-examples": 40, "unit-weight": 1}),
                                     2: content(model_arrays(3.0), **{"num-examples": 25, "unit-weight": 1}),
                                     LIAR: content(model_arrays(1000.0), **{"num-examples": 30, "unit-weight": 10**18})})  # fmt: skip
    assert torch.equal(arrays.to_torch_state_dict()["w"], torch.full((2, 3), 2.0))
    assert "metric 'unit-weight' must be 1" in strategy.recorder.dropped[0]["reason"]


# --- mean-gradient answers (fednca.control-variates) ---------------------------------------------------------


def fednca_with_controls():
    model = torch.nn.Linear(3, 2, bias=False)
    strategy = strategy_for({"method": "fednca", "fednca.control-variates": True}, model=model)
    assert isinstance(strategy, FedNCA) and strategy.control_layout == {"weight": (2, 3)}
    return strategy


def corrections(strategy, answers: dict[int, RecordDict]) -> dict[int, torch.Tensor]:
    sent = arrays_of({"weight": np.zeros((2, 3), np.float32)})
    messages = strategy.configure_train(1, sent, ConfigRecord(), Sites(answers))
    return {m.metadata.dst_node_id: m.content[CONTROL_SHIFT_KEY].to_torch_state_dict()["weight"] for m in messages}


@PROPERTY
@given(data=st.data())
def test_a_lying_gradient_answer_is_refused_and_the_honest_corrections_are_unchanged(data):
    honest = {node: content({"weight": np.full((2, 3), data.draw(st.floats(-10, 10, width=32)), np.float32)},
                            **{"num-examples": within(DECLARED[node].train_size, data.draw(EXAMPLES)), "unit-weight": 1})
              for node in HONEST}  # fmt: skip
    lie, reason = data.draw(lying_reply("num-examples", {"weight": np.zeros((2, 3), np.float32)}))
    with_liar = fednca_with_controls()
    shifts = corrections(with_liar, {**honest, LIAR: lie})
    expected = corrections(fednca_with_controls(), honest)
    assert sorted(shifts) == list(HONEST) and all(torch.equal(shifts[n], expected[n]) for n in HONEST)
    assert_only_the_liar_refused(with_liar, reason, "mean gradient")


# --- validation reports ---------------------------------------------------------------------------------------


def report(accuracy: float, balanced: float, examples: int) -> RecordDict:
    return RecordDict({"metrics": MetricRecord({"val_accuracy": accuracy, "val_balanced_accuracy": balanced,
                                                "num-examples": examples, "unit-weight": 1})})  # fmt: skip


def evaluate(strategy, replies_by_node: dict[int, RecordDict]):
    outgoing = {m.metadata.dst_node_id: m for m in strategy.configure_evaluate(1, arrays_of(SENT), ConfigRecord(), Sites())}
    metrics = strategy.aggregate_evaluate(1, [Message(c, reply_to=outgoing[node]) for node, c in replies_by_node.items()])
    return metrics, strategy.last_val_counts


@st.composite
def lying_report(draw):
    declared = DECLARED[LIAR].val_size
    kind = draw(st.sampled_from(["weight", "accuracy", "extra"]))
    if kind == "weight":
        return report(0.5, 0.5, draw(weight_lies("num-examples", declared))), "metric 'num-examples'"
    if kind == "accuracy":
        value = draw(st.one_of(st.floats(1, 1e300, exclude_min=True), st.floats(max_value=0, exclude_max=True), st.just(math.nan)))
        return report(value, 0.5, declared), r"'val_accuracy' must be a number in \[0, 1\]"
    lie = report(0.5, 0.5, declared)
    lie["metrics"]["val_loss"] = 0.1
    return lie, r"its metrics are \["


@pytest.mark.parametrize("aggregation", ["weighted", "unweighted"])
@PROPERTY
@given(data=st.data())
def test_a_lying_validation_report_is_refused_and_the_honest_validation_is_unchanged(aggregation, data):
    overrides = {"method": "fedavg", "aggregation": aggregation, "dataset": "digits", "mosaic-grid": 0, "partition": "iid"}
    honest = {node: report(data.draw(st.floats(0, 1)), data.draw(st.floats(0, 1)),
                           within(DECLARED[node].val_size, data.draw(EXAMPLES))) for node in HONEST}  # fmt: skip
    lie, reason = data.draw(lying_report())
    with_liar = strategy_for(overrides)
    metrics, _ = evaluate(with_liar, {**honest, LIAR: lie})
    expected, _ = evaluate(strategy_for(overrides), honest)
    assert dict(metrics) == dict(expected)
    assert_only_the_liar_refused(with_liar, reason, "validation report")


def counts_report(counts: np.ndarray, examples: int) -> RecordDict:
    return RecordDict({"metrics": MetricRecord({VAL_COUNTS_KEY: counts.ravel().tolist(), "num-examples": examples, "unit-weight": 1})})


@st.composite
def split_counts(draw, val_size: int, shape: tuple[int, int]) -> np.ndarray:
    """Threshold counts a validation split of `val_size` images can give: per threshold and class, tp + fp and
    tp + fn at most val_size."""
    positives = draw(st.lists(st.integers(0, val_size), min_size=shape[1], max_size=shape[1]))
    counts = np.zeros((*shape, 3), np.int64)
    for t in range(shape[0]):
        for k, holding in enumerate(positives):
            tp = draw(st.integers(0, holding))
            counts[t, k] = (tp, draw(st.integers(0, val_size - tp)), holding - tp)
    return counts


@PROPERTY
@given(data=st.data())
def test_lying_validation_counts_are_refused_and_the_honest_sum_is_unchanged(data):
    shape = (3, 2)  # thresholds x classes
    honest = {node: counts_report(data.draw(split_counts(DECLARED[node].val_size, shape)), DECLARED[node].val_size) for node in HONEST}
    inflated = data.draw(split_counts(DECLARED[LIAR].val_size, shape))
    inflated.flat[data.draw(st.integers(0, inflated.size - 1))] += data.draw(st.integers(DECLARED[LIAR].val_size + 1, 10**18))
    lie = counts_report(inflated, DECLARED[LIAR].val_size)

    def multilabel():
        strategy = strategy_for({"method": "fedavg"})
        strategy.counts_shape = (*shape, 3)
        return strategy

    with_liar = multilabel()
    _, counts = evaluate(with_liar, {**honest, LIAR: lie})
    np.testing.assert_array_equal(counts, sum(np.reshape(r["metrics"][VAL_COUNTS_KEY], (*shape, 3)) for r in honest.values()))
    assert_only_the_liar_refused(with_liar, f"counts \\d+ images for one class at one threshold .*declared {DECLARED[LIAR].val_size}",
                                 "validation report")


# --- the per-round floor and bounded waits ------------------------------------------------------------------


def test_a_round_with_fewer_usable_sites_than_min_available_sites_ends_the_run_naming_why():
    strategy = strategy_for({"method": "fedavg", "min-available-sites": 3})
    with pytest.raises(TooFewSites, match=r"round 1: 2 of 3 site\(s\) sent a usable training reply, fewer than "
                                          r"min-available-sites = 3 .*site 2 \(node 3\): round 1 update refused"):
        aggregate(strategy, {1: content(model_arrays(1.0), **{"num-examples": 40}),
                             2: content(model_arrays(3.0), **{"num-examples": 25}),
                             LIAR: content(model_arrays(1.0), **{"num-examples": 31})})  # fmt: skip


def test_a_site_that_never_answers_is_recorded_as_missing_and_the_round_goes_on_above_the_floor():
    strategy = strategy_for({"method": "fedavg", "round-timeout": 7.0})
    arrays, _ = aggregate(strategy, {1: content(model_arrays(1.0), **{"num-examples": 40}),
                                     2: content(model_arrays(1.0), **{"num-examples": 25})})  # fmt: skip
    assert torch.equal(arrays.to_torch_state_dict()["w"], torch.ones(2, 3))
    assert strategy.recorder.dropped == [{"round": 1, "site": "3", "site-id": 2, "reason": "site 2 (node 3): round 1 "
                                          "training reply missing: no answer within the round timeout (7.0 s)"}]  # fmt: skip


@pytest.mark.parametrize("phase", ["train", "evaluate"])
def test_waiting_for_sites_to_connect_ends_at_the_round_timeout(phase):
    # Flower's own sampling waits for min_available_nodes without end; here one site of three is gone.
    strategy = strategy_for({"method": "fedavg", "min-available-sites": 3, "round-timeout": 0.5})
    configure = strategy.configure_train if phase == "train" else strategy.configure_evaluate
    started = time.monotonic()
    with pytest.raises(TooFewSites, match=r"round 1: 2 site\(s\) connected after the round timeout \(0.5 s\), fewer "
                                          r"than min-available-sites = 3"):
        configure(1, arrays_of(SENT), ConfigRecord(), Sites(online=(1, 2)))
    assert time.monotonic() - started < 0.5 + 1.5  # the timeout, plus one poll interval (1 s) and slack


def test_only_the_surveyed_sites_are_asked():
    # Node 4 connected after the survey (or was refused in it): it declared nothing, so it is sent nothing.
    strategy = strategy_for({"method": "fedavg"})
    messages = strategy.configure_train(1, arrays_of(SENT), ConfigRecord(), Sites(online=(1, 2, 3, 4)))
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 2, 3]
    assert strategy.recorder.extra["site_ids"] == {"1": 0, "2": 1, "3": 2}


# --- FederatedFactory: generator uploads, experts, site-validation scores, quotas -------------------------------

from test_hostile import CFG, HOSTILE_SITE, SITES, TASK, expert_reply, honest, survey_of  # noqa: E402, F401 - honest: a fixture
from test_hostile import ScriptedGrid, collect_experts, collect_library, factory_strategy  # noqa: E402

from fedskew.factory.library import Library, sampling_plan  # noqa: E402
from fedskew.factory.site_validation import ClassScores  # noqa: E402
from fedskew.protocol import SCORES_KEY, encode_modules, packed_weights  # noqa: E402
from fedskew.strategies.factory_validation import asking  # noqa: E402

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=6)  # fmt: skip
# Every field of an upload's module metadata that the server derives from the survey and the run config (or, the
# checksum, from the weights): a different value is a lie. (The memorisation audit is the site's own word.)
DERIVED_FIELDS = ("site-id", "module-id", "classes", "image-counts", "checksum")


def factory_collect(honest, forged_content):
    """The server's upload round: node 11 (site 0) honest, node 12 (site 1) sends `forged_content`."""
    return collect_library(Path(tempfile.mkdtemp()), lambda node, _: forged_content if node == 12 else encode_modules(*honest[0]),
                           survey_of(SITES))[1]  # fmt: skip


@PROPERTY
@given(data=st.data())
def test_a_lying_generator_upload_is_refused_and_the_honest_library_is_unchanged(honest, data):
    import json

    manifest, modules = json.loads(json.dumps(honest[1][0])), honest[1][1]
    module = manifest["modules"][0]
    field = data.draw(st.sampled_from(DERIVED_FIELDS + ("config",)))
    if field == "config":
        key = data.draw(st.sampled_from(sorted(module["config"])))
        target, old = module["config"], module["config"][key]
    else:
        key, target, old = field, module, module[field]
    target[key] = data.draw(JSON.filter(lambda v: json.dumps(v, sort_keys=True) != json.dumps(old, sort_keys=True)))
    library, rejected = factory_collect(honest, encode_modules(manifest, modules))
    assert [(m.module_id, m.checksum) for m in library.modules] == [("site0-class0", honest[0][1][0].checksum)]
    assert [(r["node"], r["site-id"]) for r in rejected] == [("12", 1)] and rejected[0]["reason"]


@functools.cache
def expert_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from fedskew.factory.classifier import build_classifier

    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in build_classifier("small-cnn", TASK.image_shape, 10, 8).state_dict().items()}


@settings(PROPERTY, max_examples=25)  # each example builds and loads two experts
@given(metrics=st.dictionaries(st.sampled_from(["train_loss", "val_accuracy", "site-id", "extra"]),
                               st.one_of(st.floats(), st.integers(-(2**63), 2**63 - 1)), max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))  # fmt: skip
def test_a_lying_expert_is_refused_and_the_honest_experts_are_unchanged(metrics, dtype):
    # Integers beyond int64 cannot cross the wire (Flower's serialisation refuses them at the sender).
    state = expert_weights(dtype)
    usable = dtype == torch.float32 and all(
        isinstance(metrics.get(k), (int, float)) and math.isfinite(metrics[k]) for k in ("train_loss", "val_accuracy"))
    lie = RecordDict({"expert": packed_weights(state), "metrics": MetricRecord(metrics)})
    experts, rejected = collect_experts(Path(tempfile.mkdtemp()), lambda node, _: lie if node == 12 else expert_reply())
    # A usable expert is any site's to send (its metrics are recorded, never trusted to name it); an unusable one is refused.
    assert [(e.node, e.site_id) for e in experts] == [(11, 0), (12, 1)][: 2 if usable else 1]
    assert [(r["node"], r["site-id"]) for r in rejected] == ([] if usable else [("12", 1)])


VALIDATION_SURVEY = {11: {"site-id": 0, "val-size": 12}, 12: {"site-id": 1, "val-size": 9}, 13: {"site-id": 2, "val-size": 10}}
CLASSES = 3


@st.composite
def split_scores(draw, val_size: int) -> ClassScores:
    """What a validation split of at most `val_size` images can give a classifier: per class its images, hits and
    predicted probability sums (each row sums to that class's images)."""
    counts = np.array(draw(st.lists(st.integers(0, val_size // CLASSES), min_size=CLASSES, max_size=CLASSES)), np.float64)
    correct = np.array([draw(st.integers(0, int(n))) for n in counts], np.float64)
    shares = np.array(draw(st.lists(st.integers(1, 5), min_size=CLASSES * CLASSES, max_size=CLASSES * CLASSES)), np.float64)
    shares = shares.reshape(CLASSES, CLASSES) / shares.reshape(CLASSES, CLASSES).sum(1, keepdims=True)
    return ClassScores(counts, correct, shares * counts[:, None])


def pooled_at_sites(answers: dict[int, ClassScores | RecordDict], survey: dict) -> tuple[ClassScores, list[dict]]:
    def answer(node, _):
        reply = answers[node]
        return reply if isinstance(reply, RecordDict) else RecordDict({SCORES_KEY: MetricRecord(reply.to_metrics())})

    strategy = factory_strategy(Path(tempfile.mkdtemp()), {})
    strategy.grid = ScriptedGrid(answer)  # the round's Grid, as configure_train keeps it
    return asking(strategy, survey, CLASSES)({"w": torch.zeros(1)}), strategy.recorder.dropped


@PROPERTY
@given(data=st.data())
def test_lying_site_validation_scores_are_refused_and_the_honest_pool_is_unchanged(data):
    honest = {node: data.draw(split_scores(VALIDATION_SURVEY[node]["val-size"])) for node in (11, 12)}
    kind = data.draw(st.sampled_from(["inflated", "inconsistent", "no scores"]))
    if kind == "inflated":  # more images than the site declared: it would outweigh the honest sites' real images
        liar = data.draw(split_scores(10))
        extra = data.draw(st.integers(11, 10**15))
        lie = ClassScores(liar.counts + [extra, 0, 0], liar.correct + [extra, 0, 0], liar.prob_sums + np.diag([extra, 0, 0]))
    elif kind == "inconsistent":  # more hits than images
        liar = data.draw(split_scores(10))
        lie = ClassScores(liar.counts, liar.counts + 1, liar.prob_sums)
    else:
        lie = RecordDict({})
    pooled, dropped = pooled_at_sites({**honest, 13: lie}, VALIDATION_SURVEY)
    expected, _ = pooled_at_sites(honest, {n: VALIDATION_SURVEY[n] for n in honest})
    for field in ("counts", "correct", "prob_sums"):
        np.testing.assert_array_equal(getattr(pooled, field), getattr(expected, field))
    assert [(d["site"], d["round"]) for d in dropped] == [("13", 1)] and "site 2 (node 13)" in dropped[0]["reason"]


@PROPERTY
@given(honest=st.lists(st.integers(1, 10**4), min_size=1, max_size=3), claim=st.integers(1, 10**12),
       quota=st.integers(1, 10**4))  # fmt: skip
def test_no_survey_claim_takes_more_than_half_of_a_class_another_site_holds(honest, claim, quota):
    from types import SimpleNamespace

    holders = [SimpleNamespace(module_id=f"site{k}-class2", classes=(2,), image_counts=(n,)) for k, n in enumerate(honest)]
    liar = SimpleNamespace(module_id="site9-class2", classes=(2,), image_counts=(claim,))
    library = Library(tuple(holders + [liar]), 10, (1, 8, 8), tuple(map(str, range(10))))
    plan = {job.module_id: job.count for job in sampling_plan(library, quota, seed=0)}
    assert sum(plan.values()) == quota
    assert plan.get("site9-class2", 0) <= math.ceil(quota / 2)  # largest remainders round a half up, never further


def test_fewer_accepted_uploads_than_min_available_sites_end_the_run_naming_the_rejection(honest):
    forged = HOSTILE_SITE.forged_upload(CFG, 1, SITES[12][1], TASK.image_shape, ["image count"])
    answers = {11: encode_modules(*honest[0]), 12: forged}
    for floor, ends in ((1, False), (2, True)):
        collect = functools.partial(collect_library, Path(tempfile.mkdtemp()), lambda node, _: answers[node], survey_of(SITES), floor=floor)
        if not ends:
            assert [m.module_id for m in collect()[1][0].modules] == ["site0-class0"]
            continue
        with pytest.raises(TooFewSites, match=r"round 1: 1 of 2 site\(s\) sent a usable upload, fewer than min-available-sites = 2 "
                                              r".*site 1 \(node 12\): upload rejected: .*declared image-counts"):
            collect()


def test_the_report_names_a_dropped_site_by_its_site_id_beside_its_node_id(tmp_path):
    import json

    from test_report import fake_run

    from fedskew.report import run_report

    recorder = fake_run(tmp_path)  # site 2 (node 1002) dropped in round 2
    summary = json.loads((recorder.path / "summary.json").read_text())
    assert "site 1002</td>" in run_report(recorder.path)  # without a survey's site ids: the node id alone
    (recorder.path / "summary.json").write_text(json.dumps({**summary, "site_ids": {"1000": 0, "1001": 1, "1002": 2}}))
    assert "site 2 (node 1002)</td>" in run_report(recorder.path)
