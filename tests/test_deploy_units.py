"""The coordinating centre on bare metal as services (deploy/, docs/deployment.md "Bare metal as a service"):
the SuperLink as its own unprivileged user with private state, systemd accepting the units, and the
nftables rule refusing every account but the allowed ones a connection to the SuperLink's loopback port."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from system_tools import require_tool

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNITS = sorted(DEPLOY.glob("*.service"))
INSTALLED_BIN = "/opt/fedskew/venv/bin/"  # where the units expect the project


def unit_settings(path: Path) -> dict[str, list[str]]:
    """A unit file's settings, key -> its values in order (a key may repeat), continuation lines joined."""
    settings: dict[str, list[str]] = {}
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    for line in text.splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def one(settings: dict[str, list[str]], key: str) -> str:
    (value,) = settings[key]
    return value


def environment(settings: dict[str, list[str]]) -> dict[str, str]:
    return dict(pair.split("=", 1) for line in settings.get("Environment", []) for pair in shlex.split(line))


def flag(command: str, name: str) -> str:
    tokens = shlex.split(command)
    return tokens[tokens.index(name) + 1]


def nft_defines() -> dict[str, str]:
    return dict(re.findall(r"^define (\w+) = (.+)$", (DEPLOY / "superlink-loopback.nft").read_text(), re.M))


def sysusers() -> set[str]:
    lines = (DEPLOY / "fedskew.sysusers.conf").read_text().splitlines()
    return {line.split()[1] for line in lines if line.startswith("u ")}


def test_the_superlink_runs_as_its_own_user_on_loopback_with_private_state():
    superlink = unit_settings(DEPLOY / "fedskew-superlink.service")
    user = one(superlink, "User")
    assert user in sysusers() and user != "root"
    assert one(superlink, "UMask") == "0077" and one(superlink, "StateDirectoryMode") == "0700"
    state = "/var/lib/" + one(superlink, "StateDirectory")
    assert one(superlink, "WorkingDirectory") == state and environment(superlink)["FLWR_HOME"].startswith(state + "/")
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "CapabilityBoundingSet": "", "RestrictSUIDSGID": "yes"}.items():  # fmt: skip
        assert one(superlink, key) == value, key
    start = one(superlink, "ExecStart")
    assert flag(start, "--host") == "127.0.0.1" and "--enable-supernode-auth" in start
    assert flag(start, "--database").startswith(state + "/")
    port = flag(start, "--port")
    # The loopback rule guards that port, and lets through the SuperLink's own user (its ServerApps reach the
    # Runtime API there) and the fleet proxy's, which forwards to it.
    proxy = unit_settings(DEPLOY / "fedskew-fleet-proxy.service")
    assert environment(proxy)["UPSTREAM"] == f"127.0.0.1:{port}" and one(proxy, "User") in sysusers()
    defines = nft_defines()
    allowed = set(re.findall(r'"([^"]+)"', defines["allowed_users"]))
    assert defines["superlink_port"] == port and {user, one(proxy, "User")} < allowed


def test_systemd_accepts_the_units(tmp_path):
    analyze = require_tool("systemd-analyze")
    bin_dir = str(Path(sys.executable).parent) + "/"  # the units' programs, where this project is installed
    for unit in UNITS:
        (tmp_path / unit.name).write_text(unit.read_text().replace(INSTALLED_BIN, bin_dir))
    checked = subprocess.run([analyze, "verify", *(str(tmp_path / unit.name) for unit in UNITS)],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert checked.returncode == 0 and not checked.stderr.strip(), checked.stderr


def test_systemd_sysusers_creates_the_units_users_who_alone_read_the_tls_key(tmp_path):
    sysusers_tool = require_tool("systemd-sysusers")
    (tmp_path / "etc").mkdir()
    created = subprocess.run([sysusers_tool, f"--root={tmp_path}", str(DEPLOY / "fedskew.sysusers.conf")],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert created.returncode == 0, created.stderr
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc" / "passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":")[3] for line in (tmp_path / "etc" / "group").read_text().splitlines()}
    for unit in ("fedskew-superlink.service", "fedskew-fleet-proxy.service"):
        settings = unit_settings(DEPLOY / unit)
        user = users[one(settings, "User")]
        assert user[-1] == "/usr/sbin/nologin" and int(user[2]) != 0 and one(settings, "Group") in groups
    assert set(groups["fedskew-certs"].split(",")) == {"fedskew-superlink", "fedskew-proxy"}
    assert users["fedskew-superlink"][5] == one(unit_settings(DEPLOY / "fedskew-superlink.service"), "WorkingDirectory")


def _connects_as(user: str, port: int) -> bool:
    """Whether `user` can open a TCP connection to 127.0.0.1:port (bash's /dev/tcp: no program of theirs needed)."""
    opened = subprocess.run(["runuser", "-u", user, "--", "bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"],
                            capture_output=True, timeout=30)  # fmt: skip
    return opened.returncode == 0


def _load_rule(nft: str, text: str) -> subprocess.CompletedProcess:
    return subprocess.run([nft, "-f", "-"], input=text, capture_output=True, text=True, timeout=30)


def test_the_loopback_rule_refuses_every_account_but_the_allowed(tmp_path):
    """deploy/superlink-loopback.nft as written, its two settings pointed at a listener here: user daemon
    allowed, user nobody not."""
    if os.geteuid() != 0:
        pytest.skip("needs root to load nftables rules")
    nft = require_tool("nft")
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)  # the kernel completes the handshakes
    port = listener.getsockname()[1]
    rule = (DEPLOY / "superlink-loopback.nft").read_text()
    defines = nft_defines()
    rule = rule.replace(f"define superlink_port = {defines['superlink_port']}", f"define superlink_port = {port}")
    rule = rule.replace(f"define allowed_users = {defines['allowed_users']}", 'define allowed_users = { "daemon" }')
    try:
        assert _connects_as("nobody", port) and _connects_as("daemon", port)  # open to all before the rule
        loaded = _load_rule(nft, rule)
        if loaded.returncode != 0 and "Operation not permitted" in loaded.stderr:
            pytest.skip(f"this machine may not change its firewall (no CAP_NET_ADMIN): {loaded.stderr.strip()}")
        assert loaded.returncode == 0, loaded.stderr
        assert not _connects_as("nobody", port) and _connects_as("daemon", port)
        assert _load_rule(nft, rule).returncode == 0  # loading again replaces the table
        assert not _connects_as("nobody", port) and _connects_as("daemon", port)
    finally:
        subprocess.run([nft, "delete", "table", "inet", "fedskew_superlink"], capture_output=True, timeout=30)
        listener.close()
