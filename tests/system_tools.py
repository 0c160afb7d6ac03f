"""The system programs some tests need, and the Debian package of each (what .ci/run installs).

`require_tool` returns a program's path. Where the program is missing, a developer's run skips the test
with one line naming the package to install; under CI (CI set, as CI services do) the test fails with
the same line instead, so CI cannot pass with the tests of real TLS, the fleet proxy, signed apps, the
compose files or the rendered report skipped.
"""

from __future__ import annotations

import os
import shutil

import pytest

# program -> the Debian package that provides it
DEBIAN_PACKAGES = {
    "docker-compose": "docker-compose",
    "nginx": "nginx-light",
    "chromium": "chromium",
    "openssl": "openssl",
    "ssh-keygen": "openssh-client",
    "envsubst": "gettext-base",
    "systemd-analyze": "systemd",
    "systemd-sysusers": "systemd",
    "nft": "nftables",
}


def missing_tool_message(command: str) -> str:
    return f"needs {command}: apt-get install {DEBIAN_PACKAGES[command]}"


def require_tool(command: str) -> str:
    """The path of `command`; skip the calling test where it is missing (fail under CI)."""
    path = shutil.which(command)
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{missing_tool_message(command)} (CI is set: .ci/run installs it, so its absence is a failure)")
    pytest.skip(missing_tool_message(command))


if __name__ == "__main__":  # .ci/run: the packages to install, space-separated
    print(" ".join(sorted({package for command, package in DEBIAN_PACKAGES.items() if not shutil.which(command)})))
