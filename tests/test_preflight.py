"""Config errors that only the data can reveal end the run on the server before round 1, with one line naming
the setting: no traceback, no terminal colours, no round trained."""

import json
import re

import numpy as np
import pytest
from multihot_npz import write_multihot_npz

from fedskew.config import ConfigError, RunConfig
from fedskew.server_tasks import check_partition, load_server_test_set, site_failure

MISSING_LABEL = "missing-classes=3 with 3 sites leaves 3 present-label slots for 4 labels"
# A simulated site's failed survey as Flower 1.42 replies it (the reason of its Error): Ray's traceback of the
# actor in terminal colours, the site's own exception first, Flower's re-raise after it (frames shortened).
RAY_REASON = (
    "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=10031, "
    "ip=192.0.2.2)\n  File \"/srv/site/fedskew/client_app.py\", line 45, in survey\n    return Message(RecordDict(...))\n"
    "  File \"/srv/site/fedskew/data/partition.py\", line 124, in multilabel_skew\n    raise ValueError(\n"
    f"ValueError: {MISSING_LABEL}, so some label would be missing everywhere\n\nThe above exception was the direct "
    "cause of the following exception:\n\n\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=10031)\n  File \"ray_actor.py\", "
    "line 65, in run\n    raise ClientAppException(str(ex)) from ex\nflwr.clientapp.client_app.ClientAppException: \n"
    f"Exception ClientAppException occurred. Message: {MISSING_LABEL}, so some label would be missing everywhere'>"
)


def test_a_sites_failure_is_the_one_line_its_code_raised():
    assert site_failure(RAY_REASON) == f"ValueError: {MISSING_LABEL}, so some label would be missing everywhere"
    # A deployed SuperNode replies with the exception alone.
    deployed = "<class 'fedskew.data.site_folder.SiteFolderError'>:<'/srv/site has no labels.csv'>"
    assert site_failure(deployed) == "SiteFolderError: /srv/site has no labels.csv"


@pytest.fixture(scope="module")
def four_labels(tmp_path_factory):
    """A multi-hot npz with 4 labels: with the default missing-classes = 3, 3 sites cannot all hold each label."""
    folder = tmp_path_factory.mktemp("four")
    arrays = dict(np.load(write_multihot_npz(folder / "six.npz")))
    four = {key: value[:, :4] if key.endswith("_labels") else value for key, value in arrays.items()}
    np.savez(folder / "four.npz", **{**four, "class_names": arrays["class_names"][:4]})
    return {"dataset": f"npz:{folder / 'four.npz'}", "mosaic-grid": 0, "method": "fednca", "min-site-size": 5}


def test_the_server_finds_an_infeasible_partition_itself(four_labels):
    cfg = RunConfig.from_run_config(four_labels)
    with pytest.raises(ConfigError, match=f"partition = 'multilabel-skew' of dataset .* over 3 sites .*{MISSING_LABEL}"):
        check_partition(cfg, 3)
    check_partition(cfg, 4)  # 4 x (4 - 3) slots hold the 4 labels


@pytest.mark.parametrize("settings, message", [
    ({"dataset": "digits", "method": "fedavg", "num-classes": 7}, "key 'num-classes' = 7 is invalid; digits has 10 classes"),
    ({"dataset": "shapes", "method": "fedavg", "image-size": 8}, "invalid run config: dataset = 'shapes': shapes at image-size 8 px"),
    ({"method": "factory"}, "holds multi-label data, which this run config cannot use: key 'method' = 'factory'"),
], ids=["classes", "image size", "label kind"])  # fmt: skip
def test_what_only_the_data_rules_out_is_a_config_error_found_by_the_server(four_labels, settings, message):
    cfg = RunConfig.from_run_config({**four_labels, "partition": "iid", **settings})
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_server_test_set(cfg)


def test_an_infeasible_partition_ends_the_run_before_round_one_with_one_line(tiny_run_superlink, four_labels, tmp_path):
    outcome = tiny_run_superlink.run_app({**four_labels, "num-server-rounds": 2, "results-dir": str(tmp_path)}, num_supernodes=3)
    assert outcome.status == "finished:failed", outcome.output[-4000:]
    (run,) = tmp_path.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    reason = summary["reason"]
    assert summary["status"] == "failed" and "\n" not in reason and "Traceback" not in reason and "\x1b[" not in reason
    assert reason.startswith("invalid run config: partition = 'multilabel-skew'") and MISSING_LABEL in reason
    # Found before any site trained: no round recorded, and the log shows no traceback of the server's check.
    assert summary["rounds_completed"] == 0 and not (run / "metrics.jsonl").exists()
    assert "Traceback" not in outcome.output and "[ROUND 1" not in outcome.output
