"""docs/deployment.md followed step by step: its sections 1-3 run as written, in their order, with real
processes on loopback (the same commands CI and a reader run), in a copy of the app's folder. A file of its own,
so that pytest-xdist runs it beside tests/test_deploy.py's federation."""

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from system_tools import require_tool

from fedskew.testing.deploy import FlowerProcess
from fedskew.testing.launch import free_port

pytestmark = pytest.mark.walkthrough  # minutes of real processes: CI runs it after the suite (pyproject addopts)

REPO = Path(__file__).resolve().parent.parent
# One thread per process: three sites' ClientApps, the ServerApp and pytest share two cores.
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DEPLOYMENT_PAGE = REPO / "docs" / "deployment.md"
DOCUMENTED_PORTS = ("8090", "9093", "9443", "9094", "9095", "9096")  # app index, SuperLink, fleet proxy, 3 SuperNodes
# docker/certs.sh makes the certificates (never their keys) readable by all: every party gets them, and the
# containers' own user reads them.
PUBLIC_BY_DESIGN = {Path("certs/ca.crt"), Path("certs/server.pem")}
APP_FILES = ("pyproject.toml", "README.md", "LICENSE", "fedskew", "docker")  # what the steps read from the app's folder


def bare_metal_steps() -> str:
    """The shell blocks of deployment.md from "1. Certificates and keys" to the end of "3. Bare metal", in order."""
    text = DEPLOYMENT_PAGE.read_text()
    section = text[text.index("## 1. Certificates and keys") : text.index("## 4. Docker")]
    return "\n".join(re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S))


def test_the_documented_bare_metal_steps_run_a_signed_federation_in_their_order(tmp_path):
    """deployment.md's sections 1-3 as one bash script, in a copy of the app's folder, with each documented port
    moved to a free one: certificates and keys, site folders, the signed app, the app index, the SuperLink, the
    fleet proxy, the operator's connection, registration, three SuperNodes on one host, a one-round signed run
    that completes. Nothing they write is readable by other users or left untracked for git."""
    require_tool("openssl")
    require_tool("ssh-keygen")
    require_tool("nginx")
    require_tool("envsubst")
    app = tmp_path / "app"
    app.mkdir()
    for name in APP_FILES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, app / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, app / name)
    script = bare_metal_steps()
    for port in DOCUMENTED_PORTS:
        assert re.search(rf"\b{port}\b", script), f"deployment.md no longer uses port {port}: update DOCUMENTED_PORTS"
        script = re.sub(rf"\b{port}\b", str(free_port()), script)
    script = "umask 022\n" + script  # a reader's usual umask (FlowerProcess's is private): the steps set their own
    steps = FlowerProcess("bash", ["bash", "-euo", "pipefail", "-c", script], {**os.environ, **THREADS}, tmp_path / "steps.log", cwd=app)
    steps.start()
    try:
        assert steps.process.wait(timeout=900) == 0, steps.log_text()[-5000:]
        listing = subprocess.run(["flwr", "ls", "hospitals", "--format", "json"], cwd=app, capture_output=True, text=True,
                                 env={**os.environ, "FLWR_HOME": str(app / "centre")})  # fmt: skip
    finally:
        steps.stop()  # the backgrounded app index, SuperLink, nginx and SuperNodes: the script's process group
    (run,) = json.loads(listing.stdout)["runs"]
    assert run["status"] == "finished:completed", run
    (results,) = [p for p in (app / "results").iterdir() if p.is_dir()]
    assert json.loads((results / "summary.json").read_text())["status"] == "completed"
    written = [p for p in app.rglob("*") if p.relative_to(app).parts[0] not in APP_FILES]
    assert not readable_by_others(*(p for p in written if p.relative_to(app) not in PUBLIC_BY_DESIGN))
    untracked = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", "-v", "-n", "--stdin"],
                               input="\n".join(str(p.relative_to(app)) for p in written if p.is_file()),
                               capture_output=True, text=True).stdout  # fmt: skip
    assert not [line for line in untracked.splitlines() if line.startswith("::")], untracked


def readable_by_others(*paths: Path) -> list[str]:
    """Those of `paths` whose mode gives the group or other users any access."""
    return [f"{path} {stat.filemode(path.stat().st_mode)}" for path in paths if path.stat().st_mode & 0o077]
