"""The server's survey handling against malformed and lying survey replies: the real survey_federation
(survey_sites, parse_survey, agreed_task_shape, refuse_sites, write_partition) behind a fake Grid that
answers with the sites' replies, honest ones from site_survey of simulated sites."""

import json
import tempfile
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multihot_npz import write_multihot_npz

from fedskew.client_tasks import site_survey
from fedskew.config import RunConfig
from fedskew.data.sites import load_task_dataset, simulated_site
from fedskew.results import RunRecorder
from fedskew import server_tasks
from fedskew.server_tasks import SurveyFailed, SurveyRefusal, parse_survey, survey_federation

HONEST_NODES = (1, 2, 3)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    npz = write_multihot_npz(tmp_path_factory.mktemp("data") / "own.npz")
    return RunConfig.from_run_config({"dataset": f"npz:{npz}", "mosaic-grid": 0, "missing-classes": 1, "min-site-size": 5,
                                      "min-available-sites": len(HONEST_NODES)})  # fmt: skip


@pytest.fixture(scope="module")
def honest(cfg):
    """Node id -> the survey its simulated site answers (site k of 3 on node k + 1)."""
    return {node: site_survey(cfg, simulated_site(cfg, node - 1, len(HONEST_NODES))) for node in HONEST_NODES}


@pytest.fixture
def honest_result(cfg, honest, tmp_path):
    """(survey, task, partition.json) of the honest sites alone."""
    survey, task, partition, dropped = surveyed(cfg, honest, tmp_path)
    assert dropped == []
    return survey, task, partition


@pytest.fixture(autouse=True)
def flower_messages(monkeypatch):
    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # messages outside a Flower runtime
        monkeypatch.setattr(TaskIdentity, name, value)
    # partition.json is what is compared; drawing its figures (a second a run) would be most of the test's time.
    for figure in ("plot_label_counts", "plot_cooccurrence"):
        monkeypatch.setattr(server_tasks, figure, lambda *args: None)


class SurveyedGrid:
    """A Grid whose sites answer the survey with the given replies: a dict (sent as the ConfigRecord 'survey'),
    a RecordDict (sent as it is) or an Error; the replies come back in the given order."""

    def __init__(self, replies: dict[int, object], order: list[int] | None = None):
        self.replies, self.order = replies, order or sorted(replies)

    def get_node_ids(self):
        return sorted(self.replies)

    def send_and_receive(self, messages, timeout=None):
        by_node = {m.metadata.dst_node_id: m for m in messages}
        return [self._reply(self.replies[node], by_node[node]) for node in self.order]

    @staticmethod
    def _reply(answer, message):
        if isinstance(answer, Error):
            return Message(answer, reply_to=message)
        content = answer if isinstance(answer, RecordDict) else RecordDict({"survey": ConfigRecord(answer)})
        return Message(content, reply_to=message)


def surveyed(cfg, replies, results, order=None):
    """(survey, task, partition.json, the recorder's dropouts) of survey_federation over these replies,
    recorded in a new run folder under `results`."""
    recorder = RunRecorder.create(cfg, multilabel=True, base=Path(tempfile.mkdtemp(dir=results)))
    survey, task = survey_federation(SurveyedGrid(replies, order), sorted(replies), cfg, load_task_dataset(cfg), recorder)
    return survey, task, json.loads((recorder.path / "partition.json").read_text()), recorder.dropped


def test_an_honest_survey_is_parsed_to_itself(cfg, honest):
    for reply in honest.values():
        assert parse_survey(dict(ConfigRecord(reply)), cfg) == reply


# --- what a bad site may send --------------------------------------------------------------------------------

KEYS = ("site-id", "num-sites", "train-size", "val-size", "label-counts", "unassigned", "num-classes", "image-shape",
        "multilabel", "class-names", "cooccurrence", "data-source")  # fmt: skip
# Values a ConfigRecord can carry, none of them right for any survey key.
WRONG_VALUES = st.sampled_from(["abc", "", 2.5, float("nan"), True, -1, 10**20, b"\x00", [], [1.5, 2.5], ["a", "b"], [-1, -1]])


# Each turns a copy of an honest survey into a bad one.
def _drop_key(survey, draw):
    del survey[draw(st.sampled_from([k for k in KEYS if k != "class-names"]))]  # class names are optional


def _wrong_value(survey, draw):
    survey[draw(st.sampled_from(KEYS))] = draw(WRONG_VALUES)


def _counts_for_other_classes(survey, draw):  # e.g. 3 label counts for 6 classes
    survey["label-counts"] = survey["label-counts"][: draw(st.integers(0, len(survey["label-counts"]) - 1))]


def _more_labels_than_images(survey, draw):
    survey["label-counts"][draw(st.integers(0, survey["num-classes"] - 1))] = survey["train-size"] + draw(st.integers(1, 10))


def _cooccurrence_lie(survey, draw):
    k = survey["num-classes"]
    a, b = draw(st.integers(0, k - 1)), draw(st.integers(0, k - 1))
    survey["cooccurrence"][a * k + b] += draw(st.integers(1, 5))  # asymmetric, off the counts, or above them


def _site_id_out_of_range(survey, draw):
    survey["site-id"] = survey["num-sites"] + draw(st.integers(0, 5))


def _other_task(survey, draw):
    """A well-formed survey of another task: the server's test data defines the run's, so it is refused."""
    change = draw(st.sampled_from(["single-label", "image-shape", "class-names", "num-classes"]))
    if change == "single-label":
        survey["multilabel"] = 0
        survey["label-counts"][0] += survey["train-size"] - sum(survey["label-counts"])  # counts sum to train-size
        if survey["label-counts"][0] < 0:
            survey["label-counts"] = [survey["train-size"]] + [0] * (survey["num-classes"] - 1)
        del survey["cooccurrence"]
    elif change == "image-shape":
        survey["image-shape"] = [3, 32, 32]
    elif change == "class-names":
        survey["class-names"] = [f"other-{n}" for n in survey["class-names"]]
    else:
        k = survey["num-classes"] + 1
        survey.update({"num-classes": k, "label-counts": [0] * k, "cooccurrence": [0] * (k * k),
                       "class-names": [str(c) for c in range(k)]})  # fmt: skip


def _impossible_size(survey, draw):
    survey["train-size"] = draw(st.sampled_from([0, -3, 10**10]))


def _error_reply(draw):
    colour = "\x1b[36mray::ClientAppActor.run()\x1b[39m"
    trace = f'{colour}\n  File "x.py", line 1, in f\n    raise\nValueError: {draw(st.text(max_size=20))}\n'
    return Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=draw(st.sampled_from([trace, "", "\x1b[31mboom"])))


@st.composite
def bad_reply(draw, honest_surveys):
    changes = (_drop_key, _wrong_value, _counts_for_other_classes, _more_labels_than_images, _cooccurrence_lie,
               _site_id_out_of_range, _other_task, _impossible_size)  # fmt: skip
    kind = draw(st.sampled_from(["error", "no survey", "other record", *changes]))
    if kind == "error":
        return _error_reply(draw)
    if kind == "no survey":
        return RecordDict()
    if kind == "other record":
        return RecordDict({"survey": MetricRecord({"site-id": 0})})
    survey = json.loads(json.dumps(draw(st.sampled_from(honest_surveys))))  # a copy to change
    kind(survey, draw)
    return survey


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_survey_replies_are_refused_and_the_honest_sites_result_is_unchanged(cfg, honest, honest_result, tmp_path, data):
    expected_survey, expected_task, expected_partition = honest_result
    bad = data.draw(st.lists(bad_reply(list(honest.values())), min_size=1, max_size=4))
    replies = {**honest, **{100 + k: reply for k, reply in enumerate(bad)}}
    order = data.draw(st.permutations(sorted(replies)))
    survey, task, partition, dropped = surveyed(cfg, replies, tmp_path, list(order))
    assert survey == expected_survey and task is expected_task and partition == expected_partition
    # Every bad site is refused, recorded as dropped before round 1 with one line that names it.
    assert sorted(int(d["site"]) for d in dropped) == sorted(set(replies) - set(honest)) and {d["round"] for d in dropped} == {0}
    for d in dropped:
        assert d["reason"].startswith(f"site {d['site']} ") and "\n" not in d["reason"] and "\x1b[" not in d["reason"]


def test_a_survey_without_its_record_or_with_text_for_a_count_is_refused_with_the_reason(cfg, honest):
    with pytest.raises(SurveyRefusal, match="holds no ConfigRecord 'survey'"):
        parse_survey(None, cfg)
    with pytest.raises(SurveyRefusal, match=r"'num-classes' must be an int in 1\.\.100000, found 'abc'"):
        parse_survey({**honest[1], "num-classes": "abc"}, cfg)
    with pytest.raises(SurveyRefusal, match=r"'label-counts' must be 6 ints in 0\.\.\d+, found \[1, 2, 3\]"):
        parse_survey({**honest[1], "label-counts": [1, 2, 3]}, cfg)
    with pytest.raises(SurveyRefusal, match="'num-classes' = 6, but the run config's num-classes = 10"):
        parse_survey(honest[1], cfg.model_copy(update={"num_classes": 10}))


def test_too_few_usable_sites_end_the_run_with_one_line_saying_so(cfg, honest, tmp_path):
    replies = {**honest, 9: {**honest[1], "num-classes": "abc"}}
    with pytest.raises(SurveyFailed, match=r"^3 site\(s\) left after the survey, fewer than min-available-sites = 4: "
                       r"site 9 refused: its survey reply 'num-classes' must be"):
        surveyed(cfg.model_copy(update={"min_available_sites": 4}), replies, tmp_path)
    # Every site failing alike: the run ends with that failure, once.
    error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="<class 'fedskew.config.ConfigError'>:<'key x is bad'>")
    with pytest.raises(SurveyFailed, match=r"^every site \(3\) failed the survey: ConfigError: key x is bad$"):
        surveyed(cfg, dict.fromkeys(HONEST_NODES, error), tmp_path)


def test_nodes_claiming_one_site_id_are_all_refused_naming_each_other_and_the_key(cfg, honest, tmp_path):
    """A fourth node sends a well-formed survey under site 1's id (as two deployed SuperNodes left without node
    config site-id both claim 0): neither node 2 nor node 4 keeps it, the run goes on with sites 0 and 2."""
    replies = {**honest, 4: {**honest[3], "site-id": honest[2]["site-id"]}}
    survey, _, partition, dropped = surveyed(cfg.model_copy(update={"min_available_sites": 2}), replies, tmp_path)
    assert sorted(survey) == [1, 3] and [site["site-id"] for site in partition["sites"]] == [0, 2]
    assert sorted(d["site"] for d in dropped) == ["2", "4"] and {d["round"] for d in dropped} == {0}
    for d in dropped:
        assert d["reason"] == (f"site {d['site']} refused: nodes 2, 4 all claim site-id 1; give each site its own with "
                               "node config site-id (--node-config \"site-id=K num-sites=N\", K in 0..N-1)")
    with pytest.raises(SurveyFailed, match=r"^2 site\(s\) left after the survey, fewer than min-available-sites = 3: "
                       r"site 2 refused: nodes 2, 4 all claim site-id 1"):
        surveyed(cfg, replies, tmp_path)
