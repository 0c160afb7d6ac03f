"""The `Command:` line bench.compare writes at the top of results.md must paste back into a shell as the
same arguments: run-config strings hold single-quoted values (`partition='classes-per-site'`). A re-run
reuses a completed run only when its settings are the ones asked for."""

import json
import shlex
import subprocess
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.compare import completed_run, run_in_flower, shell_quote
from fedskew.config import RunConfig


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40))
def test_a_quoted_argument_splits_back_into_itself(argument):
    assert shlex.split(shell_quote(argument)) == [argument]


def test_a_run_config_with_single_quoted_values_stays_readable():
    spec = "factory-dp-z1:factory:factory.dp-noise-multiplier=1.0 partition='classes-per-site'"
    assert shell_quote(spec) == f'"{spec}"'


def _completed(run_dir, config: dict):
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
    (run_dir / "config.json").write_text(json.dumps(RunConfig.from_run_config(config).to_run_config()))


def test_a_completed_run_is_reused_only_for_the_same_settings(tmp_path):
    wanted = {"method": "fedavg", "num-server-rounds": 8, "results-dir": str(tmp_path)}
    assert completed_run(tmp_path / "absent", wanted) is None
    _completed(tmp_path / "run-a", {**wanted, "results-dir": "elsewhere"})  # where it was written does not matter
    assert completed_run(tmp_path, wanted) == tmp_path / "run-a"
    with pytest.raises(SystemExit, match="num-server-rounds: 8 there, 4 now"):
        completed_run(tmp_path, {**wanted, "num-server-rounds": 4})
    (tmp_path / "run-a" / "config.json").unlink()  # a damaged run: one clear error naming it, no traceback
    with pytest.raises(SystemExit, match=r"run-a holds a completed run whose config.json cannot be read"):
        completed_run(tmp_path, wanted)


def test_a_baseline_run_is_reused_when_only_a_factory_setting_differs(tmp_path):
    # A baseline never reads factory.*: its run stays valid when a factory default changes; a factory run does not.
    baseline = {"method": "centralized", "factory.samples-per-class": 300}
    _completed(tmp_path / "centralized" / "run", baseline)
    assert completed_run(tmp_path / "centralized", {**baseline, "factory.samples-per-class": 0}) is not None
    factory = {"method": "factory", "mosaic-grid": 0, "partition": "iid", "factory.samples-per-class": 300}
    _completed(tmp_path / "factory" / "run", factory)
    with pytest.raises(SystemExit, match="factory.samples-per-class: 300 there, 0 now"):
        completed_run(tmp_path / "factory", {**factory, "factory.samples-per-class": 0})


class _SuperLinkPastItsTimeout:
    def run_app(self, run_config, num_sites, timeout, echo):
        raise subprocess.TimeoutExpired(["flwr", "run"], timeout)


class _SuperLinkWithAFailedRun:
    def run_app(self, run_config, num_sites, timeout, echo):
        return SimpleNamespace(completed=False, status="failed", output="ValueError: bad site data")


def test_a_run_past_its_timeout_or_failed_is_one_clear_error_naming_it(tmp_path):
    config = {"method": "factory", "results-dir": str(tmp_path / "runs" / "factory-seed0")}
    with pytest.raises(SystemExit, match=r"factory seed 0 did not finish within --timeout 3600 s .*larger --timeout") as stop:
        run_in_flower(_SuperLinkPastItsTimeout(), "factory seed 0", config, 10, 3600, tmp_path)
    assert str(tmp_path / "results.md") in str(stop.value) and config["results-dir"] in str(stop.value)
    with pytest.raises(SystemExit, match="factory seed 0 ended failed:\nValueError: bad site data"):
        run_in_flower(_SuperLinkWithAFailedRun(), "factory seed 0", config, 10, 3600, tmp_path)
