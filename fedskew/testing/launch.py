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
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fedskew.config import _toml_value

APP_DIR = Path(__file__).resolve().parents[2]
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


_PORTS_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process: the OS may give the port it
    just released to the next bind, and two components of one Ray node (or one SuperLink) given the same
    port refuse to start."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _PORTS_HANDED_OUT:
            _PORTS_HANDED_OUT.add(port)
            return port


def run_config_toml(run_config: dict[str, Any]) -> str:
    return "".join(f"{key} = {_toml_value(value)}\n" for key, value in run_config.items())


def processes_with_env(name: str, value: str) -> list[int]:
    """Ids of the processes (other than this one) whose environment sets name=value, read from /proc
    (none where there is no /proc or a process's environment is not readable)."""
    wanted, found = f"{name}={value}".encode(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return [pid for pid in found if pid != os.getpid()]


def stop_processes(pids: list[int], grace: float = 10) -> None:
    """SIGTERM each process, SIGKILL those still alive after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [pid for pid in alive if _running(pid)]
        pids = alive


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (an exited child nobody has waited for yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class RunOutcome:
    run_id: int | None
    status: str
    output: str
    listing: dict = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        return self.status == "finished:completed"

    @classmethod
    def of_listing(cls, run_id: int, listing: dict, output: str) -> RunOutcome:
        return cls(run_id, listing.get("status", "not-found"), output, listing)


def finished_listing(runs: Callable[[], list[dict]], run_id: int, timeout: float) -> dict:
    """Poll `runs` (a SuperLink's `flwr ls`) until run `run_id` is listed as finished or `timeout` s pass; its
    listing then, or {} if it was never listed."""
    deadline = time.monotonic() + timeout
    while True:
        run = next((r for r in runs() if r["run-id"] == str(run_id)), {})  # listed as a string
        if run.get("status", "").startswith("finished") or time.monotonic() > deadline:
            return run
        time.sleep(1)


class SimulationSuperLink:
    """A `flower-superlink --simulation` on free loopback ports with its own FLWR_HOME. With `ray_address`
    its simulations run on that running Ray cluster (Ray reads RAY_ADDRESS when Flower's simulation engine
    calls `ray.init()`) instead of starting a Ray instance of their own."""

    def __init__(self, home: Path | None = None, ray_address: str | None = None):
        self.home = Path(home or tempfile.mkdtemp(prefix="fedskew-flwr-"))
        self.port, self.control_port = free_port(), free_port()
        self.env = {**os.environ, **OFFLINE_ENV, "FLWR_HOME": str(self.home)}
        if ray_address:
            self.env["RAY_ADDRESS"] = ray_address
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
        # A run's flwr-simulation process and its Ray workers leave the SuperLink's process group, so a run
        # stopped half-way (a --timeout in bench.compare) would go on computing; they all carry this FLWR_HOME.
        stop_processes(processes_with_env("FLWR_HOME", str(self.home)))

    def flwr(self, *args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["flwr", *args], env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )

    def stream_flwr(
        self, *args: str, timeout: float, cwd: Path | None = None, echo: bool = False,
        on_line: Callable[[str], None] | None = None,
    ) -> str:
        """`flwr ARGS` with stdout and stderr merged, returned whole; echoed as it arrives when asked, so a
        long run shows its progress, and each line handed to `on_line` as it arrives; killed after `timeout`
        seconds like subprocess.run would."""
        process = subprocess.Popen(
            ["flwr", *args], env=self.env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        watchdog = threading.Timer(timeout, process.kill)
        watchdog.start()
        lines = []
        try:
            for line in process.stdout:
                lines.append(line)
                if on_line:
                    on_line(line)
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
        ray_cpus: int | None = None,
        echo: bool = False,
        on_line: Callable[[str], None] | None = None,
    ) -> RunOutcome:
        """`flwr run` the app with these run-config overrides; wait for it and report its status.
        echo=True also prints the run's log (the sites' progress included) line by line as it arrives;
        `on_line` gets each line as it arrives. ray_cpus: the CPUs the simulation's own Ray instance may use
        (init-args-num-cpus; default all), so ray_cpus / cpus_per_client ClientApps run at a time."""
        config_file = self.home / f"run-config-{time.monotonic_ns()}.toml"
        config_file.write_text(run_config_toml(run_config))
        output = self.stream_flwr(
            "run", str(app_dir), "sim", "--run-config", str(config_file), "--stream",
            "--federation-config",
            f"num-supernodes={num_supernodes} client-resources-num-cpus={cpus_per_client} client-resources-num-gpus=0.0"
            + (f" init-args-num-cpus={ray_cpus}" if ray_cpus else ""),
            timeout=timeout, cwd=app_dir, echo=echo, on_line=on_line,
        )  # fmt: skip
        started = re.search(r"Successfully started run (\d+)", output)
        if not started:
            return RunOutcome(None, "not-started", output)
        run_id = int(started.group(1))
        # The log stream can end a moment before the run's status is final.
        return RunOutcome.of_listing(run_id, finished_listing(self.runs, run_id, timeout=60), output)


class RayCluster:
    """A Ray cluster of separate processes, as on several machines: a head node (`ray start --head`) and
    `worker_nodes` more nodes joined to it (`ray start --address`), each in its own process group and temp
    dir, so that leaving the context stops this cluster's processes and no other Ray instance on the machine
    (`ray stop` would stop them all). Worker node k listens on loopback address 127.0.0.(k+1): Ray prefixes a
    line printed on a node other than the driver's with that node's address (`(ClientAppActor pid=...,
    ip=127.0.0.2)`), as it does on real machines. A `ray.init()` elsewhere on the machine looks for a cluster
    in the default temp dir and never joins this one.
    """

    def __init__(self, worker_nodes: int = 1, cpus_per_node: int = 1):
        self.worker_nodes, self.cpus_per_node = worker_nodes, cpus_per_node
        self.temp_dir = Path(tempfile.mkdtemp(prefix="fsray-", dir="/tmp"))
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.processes: list[subprocess.Popen] = []
        self.logs: list = []

    def _start_node(self, index: int) -> None:
        head = ["--head", "--port", str(self.gcs_port), "--ray-client-server-port", str(free_port()),
                "--include-dashboard", "false"]
        worker = ["--address", self.address, "--node-ip-address", f"127.0.0.{index + 1}"]
        temp_dir = self.temp_dir / f"n{index}"  # short: Ray's socket paths under it must fit in 107 characters
        ports = [f"--{name}={free_port()}" for name in (
            "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")]
        log = open(self.temp_dir / f"node{index}.log", "w")  # noqa: SIM115 - closed in __exit__
        self.logs.append(log)
        self.processes.append(subprocess.Popen(
            ["ray", "start", "--block", *(worker if index else head), "--num-cpus", str(self.cpus_per_node),
             "--num-gpus", "0", "--object-store-memory", str(100 * 2**20), "--temp-dir", str(temp_dir),
             "--disable-usage-stats", *ports],
            env={**os.environ, **OFFLINE_ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        ))  # fmt: skip

    def __enter__(self) -> RayCluster:
        try:
            self._start_node(0)
            self._wait_for_nodes(1, timeout=120)
            for index in range(1, self.worker_nodes + 1):
                self._start_node(index)
            self._wait_for_nodes(1 + self.worker_nodes, timeout=120)
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)  # keeps the node logs the error points at
            raise
        return self

    def alive_nodes(self) -> list[str]:
        """The ids of the nodes the head's GCS reports alive (`ray list nodes` needs the dashboard; the GCS
        itself answers `ray status`)."""
        status = subprocess.run(["ray", "status", "--address", self.address, "-v"], env={**os.environ, **OFFLINE_ENV},
                                capture_output=True, text=True, timeout=60)
        if status.returncode != 0:
            return []
        active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        return re.findall(r"node_\w+", active)

    def _wait_for_nodes(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index, process in enumerate(self.processes):
                if process.poll() is not None:
                    log = (self.temp_dir / f"node{index}.log").read_text().strip().splitlines()
                    raise RuntimeError(f"ray node {index} exited ({process.returncode}); the end of "
                                       f"{self.temp_dir}/node{index}.log: {log[-1] if log else '(empty)'}")
            if len(self.alive_nodes()) >= count:
                return
            time.sleep(1)
        raise TimeoutError(f"Ray cluster: {count} node(s) not up after {timeout} s; see {self.temp_dir}/node*.log")

    def __exit__(self, *exc) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for log in self.logs:
            log.close()
        if not exc or exc[0] is None:  # after a failure the node logs say why; keep them
            shutil.rmtree(self.temp_dir, ignore_errors=True)


class ProcessTreeCPU:
    """CPU seconds (user + system) of a process and every process under it, sampled from /proc every
    `interval` seconds in a background thread: each process counts with the last figure seen, so one that
    has exited still counts (up to one interval of its end). Linux only."""

    def __init__(self, root_pid: int, interval: float = 0.2):
        self.root_pid, self.interval = root_pid, interval
        self.seen: dict[int, float] = {}
        self.labels: dict[int, str] = {}
        self._ticks = os.sysconf("SC_CLK_TCK")
        self._lock = threading.Lock()  # the sampling thread and a caller's sample() both update `seen`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _stats(self) -> dict[int, tuple[int, float]]:
        """pid -> (parent pid, CPU seconds) of every process on the machine."""
        stats = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self._ticks)
        return stats

    def sample(self) -> float:
        stats = self._stats()
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in stats.items():
            children.setdefault(parent, []).append(pid)
        stack = [self.root_pid]
        with self._lock:
            while stack:
                pid = stack.pop()
                if pid in stats:
                    self.seen[pid] = max(self.seen.get(pid, 0.0), stats[pid][1])
                    if pid not in self.labels:
                        self.labels[pid] = process_label(pid)
                stack.extend(children.get(pid, []))
            return sum(self.seen.values())

    def by_process(self) -> dict[str, float]:
        """CPU seconds so far per kind of process (its program, see process_label)."""
        totals: dict[str, float] = {}
        with self._lock:
            for pid, seconds in self.seen.items():
                totals[self.labels[pid]] = totals.get(self.labels[pid], 0.0) + seconds
        return totals

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> ProcessTreeCPU:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def process_label(pid: int) -> str:
    """What a process is, from its command line: the script a Python interpreter runs (flower-superlink,
    flwr-simulation, ...; Ray's workers, which host the ClientApp actors, as one kind) or the program (raylet,
    gcs_server)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [Path(a.decode(errors="replace")).name for a in argv if a]
    if not words:
        return "?"
    if words[0].startswith("ray::"):  # Ray retitles its workers after their task (ray::IDLE, ray::ClientAppActor...)
        return "Ray worker (ClientApp actor)"
    if words[0].startswith("python") and len(words) > 1:
        if words[1] in ("-c", "-m"):
            return f"python {words[1]} {words[2] if words[1] == '-m' and len(words) > 2 else '...'}"
        if "default_worker.py" in words:  # Ray's worker entry point (started through setup_worker.py)
            return "Ray worker (ClientApp actor)"
        return next((w for w in words[1:] if not w.startswith("-")), words[1])
    return words[0]
