"""App signing against Flower's own code: a signature `fedskew sign-app` makes is one Flower's SuperNode
accepts for that FAB only and for the signing key only, and the app index answers Flower's own Hub
client the way the Flower Hub does."""

import hashlib
import json
import subprocess
import zipfile
from io import BytesIO
from pathlib import Path

import httpx
import pytest
import yaml
from flwr.cli.build import build_fab_from_disk
from flwr.supercore.fab import Fab
from flwr.supercore.utils import request_download_link
from flwr.supernode.start_client_internal import _verify_fab

from system_tools import require_tool

from fedskew.app_signing import UNVERIFIED_APP_CAUSE, AppIndex, publish_app, signature_record
from fedskew.cli import main as cli_main
from fedskew.testing.launch import APP_DIR, free_port
from fedskew.server_tasks import site_failure

DOCKER = Path(__file__).resolve().parent.parent / "docker"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    require_tool("ssh-keygen")  # docker/app-key.sh makes the keys with it
    root = tmp_path_factory.mktemp("app-keys")
    for name in ("federation", "other"):
        subprocess.run([str(DOCKER / "app-key.sh"), str(root / name)], check=True, capture_output=True)
    return root


@pytest.fixture(scope="module")
def tiny_app(tmp_path_factory):
    """A minimal Flower app folder (the FAB is built from it; nothing runs)."""
    app = tmp_path_factory.mktemp("tiny-app")
    (app / "tinyapp").mkdir()
    (app / "tinyapp" / "__init__.py").write_text("")
    (app / "pyproject.toml").write_text(
        '[project]\nname = "tinyapp"\nversion = "1.2.3"\n\n[tool.flwr.app]\npublisher = "hospital-net"\n\n'
        '[tool.flwr.app.components]\nserverapp = "tinyapp:server"\nclientapp = "tinyapp:client"\n'
    )
    return app


def test_the_apps_bundle_holds_the_package_and_what_the_docker_image_copies_nothing_else():
    """Every site downloads the FAB (and every run installs it): benchmarks, docs, tests and the process
    management for tests (fedskew/testing) stay home."""
    names = set(zipfile.ZipFile(BytesIO(build_fab_from_disk(APP_DIR))).namelist()) - {".info/CONTENT"}
    package = {str(p.relative_to(APP_DIR)) for p in (APP_DIR / "fedskew").rglob("*.py")
               if "__pycache__" not in p.parts and p.relative_to(APP_DIR).parts[:2] != ("fedskew", "testing")}  # fmt: skip
    assert names == package | {"pyproject.toml", "README.md", "LICENSE"}


def _trusted(keys, name="federation") -> dict[str, str]:
    return yaml.safe_load((keys / name / "trusted-entities.yaml").read_text())


def _fab(fab_bytes: bytes, records: list[dict]) -> Fab:
    """The Fab a SuperNode receives from a SuperLink that fetched it with these signature records."""
    verifications = {r["public_key_id"]: json.dumps({k: v for k, v in r.items() if k != "public_key_id"}) for r in records}
    return Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {**verifications, "valid_license": "Valid"})


def test_flowers_supernode_accepts_the_federations_signature_and_nothing_else(keys):
    fab = b"PK fab bytes"
    signed = signature_record(fab, keys / "federation" / "app-signing", "fedskew-federation")
    assert _verify_fab(_fab(fab, [signed]), _trusted(keys))
    assert not _verify_fab(_fab(fab + b"!", [signed]), _trusted(keys)), "the signature covers the FAB's content"
    forged = signature_record(fab, keys / "other" / "app-signing", "fedskew-federation")
    assert not _verify_fab(_fab(fab, [forged]), _trusted(keys)), "another key under the federation's id"
    assert not _verify_fab(_fab(fab, [signed]), _trusted(keys, "other")), "a site trusting another key"


def test_a_signing_key_that_is_not_ed25519_is_refused_with_its_path(tmp_path):
    key = tmp_path / "ecdsa"
    subprocess.run([require_tool("ssh-keygen"), "-q", "-t", "ecdsa", "-N", "", "-f", str(key)], check=True)
    with pytest.raises(ValueError, match=f"signing key {key}.*Ed25519"):
        signature_record(b"fab", key, "fedskew-federation")
    with pytest.raises(ValueError, match="key id 'bad id'"):
        signature_record(b"fab", key, "bad id")


def test_the_index_serves_signed_fabs_to_flowers_hub_client(keys, tiny_app, tmp_path):
    index_dir = tmp_path / "index"
    assert cli_main(["sign-app", str(tiny_app), "--key", str(keys / "federation" / "app-signing"),
                     "--index", str(index_dir)]) == 0  # fmt: skip
    fab = (index_dir / "hospital-net" / "tinyapp" / "1.2.3.fab").read_bytes()
    with AppIndex(index_dir, "127.0.0.1", free_port()) as index:
        for version in ("1.2.3", None):  # pinned, and the latest
            url, records, _ = request_download_link("@hospital-net/tinyapp", version, f"{index.url}/hub/fetch-fab", "fab_url")
            assert httpx.get(url).content == fab
            assert _verify_fab(_fab(fab, records), _trusted(keys))
        with pytest.raises(ValueError, match="Available app versions for @hospital-net/tinyapp: 1.2.3"):
            request_download_link("@hospital-net/tinyapp", "2.0.0", f"{index.url}/hub/fetch-fab", "fab_url")
        with pytest.raises(ValueError, match="not found"):
            request_download_link("@hospital-net/other", None, f"{index.url}/hub/fetch-fab", "fab_url")


def test_a_sites_refusal_of_an_unverified_app_names_the_cause():
    """Flower's SuperNode answers "The FAB could not be verified." (and logs that the SuperLink does not support
    verification when the app has no signature at all); the server's record of the site says why."""
    refused = site_failure("The FAB could not be verified.")
    assert refused == f"The FAB could not be verified. Cause: {UNVERIFIED_APP_CAUSE}"
    assert "no signature by a key in the site's trusted-entities.yaml" in refused and "fedskew sign-app" in refused
    assert site_failure("<class 'ValueError'>:<'The FAB could not be verified.'>") == "ValueError: The FAB could not be verified."
