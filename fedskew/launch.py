"""Run the app through real Flower processes, for tests and benchmarks.

`flwr run .` with a `:local:` connection spawns a detached SuperLink that outlives the
command and cannot be stopped by PID. Here we start the simulation SuperLink ourselves, on
ports we choose, with its own FLWR_HOME, and stop it (and the Ray workers under it) by
process group when done. A run is judged by `flwr ls`, since `flwr run --stream` exits 0
even when the ServerApp crashed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fedskew.config import _toml_value

APP_DIR = Path(__file__).resolve().parent.parent
OFFLINE_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "RAY_DISABLE_USAGE_STATS": "1",
    "PYTHONUNBUFFERED": "1",
    # Ray merges lines that differ only in numbers across workers ("[repeated 3x across cluster]"), which
    # would swallow the sites' progress lines (site 0 and site 1 at step 40 look alike to it).
    "RAY_DEDUP_LOGS": "0",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_config_toml(run_config: dict[str, Any]) -> str:
    return "".join(f"{key} = {_toml_value(value)}\n" for key, value in run_config.items())


@dataclass
class RunOutcome:
    run_id: int | None
    status: str
    output: str
    listing: dict = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"


class SimulationSuperLink:
    """A `flower-superlink --simulation` on free loopback ports with its own FLWR_HOME."""

    def __init__(self, home: Path | None = None):
        self.home = Path(home or tempfile.mkdtemp(prefix="fedskew-flwr-"))
        self.port, self.control_port = free_port(), free_port()
        self.env = {**os.environ, **OFFLINE_ENV, "FLWR_HOME": str(self.home)}
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> SimulationSuperLink:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "sim"\n\n'
            f'[superlink.sim]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        log = open(self.home / "superlink.log", "w")  # noqa: SIM115 - closed with the process
        self.process = subprocess.Popen(
            [
                "flower-superlink", "--simulation", "--insecure", "--isolation", "subprocess",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--control-api-address", f"127.0.0.1:{self.control_port}",
                "--database", str(self.home / "state.db"),
            ],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self._wait_healthy(timeout=60)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flower-superlink exited ({self.process.returncode}); see {self.home}/superlink.log")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=0.5).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"flower-superlink not healthy after {timeout} s; see {self.home}/superlink.log")

    def __exit__(self, *exc) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def flwr(self, *args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["flwr", *args], env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )

    def stream_flwr(self, *args: str, timeout: float, cwd: Path | None = None, echo: bool = False) -> str:
        """`flwr ARGS` with stdout and stderr merged, returned whole; echoed as it arrives when asked, so a
        long run shows its progress; killed after `timeout` seconds like subprocess.run would."""
        process = subprocess.Popen(
            ["flwr", *args], env=self.env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        watchdog = threading.Timer(timeout, process.kill)
        watchdog.start()
        lines = []
        try:
            for line in process.stdout:
                lines.append(line)
                if echo:
                    print(line, end="", flush=True)
            process.wait()
        finally:
            watchdog.cancel()
        if process.returncode == -signal.SIGKILL:
            raise subprocess.TimeoutExpired(process.args, timeout, output="".join(lines))
        return "".join(lines)

    def runs(self) -> list[dict]:
        listing = self.flwr("ls", "--format", "json")
        return json.loads(listing.stdout).get("runs", []) if listing.returncode == 0 else []

    def run_app(
        self,
        run_config: dict[str, Any],
        num_supernodes: int,
        app_dir: Path = APP_DIR,
        timeout: float = 900,
        cpus_per_client: int = 1,
        echo: bool = False,
    ) -> RunOutcome:
        """`flwr run` the app with these run-config overrides; wait for it and report its status.
        echo=True also prints the run's log (the sites' progress included) line by line as it arrives."""
        config_file = self.home / f"run-config-{time.monotonic_ns()}.toml"
        config_file.write_text(run_config_toml(run_config))
        known = {r["run-id"] for r in self.runs()}
        output = self.stream_flwr(
            "run", str(app_dir), "sim", "--run-config", str(config_file), "--stream",
            "--federation-config",
            f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client} client-resources-num-gpus=0.0",
            timeout=timeout, cwd=app_dir, echo=echo,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            new = [r for r in self.runs() if r["run-id"] not in known]
            if new and new[0]["status"].startswith("finished") or time.monotonic() > deadline:
                break
            time.sleep(1)
        if not new:
            return RunOutcome(None, "not-started", output)
        return RunOutcome(new[0]["run-id"], new[0]["status"], output, new[0])
