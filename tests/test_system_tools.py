"""The tests that need a system program skip on a developer's machine without it, naming its Debian
package, and fail under CI, which installs every such package (.ci/run): CI cannot pass with them skipped."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from system_tools import DEBIAN_PACKAGES, missing_tool_message, require_tool

TESTS = Path(__file__).resolve().parent


def outcome_of_requiring(command: str) -> tuple[type, str]:
    try:
        return str, require_tool(command)
    except (pytest.skip.Exception, pytest.fail.Exception) as raised:  # what the calling test would end with
        return type(raised), str(raised)


def test_a_missing_program_skips_naming_its_package_and_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no program at all
    monkeypatch.delenv("CI", raising=False)
    assert outcome_of_requiring("nginx") == (pytest.skip.Exception, "needs nginx: apt-get install nginx-light")
    monkeypatch.setenv("CI", "true")
    ended, message = outcome_of_requiring("nginx")
    assert ended is pytest.fail.Exception and message.startswith("needs nginx: apt-get install nginx-light (CI is set")
    (tmp_path / "nginx").write_text("#!/bin/sh\n")
    (tmp_path / "nginx").chmod(0o755)
    assert outcome_of_requiring("nginx") == (str, str(tmp_path / "nginx"))


def test_ci_is_told_the_package_of_every_missing_program(tmp_path):
    # What .ci/run installs: the packages of the programs missing here, one a line.
    env = {**os.environ, "PATH": str(tmp_path)}
    listed = subprocess.run([sys.executable, str(TESTS / "system_tools.py")], env=env, capture_output=True, text=True, check=True)
    assert listed.stdout.split() == sorted(set(DEBIAN_PACKAGES.values()))
    assert "tests/system_tools.py" in (TESTS.parent / ".ci" / "run").read_text()


def test_no_test_skips_on_a_missing_program_by_itself():
    """A skip written beside the test (skipif(shutil.which(...))) would pass CI silently: every test that needs a
    program asks require_tool."""
    checked_alone = []
    for path in set(TESTS.glob("*.py")) - {Path(__file__)}:
        for line_number, line in enumerate(path.read_text().splitlines(), 1):
            if "which(" in line and re.search(r"skip|return", line):
                checked_alone.append(f"{path.name}:{line_number}: {line.strip()}")
    assert not checked_alone, "use system_tools.require_tool:\n" + "\n".join(checked_alone)


def test_every_program_the_tests_name_has_its_package():
    assert missing_tool_message("ssh-keygen") == "needs ssh-keygen: apt-get install openssh-client"
    asked = {name for path in TESTS.glob("*.py") for name in re.findall(r"require_tool\(\"([^\"]+)\"\)", path.read_text())}
    assert {"openssl", "ssh-keygen", "nginx", "docker-compose", "chromium"} <= asked <= set(DEBIAN_PACKAGES), asked
