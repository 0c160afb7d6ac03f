"""Every command and run-config string in README.md and docs/*.md works as written.

Fenced shell blocks (bash, sh, shell, console) are split into commands; inline code spans that hold a
`--run-config` string are read as commands too, so each string is checked with its command's context
(`python -m bench.compare --methods a,b` validates the string once per method). Then:

- run-config strings are parsed by Flower's own parser and validated by `RunConfig`; federation-config
  strings by Flower's simulation-config parser;
- cheap commands run for real, in this process: `python -m fedskew.config --check` and every `--help`;
- every other command resolves: its executable exists, a `python -m` module exists, the options of
  `fedskew`, `python -m fedskew.*|bench.*`, `flwr` and the `flower-*` programs are accepted by the
  program's own parser (which stops before any work), `pip install '.[extra]'` names a real extra, and
  the repository files a command names exist;
- relative links point at existing files and headings.

The `flower-superlink` and `flower-supernode` commands of a page start for real: its SuperLinks must
answer and its SuperNodes must join them (docs/deployment.md's, with their TLS and keys, run in order in
tests/test_deploy_steps.py). Pages added later under docs/ are covered by the glob. Nothing here trains.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from flwr.cli.run.run import simulation_config_from_json
from flwr.common.config import parse_config_args

from system_tools import DEBIAN_PACKAGES, require_tool

from fedskew.config import ConfigError, RunConfig
from fedskew.testing.deploy import FlowerProcess, offline_env, wait_healthy, wait_node_id
from fedskew.testing.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line
QUOTED_RUN_CONFIG = re.compile(r"""--run-config[ =](["'])""")
SHELL_BUILTINS = {"cd", "export", "kill", "echo", "source", "set", "unset", "test", "true", "false", "umask"}
# Tools a reader installs on their own machines, absent from development and CI machines by design.
USER_INSTALLED = {"docker": "the Docker engine (the tests validate the compose files with docker-compose instead)"}
FLOWER_ARGPARSE = {
    "flower-superlink": ("flwr.superlink.cli.flower_superlink", "_parse_args_run_superlink"),
    "flower-supernode": ("flwr.supernode.cli.flower_supernode", "_parse_args_run_supernode"),
    "flower-superexec": ("flwr.supercore.cli.flower_superexec", "_parse_args"),
}
OUTPUT_OPTIONS = {"--out", "-o", "--logdir"}  # their values are written, not read
TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
TOP_LEVEL = {name.split("/")[0] for name in TRACKED if "/" in name}


@dataclass
class Command:
    page: str
    line: int
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)}"

    def value_of(self, option: str) -> str | None:
        for i, token in enumerate(self.argv):
            if token == option and i + 1 < len(self.argv):
                return self.argv[i + 1]
            if token.startswith(option + "="):
                return token.split("=", 1)[1]
        return None

    def values_of(self, option: str) -> list[str]:
        return [self.argv[i + 1] for i, t in enumerate(self.argv[:-1]) if t == option]


# --- extraction ----------------------------------------------------------------------------------------


def split_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line offset, argv) for each simple command of a shell text; comments, `&&`, `;`, `|`, loops and
    leading VAR=value assignments handled."""
    commands = []
    joined = re.sub(r"\\\n", " ", text)  # line continuations (also inside double quotes)
    pending, start = "", 0
    for number, line in enumerate(joined.split("\n")):
        pending, start = (pending + "\n" + line, start) if pending else (line, number)
        lexer = shlex.shlex(pending, posix=True, punctuation_chars="|&;")
        lexer.whitespace_split = True
        try:
            tokens = [*lexer, ";"]
        except ValueError:  # a quoted argument (python -c "...") spans lines: read on
            continue
        pending, number = "", start
        current: list[str] = []
        for token in tokens:
            if token and set(token) <= set("|&;"):
                commands.append((number, current))
                current = []
            else:
                current.append(token)
    if pending:  # never closed: a command the test reports as broken, with its line
        commands.append((start, ["unclosed-quotation:", pending[:80]]))
    result = []
    for number, argv in commands:
        while argv and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]) or argv[0] in ("do", "then", "sudo", "until")):
            argv = argv[1:]
        if argv and argv[0] not in ("for", "done", "fi", "if", "while"):
            result.append((number, argv))
    return result


def page_commands(page: Path) -> list[Command]:
    text = page.read_text()
    name = page.relative_to(ROOT).as_posix()
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) in SHELL_LANGUAGES:
            first_line = text[: match.start(2)].count("\n") + 1
            body = "\n".join(line[2:] if line.startswith("$ ") else line for line in match.group(2).split("\n"))
            found += [Command(name, first_line + n, argv) for n, argv in split_commands(body)]
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for match in INLINE_CODE.finditer(prose):
        if QUOTED_RUN_CONFIG.search(match.group(1)):
            line = prose[: match.start()].count("\n") + 1
            found += [Command(name, line, argv) for _, argv in split_commands(match.group(1).replace("\n", " "))]
    return found


ALL_COMMANDS = [command for page in PAGES for command in page_commands(page)]


# --- run-config and federation-config strings ----------------------------------------------------------


def run_configs_to_validate(command: Command) -> list[dict]:
    """The complete run configs a command's `--run-config` string stands for."""
    text = command.value_of("--run-config")
    if text is None or text.endswith(".toml"):
        return []
    shared = parse_config_args([text])
    if command.argv[:3] in (["python", "-m", "bench.compare"], ["python", "-m", "bench.round_cost"]):
        methods = [{"method": m} for m in (command.value_of("--methods") or "fedavg,fednca").split(",") if m]
        variants = []
        for spec in command.values_of("--method-config"):
            _, method, overrides = spec.split(":", 2)
            variants.append({**parse_config_args([overrides]), "method": method})
        return [{**shared, **extra} for extra in methods + variants]
    return [shared]


def test_every_run_config_string_in_the_docs_is_checked():
    # Each quoted --run-config string on a page must have been read as part of a command above.
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        written = len(QUOTED_RUN_CONFIG.findall(page.read_text()))
        parsed = sum(1 for c in ALL_COMMANDS if c.page == name and c.value_of("--run-config") is not None)
        assert parsed == written, f"{name}: {written} --run-config strings, {parsed} read as commands"


@pytest.mark.parametrize("command", [c for c in ALL_COMMANDS if c.value_of("--run-config")], ids=str)
def test_run_config_strings_validate(command):
    for run_config in run_configs_to_validate(command):
        try:
            RunConfig.from_run_config(run_config)
        except ConfigError as err:
            pytest.fail(f"{command}\n{err}")


@pytest.mark.parametrize("command", [c for c in ALL_COMMANDS if c.value_of("--federation-config")], ids=str)
def test_federation_config_strings_parse(command):
    parsed = parse_config_args([command.value_of("--federation-config")])
    simulation_config_from_json({key.replace("-", "_"): value for key, value in parsed.items()})


# --- commands ------------------------------------------------------------------------------------------


class _Parsed(Exception):
    """Raised right after a program's argparse parser accepted its arguments: nothing else runs."""


@contextlib.contextmanager
def stop_after_parsing():
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def run_argparse_main(main, argv: list[str], really_run: bool = False) -> None:
    """Call a program's main(argv): for real when asked (or for --help), else stopped after parsing."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if really_run:
                code = main(argv)
            else:
                with stop_after_parsing():
                    code = main(argv)
        except _Parsed:
            return
        except SystemExit as exit_:
            code = exit_.code
    assert code in (0, None), f"exit {code}: {err.getvalue()[-2000:]}{out.getvalue()[-2000:]}"


def check_python_module(argv: list[str]) -> None:
    module_name, args = argv[2], argv[3:]
    assert importlib.util.find_spec(module_name) is not None, f"no module {module_name}"
    if module_name.split(".")[0] not in ("fedskew", "bench"):
        return
    module = importlib.import_module(module_name)
    assert hasattr(module, "main"), f"{module_name} has no main(argv)"
    cheap = args in (["--check"],) and module_name == "fedskew.config"
    run_argparse_main(module.main, args, really_run=cheap or "--help" in args)


def check_click_command(command, argv: list[str]) -> None:
    """Walk a click command tree: the subcommand exists and accepts every option given."""
    rest = argv[1:]
    while rest and hasattr(command, "commands") and rest[0] in command.commands:
        command, rest = command.commands[rest[0]], rest[1:]
    assert not hasattr(command, "commands"), f"{argv[0]}: no subcommand {rest[:1]} (has {sorted(command.commands)})"
    accepted = {"--help"} | {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    unknown = [t.split("=")[0] for t in rest if t.startswith("-") and t.split("=")[0] not in accepted]
    assert not unknown, f"{argv[0]} {command.name} does not accept {unknown}"


def check_flwr(argv: list[str]) -> None:
    import typer
    from flwr.cli.app import app

    check_click_command(typer.main.get_command(app), argv)


def check_ray(argv: list[str]) -> None:
    from ray.scripts.scripts import cli

    check_click_command(cli, argv)


def check_flower_program(argv: list[str]) -> None:
    module, function = FLOWER_ARGPARSE[argv[0]]
    parser = getattr(importlib.import_module(module), function)()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv[1:])
        except SystemExit as exit_:
            assert exit_.code == 0, f"{argv[0]} refuses the arguments: {err.getvalue()[-1500:]}"


def check_pip(argv: list[str]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    for token in argv[2:]:
        local = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", token)
        if local and local.group(1):
            missing = set(local.group(1).split(",")) - set(extras)
            assert not missing, f"pip install: pyproject.toml has no extra {sorted(missing)}"


def check_repository_paths(command: Command) -> None:
    skip = {i + 1 for i, token in enumerate(command.argv) if token in OUTPUT_OPTIONS}
    for i, token in enumerate(command.argv):
        if i in skip or "$" in token or "<" in token:
            continue
        path = token.split("=", 1)[-1] if token.startswith("--") else token
        named = path in TRACKED or (path.split("/")[0] in TOP_LEVEL and "/" in path and Path(path).suffix)
        if named:
            assert (ROOT / path).exists(), f"{command}: {path} does not exist in the repository"


def check_command(command: Command) -> None:
    argv = command.argv
    program = argv[0]
    check_repository_paths(command)
    if program in ("python", "python3") and argv[1:2] == ["-m"]:
        check_python_module(argv)
    elif program == "fedskew":
        from fedskew.cli import main

        run_argparse_main(main, argv[1:], really_run="--help" in argv)
    elif program == "flwr":
        check_flwr(argv)
    elif program == "ray":
        check_ray(argv)
    elif program in FLOWER_ARGPARSE:
        check_flower_program(argv)
    elif program == "pip":
        check_pip(argv)
    elif program.startswith(("./", "docker/", "bench/", ".ci/")) or "/" in program:
        path = ROOT / program
        assert path.is_file() and path.stat().st_mode & 0o111, f"{program} is not an executable file of the repository"
    elif program in USER_INSTALLED or program in SHELL_BUILTINS:
        return
    elif program.startswith("$"):
        raise AssertionError(f"{command}: a shell variable as the program; write the command out so it can be checked")
    elif program in DEBIAN_PACKAGES:  # skipped, naming the package, where it is missing (failed under CI)
        require_tool(program)
    else:
        assert shutil.which(program), f"{program}: not installed (needed by {command})"


SHELL_COMMANDS = [c for c in ALL_COMMANDS if c.argv[0] != "--run-config" and not c.argv[0].startswith("-")]


@pytest.mark.parametrize("command", SHELL_COMMANDS, ids=str)
def test_documented_commands_run_or_resolve(command):
    with contextlib.chdir(ROOT):  # the docs' commands run from the repository root
        check_command(command)


def test_the_docs_hold_commands_and_the_checks_catch_mistakes():
    # The extraction must find the quick start, and each check must refuse what it exists to refuse.
    readme = [c for c in ALL_COMMANDS if c.page == "README.md"]
    assert any(c.argv[:2] == ["flwr", "run"] and c.value_of("--federation-config") for c in readme)
    with pytest.raises(ConfigError):
        for run_config in run_configs_to_validate(Command("x", 1, ["flwr", "run", ".", "--run-config", "no-such-key=1"])):
            RunConfig.from_run_config(run_config)
    with pytest.raises(ConfigError):  # valid alone (FedNCA-ML), invalid for the single-label factory row
        for run_config in run_configs_to_validate(Command("x", 1, ["python", "-m", "bench.compare", "--methods",
                                                                 "fedavg,factory", "--run-config", "alpha=0.5",
                                                                 "--out", "o"])):  # fmt: skip
            RunConfig.from_run_config(run_config)
    for bad in (["fedskew", "unlearn", "RUN_DIR", "--no-such-option"], ["flwr", "run", ".", "--no-such-option"],
                ["flwr", "no-such-command"], ["ray", "start", "--no-such-option"], ["flower-supernode", "--no-such-option"], ["pip", "install", ".[nope]"],
                ["python", "-m", "fedskew.no_such_module"], ["python", "-m", "bench.compare", "--methods", "fedavg"],
                ["fedskew", "report", "bench/results/no-such-file.json"], ["no-such-program-xyz"]):  # fmt: skip
        with pytest.raises(AssertionError):
            check_command(Command("x", 1, bad))
    assert split_commands("A=1 B=2 flwr run . \\\n  --stream # comment\npip install -e . && pytest") == [
        (0, ["flwr", "run", ".", "--stream"]), (1, ["pip", "install", "-e", "."]), (1, ["pytest"])
    ]


# --- commands that start Flower processes -------------------------------------------------------------

FLOWER_PROCESSES = ("flower-superlink", "flower-supernode")
# Its SuperLink, fleet proxy and SuperNodes (TLS, registered keys, signed apps) run in order, with the rest of
# its bare-metal steps, in tests/test_deploy_steps.py.
RUN_WITH_THEIR_STEPS = {"docs/deployment.md"}
PROCESS_PAGES = sorted({c.page for c in ALL_COMMANDS if c.argv[0] in FLOWER_PROCESSES})


def test_every_page_with_a_superlink_or_supernode_command_is_run():
    assert "docs/own-data.md" in PROCESS_PAGES and RUN_WITH_THEIR_STEPS <= set(PROCESS_PAGES)


@pytest.mark.parametrize("page", sorted(set(PROCESS_PAGES) - RUN_WITH_THEIR_STEPS))
def test_documented_superlinks_start_and_documented_supernodes_join_them(page, tmp_path):
    """A page's `flower-superlink` and `flower-supernode` commands, run as written except that each documented
    port is moved to a free one (the same documented port always to the same free port) and $PWD is a scratch
    folder: every SuperLink answers /health and every SuperNode is admitted by one of them, within seconds."""
    commands = [c for c in ALL_COMMANDS if c.page == page and c.argv[0] in FLOWER_PROCESSES]
    moved: dict[str, str] = {}

    def local(command: Command) -> list[str]:
        argv = [token.replace("$PWD", str(tmp_path)) for token in command.argv]
        for option in ("--port", "--superlink"):
            if option in argv:
                host, _, port = argv[argv.index(option) + 1].rpartition(":")
                argv[argv.index(option) + 1] = ":".join(filter(None, [host, moved.setdefault(port, str(free_port()))]))
        return argv

    links = [c for c in commands if c.argv[0] == "flower-superlink"]
    link_ports = [moved.setdefault(c.value_of("--port") or "8000", str(free_port())) for c in links]
    started = []
    try:
        for command, port in zip(links, link_ports):
            process = FlowerProcess("flower-superlink", local(command), offline_env(tmp_path / "link"), tmp_path / "link.log")
            started.append(process.start())
            wait_healthy(process, f"127.0.0.1:{port}", None, timeout=60)
        for k, command in enumerate(c for c in commands if c.argv[0] == "flower-supernode"):
            host, _, port = command.value_of("--superlink").rpartition(":")
            assert host == "127.0.0.1" and port in moved and moved[port] in link_ports, (
                f"{command}: connects to {host}:{port}; the page's SuperLinks listen on 127.0.0.1 port(s) "
                f"{[p for p, m in moved.items() if m in link_ports]}"
            )
            process = FlowerProcess("flower-supernode", local(command), offline_env(tmp_path / f"node-{k}"), tmp_path / f"node-{k}.log")
            started.append(process.start())
            wait_node_id(process, timeout=60)
    finally:
        for process in started:
            process.stop()


# --- links ---------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    slugs = set()
    for heading in re.findall(r"^#+\s+(.*?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_existing_files_and_headings(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
