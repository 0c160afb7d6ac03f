"""The package's import structure ([tool.importlinter] in pyproject.toml): each module imports only from the
layers below it, the server's strategies and the site's code never import each other, no package imports in a
cycle, and every module of fedskew has its place in the layers."""

from __future__ import annotations

import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import fedskew

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# In its own process: import-linter's console keeps the streams it started with, which pytest closes.
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))"


def test_every_import_contract_holds():
    lint = subprocess.run([sys.executable, "-c", LINT, str(PYPROJECT)], capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_every_module_of_the_package_sits_in_a_layer():
    """A module left out of the layers contract is not checked by it: a new one must be given its place."""
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    # "a | b" independent siblings, "a : b" siblings, "(a)" a layer that may be absent.
    placed = {name.strip("() ") for layer in layers for name in re.split(r"[|:]", layer)}
    modules = {f"fedskew.{m.name}" for m in pkgutil.iter_modules(fedskew.__path__)}
    assert sorted(modules - placed) == []
