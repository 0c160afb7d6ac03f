"""A real deployment on loopback: one SuperLink with TLS, SuperNode authentication and a state
database (shared by the tests of this module), SuperNodes that read site folders written by
`fedskew prepare-sites`, and `flwr run` through a TLS connection in the SuperLink's own FLWR_HOME.
The SuperNodes reach the SuperLink only through the fleet proxy (nginx, Fleet API only) and run only
apps signed by the federation's key, which the SuperLink fetches from the federation's app index.
Certificates and keys come from docker/certs.sh, docker/keys.sh and docker/app-key.sh. Every process
is stopped by its process group at the end of the test that started it. Also: the docker-compose files validate
and only use flags the installed Flower accepts."""

import json
import os
import re
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import flwr
import httpx
import numpy as np
import pytest
import yaml
from cryptography import x509
from flwr.common.config import parse_config_args

from multihot_npz import write_multihot_npz
from system_tools import require_tool
from test_deploy_steps import THREADS, readable_by_others

from fedskew.app_signing import UNVERIFIED_APP, UNVERIFIED_APP_CAUSE, AppIndex, publish_app
from fedskew.cli import main as cli_main
from fedskew.config import RunConfig
from fedskew.data.site_folder import load_test_set
from fedskew.testing.deploy import SuperLink, SuperNode, TlsFiles, connected, connection_toml, node_config_arg, offline_env
from fedskew.testing.launch import APP_DIR, free_port

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
TINY = {"num-server-rounds": 2, "batch-size": 64, "min-site-size": 5, "local-epochs": 1}
SITES = ["--sites", "3", "--mosaic-grid", "0", "--labels", "auto", "--partition", "multilabel-skew",
         "--alpha", "0.1", "--missing-classes", "3", "--seed", "0"]  # fmt: skip
# FederatedFactory needs single-label sites; four classes each keeps the generator count (and time) small.
FACTORY_SITES = ["--sites", "3", "--dataset", "digits", "--mosaic-grid", "0", "--partition", "classes-per-site",
                 "--classes-per-site", "4", "--seed", "0"]  # fmt: skip
TINY_FACTORY = {"method": "factory", "mosaic-grid": 0, "partition": "classes-per-site", "factory.generator-steps": 4, "factory.audit-samples": 8,
                "factory.sampler-steps": 3, "factory.samples-per-class": 24, "factory.classifier": "small-cnn",
                "factory.classifier-epochs": 2}  # fmt: skip

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    require_tool("openssl")
    require_tool("ssh-keygen")
    root = tmp_path_factory.mktemp("pki")
    subprocess.run([str(DOCKER / "certs.sh"), str(root / "certs")], check=True, capture_output=True)
    keys = ["site-0", "site-1", "site-2", "site-3", "intruder"]
    subprocess.run([str(DOCKER / "keys.sh"), str(root / "keys"), *keys], check=True, capture_output=True)
    for signer in ("app-key", "forger-key"):  # the federation's app-signing key, and somebody else's
        subprocess.run([str(DOCKER / "app-key.sh"), str(root / signer)], check=True, capture_output=True)
    return root


@pytest.fixture(scope="module")
def app_index(tmp_path_factory, pki):
    """The federation's app index holding this app signed with the federation's key; served on loopback."""
    folder = tmp_path_factory.mktemp("app-index")
    published = publish_app(APP_DIR, folder, pki / "app-key" / "app-signing", "fedskew-federation")
    with AppIndex(folder, "127.0.0.1", free_port()) as index:
        yield index, published


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """Site folders of a hospital-style multi-hot npz (not a mosaic): labels.csv rows with '|'-joined ids."""
    out = tmp_path_factory.mktemp("sites")
    npz = write_multihot_npz(out / "own.npz")
    assert cli_main(["prepare-sites", *SITES, "--dataset", f"npz:{npz}", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def factory_sites(tmp_path_factory):
    out = tmp_path_factory.mktemp("factory-sites")
    assert cli_main(["prepare-sites", *FACTORY_SITES, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def link(tmp_path_factory, pki, app_index):
    require_tool("nginx")  # the fleet proxy
    index, signed_app = app_index
    tls = TlsFiles.in_folder(pki / "certs")
    home = tmp_path_factory.mktemp("superlink")
    with SuperLink(home, tls, env=THREADS, fleet_proxy=True, app_index=index.url, app=signed_app.spec) as link:
        for k in range(4):  # not the intruder
            link.register(pki / "keys" / f"site-{k}.pub")
        yield link


def with_pythonpath(env, folder):
    """`env` with `folder` first on PYTHONPATH, so its sitecustomize runs in every process of a SuperNode."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / folder), os.environ.get("PYTHONPATH", "")])}


def running_sites(link, pki, home, data_dirs, env=THREADS):
    return connected([
        SuperNode(link, home / f"node-{k}", {"data-dir": str(d), "site-id": k, "num-sites": len(data_dirs)},
                  pki / "keys" / f"site-{k}", env=env, trusted_entities=pki / "app-key" / "trusted-entities.yaml")
        for k, d in enumerate(data_dirs)
    ])  # fmt: skip


def _only_run_dir(results_dir):
    (run,) = [p for p in results_dir.iterdir() if p.is_dir()]
    return run


def test_certs_sh_writes_a_server_certificate_for_every_name_the_clients_use(pki):
    cert = x509.load_pem_x509_certificate((pki / "certs" / "server.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"superlink", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    again = subprocess.run([str(DOCKER / "certs.sh"), str(pki / "certs")], capture_output=True, text=True)
    assert again.returncode != 0 and "already holds a CA" in again.stderr


def test_from_a_sites_position_the_control_api_refuses_registration_runs_and_listings(link, pki, tmp_path):
    """A site holds the CA certificate and reaches the fleet proxy only: Flower's Control API (the same
    port as the Fleet API in 1.42, no user authentication) is not there for it."""
    (tmp_path / "config.toml").write_text(connection_toml("site", link.fleet_address, pki / "certs" / "ca.crt"))
    env = offline_env(tmp_path)
    runs_before = link.runs()
    attempts = {
        "register": ["supernode", "register", str(pki / "keys" / "intruder.pub"), "site"],
        "run": ["run", str(APP_DIR), "site"],
        "ls": ["ls", "site"],
    }
    for what, args in attempts.items():
        result = subprocess.run(["flwr", *args], env=env, capture_output=True, text=True, timeout=120)
        output = result.stdout + result.stderr
        assert result.returncode != 0 and "403 Forbidden" in output, f"flwr {what} through the fleet proxy: {output}"
    # The operator, on the SuperLink's own port, sees no new run and no intruder key.
    assert link.runs() == runs_before
    listing = link.flwr("supernode", "list", link.connection, "--format", "json")
    assert listing.returncode == 0, listing.stdout + listing.stderr
    intruder_key = (pki / "keys" / "intruder.pub").read_text().split()[1]
    assert intruder_key not in listing.stdout
    # Nor the Runtime API, through which ServerApps pull their work.
    refused = httpx.post(f"https://{link.fleet_address}/v1/runtime/get-nodes", verify=str(pki / "certs" / "ca.crt"))
    assert refused.status_code == 403


def test_an_unregistered_supernode_is_refused(link, pki, sites, tmp_path):
    intruder = SuperNode(link, tmp_path, {"data-dir": str(sites / "site-0")}, pki / "keys" / "intruder", max_retries=0)
    try:
        assert intruder.start().wait_exit(timeout=90) != 0
        assert "Failed to activate SuperNode" in intruder.process.log_text()
        assert intruder.node_id is None
    finally:
        intruder.stop()


def test_a_fednca_run_over_tls_completes_without_a_killed_site_and_a_site_with_broken_data(link, pki, sites, tmp_path):
    """One federation shows three deployment behaviours (one run, since each costs minutes of
    real processes): three registered TLS sites finish a 2-round FedNCA-ML run with results written, a site
    whose data dir is broken answers every message with the clear error, and a site SIGKILLed after
    round 1 drops out while the others complete the run."""
    broken = tmp_path / "broken-site"
    broken.mkdir()
    (broken / "labels.csv").write_text("file,labels\nscan-001.png,seven\n")
    results = tmp_path / "results"
    data_dirs = [sites / "site-0", sites / "site-1", sites / "site-2", broken]
    # The sites heartbeat every 10 s (tests/short_heartbeat), so the killed site lapses after about 20 s, not 60.
    with running_sites(link, pki, tmp_path, data_dirs, env=with_pythonpath(THREADS, "short_heartbeat")) as nodes:
        # val-fraction 0: train messages only (each message starts a ClientApp process: ~5 CPU-s). The killed
        # site's round-2 message ends with an "unavailable" error once its heartbeat lapses.
        run_id = link.submit({**TINY, "method": "fednca", "dataset": f"npz:{sites / 'own.npz'}", "mosaic-grid": 0,
                              "labels": "auto", "val-fraction": 0.0, "min-available-sites": 2,
                              "round-timeout": 150.0, "results-dir": str(results),
                              "test-data": str(sites / "server-test")})  # fmt: skip
        deadline = time.monotonic() + 300
        while not _round_done(results, 1) and time.monotonic() < deadline:
            time.sleep(1)
        assert _round_done(results, 1), "round 1 never finished"
        killed, broken_node = nodes[2], nodes[3]
        killed_id, broken_id = killed.node_id, broken_node.node_id
        killed.kill()  # SIGKILL: a crash, the SuperLink is not told
        outcome = link.wait(run_id, timeout=400)
    assert outcome.completed, outcome.output[-4000:]
    run = _only_run_dir(results)
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert 0.0 <= rounds[-1]["test"]["f1_macro"] <= 1.0 and "train_loss" in rounds[-1]["train"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    # The label counts the sites reported are those of the folders prepare-sites wrote; the broken site
    # is not part of the federation's partition.
    partition = json.loads((run / "partition.json").read_text())
    assert sorted(s["site-id"] for s in partition["sites"]) == [0, 1, 2]
    written = [(sites / f"site-{k}" / "labels.csv").read_text().count("\n") - 1 for k in range(3)]
    assert [s["train-size"] + s["val-size"] for s in sorted(partition["sites"], key=lambda s: s["site-id"])] == written
    # The broken site answered every message with the clear error, recorded per round.
    reasons = [d["reason"] for d in summary["dropped"] if d["site"] == str(broken_id)]
    assert reasons and all("line 2: labels 'seven' are not class ids" in r for r in reasons)
    assert f"site {broken_id} failed the survey" in outcome.output and "broken-site" in outcome.output
    # Round 2 aggregated the two live sites: the killed one sent one model (round 1), they sent two.
    received = summary["bytes"]["received_per_site"]
    live = [str(n.node_id) for n in nodes[:2]]
    assert received[str(killed_id)] < min(received[n] for n in live)
    assert "aggregate_train: Received 2 results" in outcome.output
    # The killed site's round-2 message ended with the SuperLink's "node unavailable" error once its
    # heartbeat lapsed; the record names the killed site, not the SuperLink that answered for it.
    assert [(d["round"], d["site"]) for d in summary["dropped"] if "heartbeat" in d["reason"]] == [
        (2, str(killed_id))
    ], summary["dropped"]
    assert {d["site"] for d in summary["dropped"]} == {str(broken_id), str(killed_id)}
    # A real deployment moves real bytes (a simulation lists 0).
    assert outcome.listing["network-traffic"]["total-bytes"] > 0
    # The SuperLink's state and the run's results are the centre user's alone.
    assert not readable_by_others(link.home / "state.db", results, *results.rglob("*"))


def test_a_tiny_factory_run_over_tls_keeps_every_honest_sites_generators_and_rejects_a_hostile_site(link, pki, factory_sites, tmp_path):
    results = tmp_path / "results"
    # Site 3 (site-0's images, its own site-id) runs tests/hostile_site: it uploads a forged generator
    # claiming site 0's ids with an oversized config.
    hostile_env = with_pythonpath(THREADS, "hostile_site")
    hostile = SuperNode(link, tmp_path / "node-hostile", {"data-dir": str(factory_sites / "site-0"), "site-id": 3, "num-sites": 4},
                        pki / "keys" / "site-3", env=hostile_env)  # fmt: skip
    with running_sites(link, pki, tmp_path, [factory_sites / f"site-{k}" for k in range(3)]) as nodes:
        hostile.start()
        try:
            hostile.wait_connected()
            # All four are connected before the run starts; the floor is the three honest sites, which the run
            # keeps once the hostile upload is rejected (min-available-sites holds in every round).
            run_id = link.submit({**TINY_FACTORY, "min-available-sites": 3, "round-timeout": 300.0,
                                  "results-dir": str(results), "test-data": str(factory_sites / "server-test")})  # fmt: skip
            outcome = link.wait(run_id, timeout=400)
        finally:
            hostile.stop()
        node_ids = {str(node.node_id) for node in nodes}
    assert outcome.completed, outcome.output[-4000:]
    run = _only_run_dir(results)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["dropped"] == []
    factory = summary["factory"]
    (rejected,) = factory["rejected"]
    assert rejected["node"] == str(hostile.node_id) and rejected["site-id"] == 3
    assert "claims site-id 0, but its node answered the survey as site 3" in rejected["reason"]
    assert factory["missing_classes"] == []
    manifest = json.loads((run / "library" / "manifest.json").read_text())
    modules = sorted((m["site-id"], m["classes"][0]) for m in manifest["modules"])
    assert sorted({site for site, _ in modules}) == [0, 1, 2] and len(modules) == 12, modules
    assert all((run / "library" / f"{m['module-id']}.safetensors").is_file() for m in manifest["modules"])
    # Every honest site uploaded: the bytes the SuperLink received from each are at least its generators' size.
    assert set(summary["bytes"]["received_per_site"]) == node_ids | {str(hostile.node_id)}
    # accuracy is the test split's class shares weighting the per-class recalls (two computations agree)
    counts = np.bincount(load_test_set(RunConfig.from_run_config(TINY_FACTORY), factory_sites / "server-test").test_labels, minlength=10)
    assert factory["server_test"]["accuracy"] == pytest.approx(np.dot(factory["server_test"]["per_class_recall"], counts) / counts.sum())
    assert outcome.listing["network-traffic"]["total-bytes"] > sum(
        (run / "library" / f"{m['module-id']}.safetensors").stat().st_size for m in manifest["modules"]
    )


def test_every_site_refuses_an_unsigned_app_and_one_signed_by_another_key(link, pki, app_index, sites, tmp_path):
    """The SuperNodes trust the federation's key only: `flwr run .` (no signature) and another build signed
    by a different key under the federation's key id are answered "The FAB could not be verified." by every
    site before any ClientApp starts, and the run's status says so."""
    index, signed = app_index
    forged_dir = tmp_path / "forged-app"
    shutil.copytree(APP_DIR / "fedskew", forged_dir / "fedskew", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md", "LICENSE"):
        shutil.copy(APP_DIR / name, forged_dir / name)
    pyproject = (APP_DIR / "pyproject.toml").read_text()
    (forged_dir / "pyproject.toml").write_text(pyproject.replace(f'version = "{signed.version}"', 'version = "9.9.9"', 1))
    forged = publish_app(forged_dir, index.index_dir, pki / "forger-key" / "app-signing", "fedskew-federation")
    assert forged.spec == "@fedskew/fedskew==9.9.9"
    refused = {"unsigned": APP_DIR, "forged": forged.spec}
    with running_sites(link, pki, tmp_path, [sites / f"site-{k}" for k in range(3)]) as nodes:
        run_ids = {what: link.submit({**TINY, "method": "fednca", "min-available-sites": 3, "round-timeout": 60.0,
                                      "results-dir": str(tmp_path / what), "test-data": str(sites / "server-test")},
                                     app=app)
                   for what, app in refused.items()}  # fmt: skip  (both at once: the ServerApps start in parallel)
        for what, run_id in run_ids.items():
            outcome = link.wait(run_id, timeout=240)
            assert outcome.status == "finished:failed", (what, outcome.status, outcome.output[-3000:])
            details = outcome.listing["status-details"]
            # Every site refused the app; the run's status names the cause, not only Flower's "could not be verified".
            assert f"every site ({len(nodes)}) failed the survey: {UNVERIFIED_APP} Cause: {UNVERIFIED_APP_CAUSE}" in details, (what, details)
    for node in nodes:
        log = node.process.log_text()
        # Unsigned: the run carries no signature at all; forged: the signature does not verify.
        assert "App verification is not supported by the connected SuperLink" in log
        assert "FAB verification failed" in log
        # The refusal comes before the node stores the message and creates a task for a ClientApp.
        assert "Received successfully" not in log, log[-3000:]


def _round_done(results: Path, server_round: int) -> bool:
    for metrics in results.glob("*/metrics.jsonl"):
        if any(json.loads(line)["round"] >= server_round for line in metrics.read_text().splitlines() if line):
            return True
    return False


# --- docker ----------------------------------------------------------------------------------------------

SERVER_ENV = {"CERTS_DIR": "/srv/fedskew/certs", "APP_INDEX_DIR": "/srv/fedskew/app-index",
              "SERVER_TEST_DATA": "/srv/fedskew/server-test"}  # fmt: skip
SITE_ENV = {"SUPERLINK_ADDRESS": "fl.hospital-network.org:9443", "SITE_DATA": "/srv/fedskew/site",
            "SITE_KEY": "/etc/fedskew/site-2", "CA_CERT": "/etc/fedskew/ca.crt",
            "TRUSTED_ENTITIES": "/etc/fedskew/trusted-entities.yaml", "SITE_ID": "2", "NUM_SITES": "3"}  # fmt: skip
COMPOSE_FILES = {"server": (["server.yml"], SERVER_ENV), "site": (["site.yml"], SITE_ENV),
                 "site+gpu": (["site.yml", "site.gpu.yml"], SITE_ENV)}  # fmt: skip
EXECUTABLE = {"superlink": "flower-superlink", "supernode": "flower-supernode", "superexec": "flower-superexec"}


def compose_services(name: str, env: dict[str, str]) -> dict:
    """A compose file's services with ${VAR}, ${VAR:-default} and ${VAR:?message} filled in from `env`."""
    return compose_file(name, env)["services"]


def compose_file(name: str, env: dict[str, str]) -> dict:
    """A compose file with ${VAR}, ${VAR:-default} and ${VAR:?message} filled in from `env`."""

    def fill(match: re.Match) -> str:
        var, op, arg = match.group(1), match.group(2), match.group(3)
        if var in env:
            return env[var]
        assert op != ":?", f"{name} requires {var}"
        return arg if op == ":-" else ""

    text = re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", fill, (DOCKER / name).read_text())
    return yaml.safe_load(text)


@pytest.mark.parametrize("what", COMPOSE_FILES)
def test_compose_files_validate_and_name_a_missing_setting(what):
    require_tool("docker-compose")
    files, env = COMPOSE_FILES[what]
    args = [arg for name in files for arg in ("-f", str(DOCKER / name))]
    checked = subprocess.run(["docker-compose", *args, "config", "-q"], capture_output=True, text=True, env={**os.environ, **env})
    assert checked.returncode == 0, checked.stderr
    missing = next(iter(env))
    without = {k: v for k, v in os.environ.items() if k not in env} | {k: v for k, v in env.items() if k != missing}
    refused = subprocess.run(["docker-compose", *args, "config", "-q"], capture_output=True, text=True, env=without)
    assert refused.returncode != 0 and f"set {missing} to" in refused.stderr, refused.stderr


@pytest.fixture(scope="module")
def accepted():
    """Each Flower executable's flags, as its --help lists them."""
    shown = {kind: subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60).stdout
             for kind, exe in EXECUTABLE.items()}  # fmt: skip
    return {kind: set(re.findall(r"(--[a-z][a-z0-9-]*)", text)) for kind, text in shown.items()}


def _option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize("what", ["server", "site"])
def test_every_service_command_uses_flags_the_installed_flower_accepts(what, accepted):
    files, env = COMPOSE_FILES[what]
    services = compose_services(files[0], env)
    for service, spec in services.items():
        if "build" in spec:
            assert spec["build"]["args"].get("FLWR_VERSION", flwr.__version__) == flwr.__version__, service
        if "image" in spec and spec["image"].startswith("flwr/"):
            assert spec["image"].endswith(f":{flwr.__version__}"), f"{service} image tag != installed flwr"
        if "command" not in spec:
            continue
        kind = service.split("-")[0]
        command = [str(token) for token in spec["command"]]
        unknown = [t for t in command if t.startswith("--") and t.split("=")[0] not in accepted[kind]]
        assert not unknown, f"{what} {service}: {EXECUTABLE[kind]} does not accept {unknown}"
        if "--isolation" in command:
            assert _option(command, "--isolation") == "process"
        if kind == "superlink":
            assert "--enable-supernode-auth" in command and _option(command, "--host") == "0.0.0.0"
            assert _option(command, "--database").startswith("state/")  # the volume mounted at /app/state
            assert spec["environment"]["FLWR_SUPERGRID_API_URL"] == "http://app-index:8090"
        if kind == "supernode":
            node_config = parse_config_args([_option(command, "--node-config")])
            assert node_config == {"data-dir": "/data/site", "site-id": 2, "num-sites": 3}
            assert _option(command, "--superlink") == SITE_ENV["SUPERLINK_ADDRESS"]
            assert "--trusted-entities" in command and "--auth-supernode-private-key" in command
    if what == "site":  # a site stands alone: nothing of the server's project
        assert set(services) == {"supernode", "superexec-clientapp"}
        assert all("depends_on" not in spec for spec in services.values())


def test_no_private_key_is_mounted_or_sent_where_it_is_not_needed():
    mounts = {}
    for what in ("server", "site"):
        files, env = COMPOSE_FILES[what]
        for service, spec in compose_services(files[0], env).items():
            mounts[service] = [volume.split(":")[0] for volume in spec.get("volumes", [])]
    everywhere = [source for sources in mounts.values() for source in sources]
    assert not [m for m in everywhere if m.endswith(("ca.key", "app-signing"))], "the CA key and the app-signing key stay offline"
    server_key = f"{SERVER_ENV['CERTS_DIR']}/server.key"
    assert sorted(s for s, sources in mounts.items() if server_key in sources) == ["fleet-proxy", "superlink"]
    assert [s for s, sources in mounts.items() if SITE_ENV["SITE_KEY"] in sources] == ["supernode"]
    assert [s for s, sources in mounts.items() if SITE_ENV["SITE_DATA"] in sources] == ["superexec-clientapp"]
    # Build contexts: the repository root sends the app's sources only; docker/ sends the proxy template only.
    def patterns(path):
        return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]

    assert patterns(REPO / ".dockerignore")[:1] == ["*"] and set(patterns(REPO / ".dockerignore")[1:]) == {
        "!pyproject.toml", "!README.md", "!LICENSE", "!fedskew/", "**/__pycache__"}  # fmt: skip
    assert patterns(DOCKER / ".dockerignore") == ["*", "!fleet-proxy.conf.template"]
    assert patterns(DOCKER / "standins" / ".dockerignore") == ["*"]


def test_the_images_extend_the_installed_flower_version():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert f"ARG FLWR_VERSION={flwr.__version__}" in dockerfile and "FROM flwr/superexec:${FLWR_VERSION}" in dockerfile
    assert 'ENTRYPOINT ["flower-superexec"]' in dockerfile
    standins = (DOCKER / "standins" / "Dockerfile").read_text()
    assert f"ARG FLWR_VERSION={flwr.__version__}" in standins and '"flwr==${FLWR_VERSION}"' in standins
    assert "--uid 49999 --gid 49999 --home-dir /app" in standins and "USER app" in standins
    for kind, exe in EXECUTABLE.items():
        assert f'FROM flower AS {kind}\nENTRYPOINT ["{exe}"]' in standins


def test_the_fleet_proxy_image_fills_in_every_placeholder_of_the_template():
    placeholders = set(re.findall(r"\$\{(\w+)\}", (DOCKER / "fleet-proxy.conf.template").read_text()))
    entrypoint = (DOCKER / "Dockerfile.fleet-proxy").read_text()
    filled = set(re.findall(r"\$(\w+)", re.search(r"envsubst '([^']*)'", entrypoint).group(1)))
    assert filled == placeholders
    proxy_env = compose_services("server.yml", SERVER_ENV)["fleet-proxy"]["environment"]
    assert placeholders - {"RUN_DIR"} == set(proxy_env)  # RUN_DIR is set in the image


def test_the_centre_publishes_the_fleet_proxy_alone_and_the_control_api_only_the_operator_service_reaches():
    """Flower 1.42's Control API has no user authentication: no port of the SuperLink on the host, and the host
    without an address on the network it listens on; the operator's flwr a container on that network."""
    server = compose_file("server.yml", SERVER_ENV)
    services, networks = server["services"], server["networks"]
    assert {name for name, spec in services.items() if spec.get("ports")} == {"fleet-proxy"}
    assert [port.rsplit(":", 1)[1] for port in services["fleet-proxy"]["ports"]] == ["9443"]
    private = networks["private"]
    assert private["internal"] is True and private["driver_opts"]["com.docker.network.bridge.inhibit_ipv4"] == "true"
    on_other_networks = {name for name, spec in services.items() if set(spec["networks"]) - {"private"}}
    assert services["superlink"]["networks"] == ["private"] and on_other_networks == {"fleet-proxy"}
    operator = services["operator"]
    assert operator["profiles"] == ["operator"] and operator["entrypoint"] == [] and operator["networks"] == ["private"]
    # Its connection: the SuperLink by its name on that network, TLS with the mounted CA certificate.
    mounts = dict(volume.rsplit(":", 2)[:2] for volume in operator["volumes"])
    assert mounts[f"{SERVER_ENV['CERTS_DIR']}/ca.crt"] == "/app/certificates/ca.crt"
    home = operator["environment"]["FLWR_HOME"]
    connections = tomllib.loads((DOCKER / "flwr-home" / "config.toml").read_text())["superlink"]
    assert mounts["./flwr-home/config.toml"] == f"{home}/config.toml"
    assert connections[connections["default"]] == {"address": "superlink:8000", "root-certificates": "/app/certificates/ca.crt"}


def test_flwr_reads_the_tls_connection_the_deployment_writes(tmp_path, monkeypatch):
    """Flower 1.42 refuses a relative root-certificates path; connection_toml writes the absolute one."""
    import click
    from flwr.cli.flower_config import read_superlink_connection

    monkeypatch.chdir(tmp_path)
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(connection_toml("demo", "127.0.0.1:9093", Path("certs/ca.crt")))
    monkeypatch.setenv("FLWR_HOME", str(home))
    connection = read_superlink_connection("demo")
    assert connection.address == "127.0.0.1:9093" and not connection.insecure
    assert connection.root_certificates == str(tmp_path / "certs" / "ca.crt")
    (home / "config.toml").write_text((home / "config.toml").read_text().replace(str(tmp_path) + "/", ""))
    with pytest.raises(click.ClickException, match="expected absolute path"):
        read_superlink_connection("demo")


def test_node_config_strings_round_trip_through_flowers_parser(tmp_path):
    config = {"data-dir": str(tmp_path / "site with space"), "site-id": 2, "num-sites": 3}
    assert parse_config_args([node_config_arg(config)]) == config
    with pytest.raises(ValueError, match="single quote"):
        node_config_arg({"data-dir": "/it's"})
