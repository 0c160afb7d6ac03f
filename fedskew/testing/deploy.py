"""A real deployment's processes on one host: a SuperLink with TLS, SuperNode authentication and a
state database, the fleet proxy that is the sites' only way in (docker/fleet-proxy.conf.template), the
index of apps the federation signed (fedskew/app_signing.py), and SuperNodes that each read their own
site folder and run only signed apps. Used by tests and for trying a deployment locally before taking
it to the sites (docs/deployment.md has the same steps by hand).

Every process runs in its own session (process group) with offline settings, logs to a file and is
stopped by its process group: a SuperNode in subprocess isolation starts a `flower-superexec` that
starts one ClientApp process per message, and all of them go with it. The flwr CLI talks to the
SuperLink through a connection written to this deployment's own FLWR_HOME.

Certificates come from docker/certs.sh (CA + server certificate with SANs) and SuperNode keys from
docker/keys.sh (ssh-keygen ECDSA P-384).
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import string
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fedskew.testing.launch import APP_DIR, OFFLINE_ENV, RunOutcome, finished_listing, free_port, run_config_toml

LOOPBACK = "127.0.0.1"
# What the processes write (the SuperLink's state.db, the ServerApp's results, a site's cache) is for the user
# running them only: 0600 files, 0700 folders, as `umask 077` does in docs/deployment.md.
PRIVATE_UMASK = 0o077
PROXY_TEMPLATE = APP_DIR / "docker" / "fleet-proxy.conf.template"


@dataclass(frozen=True)
class TlsFiles:
    """What docker/certs.sh writes: the CA certificate every party trusts and the SuperLink's pair."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def in_folder(cls, folder: str | Path) -> TlsFiles:
        folder = Path(folder)
        files = cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")
        missing = [str(p) for p in (files.ca_cert, files.server_cert, files.server_key) if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"TLS files missing: {', '.join(missing)}; create them with docker/certs.sh {folder}")
        return files


class FlowerProcess:
    """One long-running Flower command in its own session, logging to `log_path`."""

    def __init__(self, name: str, argv: list[str], env: Mapping[str, str], log_path: Path, cwd: Path | None = None):
        self.name, self.argv, self.env, self.log_path, self.cwd = name, argv, dict(env), log_path, cwd
        self.process: subprocess.Popen | None = None

    def start(self) -> FlowerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                umask=PRIVATE_UMASK,
            )
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, with no goodbye to the SuperLink."""
        self._signal_group(signal.SIGKILL)
        if self.process:
            self.process.wait()

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the process group (a graceful shutdown), SIGKILL what is left after `timeout` s."""
        if not self.running:
            self._signal_group(signal.SIGKILL)  # children of an exited leader may still run
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)  # the session id is the leader's pid (start_new_session)
        except ProcessLookupError:
            pass


def offline_env(flwr_home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **OFFLINE_ENV, **(extra or {}), "FLWR_HOME": str(flwr_home)}


def connection_toml(name: str, address: str, ca_cert: Path | None) -> str:
    """A flwr CLI config.toml with one default connection; Flower wants the CA certificate's absolute path."""
    security = f'root-certificates = "{Path(ca_cert).resolve()}"' if ca_cert else "insecure = true"
    return f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{address}"\n{security}\n'


def wait_healthy(process: FlowerProcess, address: str, ca_cert: Path | None, timeout: float) -> None:
    """Until GET /health at `address` succeeds (https checked against `ca_cert` when given)."""
    scheme = "https" if ca_cert else "http"
    verify = ssl.create_default_context(cafile=str(ca_cert)) if ca_cert else True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.running:
            raise RuntimeError(f"{process.name} exited; its log:\n{process.log_text()[-3000:]}")
        try:
            if httpx.get(f"{scheme}://{address}/health", verify=verify, timeout=1).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{process.name} not healthy after {timeout} s; see {process.log_path}")


class SuperLink:
    """`flower-superlink` on a free loopback port: TLS when `tls` is given (else --insecure),
    SuperNode authentication when `supernode_auth`, state in `home/state.db`, ServerApps in
    subprocesses, and a flwr CLI connection named `connection` in `home/config.toml`. `env` adds
    environment variables (e.g. OMP_NUM_THREADS) to the SuperLink and the ServerApps it starts.
    With `fleet_proxy` the SuperNodes connect through a FleetProxy (the Control API stays on this
    loopback port); `app_index` is the URL of the signed-app index it fetches `@publisher/name==x.y.z`
    apps from; `submit` runs `app` (an app folder or such an app spec)."""

    def __init__(
        self,
        home: str | Path,
        tls: TlsFiles | None,
        supernode_auth: bool = True,
        connection: str = "fedskew",
        env: Mapping[str, str] | None = None,
        fleet_proxy: bool = False,
        app_index: str | None = None,
        app: str | Path = APP_DIR,
    ):
        if supernode_auth and tls is None:
            raise ValueError("SuperNode authentication needs TLS: give the TLS files from docker/certs.sh")
        self.home, self.tls, self.supernode_auth, self.connection = Path(home), tls, supernode_auth, connection
        self.port = free_port()
        self.env = offline_env(self.home, {**(env or {}), **({"FLWR_SUPERGRID_API_URL": app_index} if app_index else {})})
        self.app = app
        self.process: FlowerProcess | None = None
        self.proxy = FleetProxy(self, self.home / "fleet-proxy") if fleet_proxy else None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    @property
    def fleet_address(self) -> str:
        """Where SuperNodes connect: the fleet proxy when there is one."""
        return self.proxy.address if self.proxy else self.address

    def command(self) -> list[str]:
        security = (
            ["--ssl-ca-certfile", str(self.tls.ca_cert), "--ssl-certfile", str(self.tls.server_cert),
             "--ssl-keyfile", str(self.tls.server_key)]
            if self.tls else ["--insecure"]
        )  # fmt: skip
        return [
            "flower-superlink", *security, *(["--enable-supernode-auth"] if self.supernode_auth else []),
            "--database", str(self.home / "state.db"), "--isolation", "subprocess",
            "--disable-runtime-dependency-installation", "--host", LOOPBACK, "--port", str(self.port),
        ]  # fmt: skip

    def start(self, timeout: float = 60) -> SuperLink:
        self.home.mkdir(parents=True, exist_ok=True)
        ca_cert = self.tls.ca_cert if self.tls else None
        (self.home / "config.toml").write_text(connection_toml(self.connection, self.address, ca_cert))
        self.process = FlowerProcess("flower-superlink", self.command(), self.env, self.home / "superlink.log").start()
        try:
            wait_healthy(self.process, self.address, ca_cert, timeout)
            if self.proxy:
                self.proxy.start(timeout)
        except BaseException:
            self.stop()  # `with` never reaches __exit__ when __enter__ raises
            raise
        return self

    def stop(self) -> None:
        if self.proxy:
            self.proxy.stop()
        if self.process:
            self.process.stop()

    def __enter__(self) -> SuperLink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the flwr CLI against this SuperLink ------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["flwr", *args], env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout)

    def register(self, public_key: str | Path) -> None:
        """`flwr supernode register`: admit the SuperNode holding the matching private key."""
        result = self.flwr("supernode", "register", str(public_key), self.connection)
        if result.returncode != 0:
            raise RuntimeError(f"registering {public_key} failed:\n{result.stdout}{result.stderr}")

    def runs(self) -> list[dict]:
        listing = self.flwr("ls", self.connection, "--format", "json")
        return json.loads(listing.stdout).get("runs", []) if listing.returncode == 0 else []

    def submit(self, run_config: dict[str, Any], app: str | Path | None = None) -> int:
        """`flwr run` the app (default: `self.app`) with these run-config overrides; returns the run id
        without waiting."""
        app = self.app if app is None else app
        config_file = self.home / f"run-config-{time.monotonic_ns()}.toml"
        config_file.write_text(run_config_toml(run_config))
        result = self.flwr("run", str(app), self.connection, "--run-config", str(config_file), "--format", "json")
        try:
            return int(json.loads(result.stdout)["run-id"])
        except (ValueError, KeyError) as err:
            raise RuntimeError(f"flwr run did not start a run:\n{result.stdout}{result.stderr}") from err

    def wait(self, run_id: int, timeout: float = 600) -> RunOutcome:
        """Poll `flwr ls` until the run finishes (or `timeout` s pass); the outcome carries its log."""
        listing = finished_listing(self.runs, run_id, timeout)
        log = self.flwr("log", str(run_id), self.connection, "--show")
        return RunOutcome.of_listing(run_id, listing, log.stdout + log.stderr)


class FleetProxy:
    """nginx on a free loopback port in front of `link` (docker/fleet-proxy.conf.template): TLS with the
    SuperLink's certificate, the Fleet API and /health passed on, everything else refused with 403."""

    def __init__(self, link: SuperLink, home: str | Path):
        if link.tls is None:
            raise ValueError("the fleet proxy serves TLS: give the SuperLink the TLS files from docker/certs.sh")
        self.link, self.home = link, Path(home)
        self.port = free_port()
        self.process: FlowerProcess | None = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def config(self) -> str:
        tls = self.link.tls
        return string.Template(PROXY_TEMPLATE.read_text()).substitute(
            RUN_DIR=self.home, LISTEN=self.address, SERVER_CERT=tls.server_cert.resolve(),
            SERVER_KEY=tls.server_key.resolve(), CA_CERT=tls.ca_cert.resolve(), UPSTREAM=self.link.address,
            UPSTREAM_NAME="localhost",  # nginx checks DNS names only; docker/certs.sh puts localhost in the SANs
        )  # fmt: skip

    def start(self, timeout: float = 30) -> FleetProxy:
        self.home.mkdir(parents=True, exist_ok=True)
        conf = self.home / "nginx.conf"
        conf.write_text(self.config())
        argv = ["nginx", "-p", str(self.home), "-e", "stderr", "-c", str(conf)]
        self.process = FlowerProcess("nginx", argv, os.environ, self.home / "nginx.log").start()
        wait_healthy(self.process, self.address, self.link.tls.ca_cert, timeout)
        return self

    def stop(self) -> None:
        if self.process:
            self.process.stop()


def node_config_arg(node_config: Mapping[str, Any]) -> str:
    """The --node-config string: strings as TOML literal strings, which take paths verbatim."""
    pairs = []
    for key, value in node_config.items():
        if isinstance(value, str):
            if "'" in value:
                raise ValueError(f"node config {key} = {value!r} contains a single quote; valid: a value without \"'\"")
            value = f"'{value}'"
        elif isinstance(value, bool):
            value = str(value).lower()
        pairs.append(f"{key}={value}")
    return " ".join(pairs)


def logged_node_id(process: FlowerProcess) -> int | None:
    """The id the SuperLink gave a `flower-supernode` process (from its log), None before it connected."""
    found = re.search(r"SuperNode ID: (\d+)", process.log_text())
    return int(found.group(1)) if found else None


def wait_node_id(process: FlowerProcess, timeout: float = 60) -> int:
    """A `flower-supernode` process's node id, once the SuperLink has admitted it."""
    deadline = time.monotonic() + timeout
    while (node_id := logged_node_id(process)) is None:
        if not process.running:
            raise RuntimeError(f"flower-supernode exited; its log:\n{process.log_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"flower-supernode not connected after {timeout} s; see {process.log_path}")
        time.sleep(0.3)
    return node_id


class SuperNode:
    """`flower-supernode` connected to `link`, with its own FLWR_HOME and Runtime API port; it
    authenticates with `private_key` when given; ClientApps run in subprocesses and inherit `env`; with
    `trusted_entities` (a YAML file: key id -> Ed25519 public key) it runs only apps signed by those keys."""

    def __init__(
        self,
        link: SuperLink,
        home: str | Path,
        node_config: Mapping[str, Any],
        private_key: str | Path | None = None,
        max_retries: int | None = None,
        env: Mapping[str, str] | None = None,
        trusted_entities: str | Path | None = None,
    ):
        self.link, self.home, self.node_config = link, Path(home), dict(node_config)
        self.private_key, self.max_retries, self.extra_env = private_key, max_retries, dict(env or {})
        self.trusted_entities = trusted_entities
        self.port = free_port()
        self.process: FlowerProcess | None = None

    def command(self) -> list[str]:
        link = self.link
        security = ["--root-certificates", str(link.tls.ca_cert)] if link.tls else ["--insecure"]
        return [
            "flower-supernode", "--superlink", link.fleet_address, *security,
            *(["--auth-supernode-private-key", str(self.private_key)] if self.private_key else []),
            *(["--trusted-entities", str(self.trusted_entities)] if self.trusted_entities else []),
            *(["--max-retries", str(self.max_retries)] if self.max_retries is not None else []),
            "--node-config", node_config_arg(self.node_config),
            "--isolation", "subprocess", "--host", LOOPBACK, "--port", str(self.port),
        ]  # fmt: skip

    def start(self) -> SuperNode:
        self.home.mkdir(parents=True, exist_ok=True)
        env = offline_env(self.home, self.extra_env)
        self.process = FlowerProcess("supernode", self.command(), env, self.home / "supernode.log").start()
        return self

    @property
    def node_id(self) -> int | None:
        """The id the SuperLink gave this node (from its log), None before it connected."""
        return logged_node_id(self.process) if self.process else None

    def wait_connected(self, timeout: float = 60) -> int:
        """The node id, once the SuperLink has admitted this node."""
        return wait_node_id(self.process, timeout)

    def wait_exit(self, timeout: float = 60) -> int:
        return self.process.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process:
            self.process.stop()

    def kill(self) -> None:
        if self.process:
            self.process.kill()


@contextmanager
def connected(nodes: Sequence[SuperNode]) -> Iterator[Sequence[SuperNode]]:
    """Start every SuperNode, wait until all are connected, and stop them all on the way out."""
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_connected()
        yield nodes
    finally:
        for node in nodes:
            node.stop()
