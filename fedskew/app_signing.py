"""Apps signed by the federation, so that a site runs only code the federation's key signed.

A SuperNode started with `--trusted-entities trusted-entities.yaml` (key id -> Ed25519 public key
in OpenSSH form, docker/app-key.sh writes one) runs a run's ClientApps only when the run's app
bundle (FAB) carries a signature by one of those keys over the FAB's SHA-256; otherwise it answers
every message of the run with "The FAB could not be verified." and starts nothing.

Flower 1.42 signs apps only through the Flower Hub: a SuperLink attaches signatures to a run when
it fetched the FAB from an app index that speaks the Hub's fetch-fab protocol, at
FLWR_SUPERGRID_API_URL; a FAB uploaded with `flwr run .` carries none. So the federation builds
and signs its FAB here (`fedskew sign-app`, the same message and Ed25519 primitives as
`flwr app review`), keeps the signed FABs in an index folder, and serves that folder to its own
SuperLink only (`fedskew serve-apps`); runs start with `flwr run @fedskew/fedskew==0.1.0 <connection>`.
The index holds nothing secret: a site checks every signature itself.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from flwr.cli.build import build_fab_from_disk
from flwr.common.config import get_fab_config, get_metadata_from_config
from flwr.supercore.primitives.asymmetric_ed25519 import create_message_to_sign, load_private_key, sign_message

# Flower's SuperNode answers every message of a run whose app it cannot verify with this reason, and logs "App
# verification is not supported by the connected SuperLink" when the app carries no signature at all (an app
# `flwr run .` uploaded), whichever SuperLink it is connected to. Neither names the cause.
UNVERIFIED_APP = "The FAB could not be verified."
UNVERIFIED_APP_CAUSE = (
    "the run's app carries no signature by a key in the site's trusted-entities.yaml (an app `flwr run .` uploads "
    "is never signed: sign it with `fedskew sign-app` and run it as `flwr run @<publisher>/<name>==<version>`)"
)


def with_unverified_app_cause(reason: str) -> str:
    """A site's error reason, with the cause added where it is the SuperNode's refusal of an unverified app."""
    return f"{UNVERIFIED_APP} Cause: {UNVERIFIED_APP_CAUSE}" if reason.strip() == UNVERIFIED_APP else reason


KEY_ID = re.compile(r"^[A-Za-z0-9_.-]+$")
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
VERSION = re.compile(r"^\d+\.\d+\.\d+$")


@dataclass(frozen=True)
class PublishedApp:
    app_id: str  # "@publisher/name", what `flwr run` takes before "=="
    version: str
    fab: Path

    @property
    def spec(self) -> str:
        return f"{self.app_id}=={self.version}"


def signature_record(fab: bytes, private_key: Path, key_id: str, signed_at: int | None = None) -> dict[str, str]:
    """The verification record a Flower SuperNode checks: an Ed25519 signature by `private_key` (OpenSSH
    format) over the signing time and the FAB's SHA-256, filed under `key_id`."""
    if not KEY_ID.match(key_id):
        raise ValueError(f"key id {key_id!r} is invalid; valid: letters, digits, '_', '.', '-'")
    try:
        key = load_private_key(Path(private_key))
    except (OSError, ValueError) as err:
        raise ValueError(f"signing key {private_key}: {err}; valid: an Ed25519 OpenSSH private key "
                         "(docker/app-key.sh writes one)") from err  # fmt: skip
    signed_at = int(time.time()) if signed_at is None else signed_at
    signature = sign_message(key, create_message_to_sign(hashlib.sha256(fab).digest(), signed_at))
    encoded = base64.urlsafe_b64encode(signature).rstrip(b"=").decode("ascii")
    return {"public_key_id": key_id, "signature": encoded, "signed_at": signed_at}


def publish_app(app_dir: Path, index_dir: Path, private_key: Path, key_id: str) -> PublishedApp:
    """Build the FAB of `app_dir`, sign it and file both in `index_dir` (<publisher>/<name>/<version>.fab
    and .signatures.json). A new build of an already published version replaces it and its signatures;
    signing the same FAB again with another key adds that key's record."""
    fab = build_fab_from_disk(Path(app_dir))
    fab_id, version = get_metadata_from_config(get_fab_config(fab))
    publisher, name = fab_id.split("/", 1)
    folder = Path(index_dir) / publisher / name
    folder.mkdir(parents=True, exist_ok=True)
    fab_path, signatures_path = folder / f"{version}.fab", folder / f"{version}.signatures.json"
    records = []
    if fab_path.is_file() and fab_path.read_bytes() == fab and signatures_path.is_file():
        records = [r for r in json.loads(signatures_path.read_text()) if r["public_key_id"] != key_id]
    records.append(signature_record(fab, private_key, key_id))
    fab_path.write_bytes(fab)
    signatures_path.write_text(json.dumps(records, indent=1))
    return PublishedApp(f"@{fab_id}", version, fab_path)


class AppIndex(ThreadingHTTPServer):
    """The Hub's fetch-fab protocol over an index folder: POST /hub/fetch-fab {"app_id", "app_version"}
    answers {"fab_url", "verifications"} (404 with the available versions), GET /fabs/... the FAB."""

    daemon_threads = True

    def __init__(self, index_dir: Path, host: str, port: int):
        self.index_dir = Path(index_dir)
        super().__init__((host, port), _IndexHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def versions(self, publisher: str, name: str) -> list[str]:
        folder = self.index_dir / publisher / name
        found = [p.name[: -len(".fab")] for p in folder.glob("*.fab")] if folder.is_dir() else []
        return sorted((v for v in found if VERSION.match(v)), key=lambda v: tuple(map(int, v.split("."))))

    def __enter__(self) -> AppIndex:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


class _IndexHandler(BaseHTTPRequestHandler):
    server: AppIndex

    def do_POST(self) -> None:  # noqa: N802 - the http.server interface
        if self.path.rstrip("/") != "/hub/fetch-fab":
            return self._reply(HTTPStatus.NOT_FOUND, {"detail": f"no route {self.path}"})
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            publisher, name = str(request["app_id"]).removeprefix("@").split("/", 1)
            version = request.get("app_version")
        except (ValueError, KeyError, TypeError):
            return self._reply(HTTPStatus.BAD_REQUEST, {"detail": "expected JSON {app_id: '@publisher/name', app_version}"})
        if not (NAME.match(publisher) and NAME.match(name)):
            return self._reply(HTTPStatus.NOT_FOUND, {"detail": f"no app {request['app_id']}"})
        available = self.server.versions(publisher, name)
        version = version or (available[-1] if available else None)
        if version not in available:
            return self._reply(HTTPStatus.NOT_FOUND, {"detail": {"available_app_versions": available}})
        signatures = self.server.index_dir / publisher / name / f"{version}.signatures.json"
        self._reply(HTTPStatus.OK, {
            "fab_url": f"http://{self.headers['Host']}/fabs/{publisher}/{name}/{version}.fab",
            "verifications": json.loads(signatures.read_text()) if signatures.is_file() else [],
        })  # fmt: skip

    def do_GET(self) -> None:  # noqa: N802
        parts = self.path.split("/")  # "", "fabs", publisher, name, "<version>.fab"
        if len(parts) == 5 and parts[1] == "fabs" and NAME.match(parts[2]) and NAME.match(parts[3]):
            fab = self.server.index_dir / parts[2] / parts[3] / parts[4]
            if parts[4].endswith(".fab") and VERSION.match(parts[4][: -len(".fab")]) and fab.is_file():
                return self._reply(HTTPStatus.OK, fab.read_bytes(), "application/octet-stream")
        self._reply(HTTPStatus.NOT_FOUND, {"detail": f"no FAB at {self.path}"})

    def _reply(self, status: HTTPStatus, body: dict | bytes, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
