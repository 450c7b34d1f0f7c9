"""The manual pages against the code: every command, flag, environment variable, exit code
and signal is documented, nothing documented is gone, and mandoc finds no fault."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from mlxceld import sdnotify
from mlxceld.cli import app as mlxceld_app
from mlxceld.models.fixtures.cli import parser as fixture_parser
from mlxctl import edge
from mlxctl.app import app as mlxctl_app

ROOT = Path(__file__).resolve().parents[2]
MAN = ROOT / "man"
PAGES = sorted(p for p in MAN.iterdir() if re.fullmatch(r".+\.[1-8]", p.name))
HELP = {"-h", "--help"}
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")
# Commands whose options belong to a parser of their own (they pass their argv through).
PASSTHROUGH = {("model", "fixture"): fixture_parser}

Tree = dict[tuple[str, ...], set[str]]


# -- reading roff --------------------------------------------------------------------------


def plain(line: str) -> str:
    """A roff line as text: escapes undone, font changes and macro names dropped."""
    text = re.sub(r"\\f[BIRP]|\\f\(..|\\&", "", line).replace("\\-", "-").replace("\\e", "\\")
    return re.sub(r"^\.[A-Z]{1,2}\s?", "", text).replace('"', "")


def sections(page: Path) -> Iterator[tuple[str, str, list[str]]]:
    """(section, subsection, lines) for each .SH / .SS of ``page``."""
    sh, ss, lines = "", "", []
    for line in page.read_text().splitlines():
        if line.startswith((".SH", ".SS")):
            yield sh, ss, lines
            heading = plain(line)
            sh, ss = (heading, "") if line.startswith(".SH") else (sh, heading)
            lines = []
        else:
            lines.append(line)
    yield sh, ss, lines


def tagged_flags(lines: list[str]) -> set[str]:
    """Flags named in the tag line of each ``.TP`` (where an option is defined)."""
    return {f for i, line in enumerate(lines[:-1]) if line == ".TP"
            for f in FLAG.findall(plain(lines[i + 1]))}


def section_text(page: Path, name: str) -> str:
    return "\n".join(plain(line) for sh, _, lines in sections(page) if sh == name
                     for line in lines)


def documented_commands(page: Path, prog: str) -> Tree:
    """``.SS prog a b`` under COMMANDS is the command ``(a, b)``; OPTIONS is ``()``."""
    doc: Tree = {}
    for sh, ss, lines in sections(page):
        if sh == "OPTIONS" and not ss:
            doc[()] = tagged_flags(lines) - HELP
        elif sh == "COMMANDS" and ss:
            words = ss.split()
            assert words[0] == prog, f"{page.name}: subsection {ss!r} is not a {prog} command"
            doc[tuple(words[1:])] = tagged_flags(lines)
    return doc


# -- reading the CLIs ----------------------------------------------------------------------


def options(command: Any) -> set[str]:
    return {o for p in command.params if p.param_type_name == "option"
            for o in (*p.opts, *p.secondary_opts)} - HELP


def command_tree(app: typer.Typer) -> Tree:
    """Every command path a user can type (groups only at the root), with its options."""
    tree: Tree = {}

    def walk(command: Any, path: tuple[str, ...]) -> None:
        subcommands = getattr(command, "commands", {})
        if path in PASSTHROUGH:
            parser = PASSTHROUGH[path]()
            tree[path] = {o for a in parser._actions for o in a.option_strings} - HELP
        elif not subcommands or not path:
            tree[path] = options(command)
        for name, sub in subcommands.items():
            if not sub.hidden:
                walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return tree


def differences(cli: Tree, doc: Tree, page: str) -> list[str]:
    """What the page lacks and what it has that the CLI lacks, one line each."""
    out = []
    name = lambda path: " ".join(path) or "(global options)"  # noqa: E731
    for path in sorted(cli.keys() - doc.keys()):
        out.append(f"{page}: command '{name(path)}' is not documented")
    for path in sorted(doc.keys() - cli.keys()):
        out.append(f"{page}: documents command '{name(path)}', which does not exist")
    for path in sorted(cli.keys() & doc.keys()):
        for flag in sorted(cli[path] - doc[path]):
            out.append(f"{page}: '{name(path)}' option {flag} is not documented")
        for flag in sorted(doc[path] - cli[path]):
            out.append(f"{page}: '{name(path)}' documents {flag}, which does not exist")
    return out


# -- the checks ----------------------------------------------------------------------------


def test_every_page_is_there_and_pip_installs_it() -> None:
    assert [p.name for p in PAGES] == ["mlxcel-cluster.toml.5", "mlxceld.8", "mlxctl.1"]
    with (ROOT / "pyproject.toml").open("rb") as f:
        data_files = tomllib.load(f)["tool"]["setuptools"]["data-files"]
    installed = {f"{d}/{Path(f).name}" for d, files in data_files.items() for f in files}
    assert installed == {f"share/man/man{p.suffix[1:]}/{p.name}" for p in PAGES}


def test_mlxctl_page_matches_the_command_tree() -> None:
    cli = command_tree(mlxctl_app)
    assert ("secret", "generate") in cli and ("model", "fixture") in cli  # the walk works
    assert cli[("model", "fixture")] >= {"--preset", "--no-tie-embeddings", "--overwrite"}
    problems = differences(cli, documented_commands(MAN / "mlxctl.1", "mlxctl"), "mlxctl.1")
    assert not problems, "\n".join(problems)


def test_mlxceld_page_matches_its_flags() -> None:
    cli = command_tree(mlxceld_app)
    assert list(cli) == [()] and "--pp-auto" in cli[()]
    problems = differences(cli, documented_commands(MAN / "mlxceld.8", "mlxceld"), "mlxceld.8")
    assert not problems, "\n".join(problems)


def test_the_comparison_reports_both_directions() -> None:
    cli: Tree = {(): {"--socket"}, ("status",): {"--json", "--new"}, ("gone",): set()}
    doc: Tree = {(): {"--socket"}, ("status",): {"--json", "--old"}, ("extra",): set()}
    assert differences(cli, doc, "p") == [
        "p: command 'gone' is not documented",
        "p: documents command 'extra', which does not exist",
        "p: 'status' option --new is not documented",
        "p: 'status' documents --old, which does not exist",
    ]


def source_environment() -> set[str]:
    """Variables the code reads: MLXCEL* names, and literal os.environ lookups."""
    names = {sdnotify.ENV_SOCKET, sdnotify.ENV_WATCHDOG_USEC, sdnotify.ENV_WATCHDOG_PID}
    for path in [*ROOT.joinpath("mlxceld").rglob("*.py"), *ROOT.joinpath("mlxctl").rglob("*.py")]:
        text = path.read_text()
        names |= set(re.findall(r'"(MLXCELD?_[A-Z_]+)"', text))
        names |= set(re.findall(r'environ(?:\.get)?[(\[]\s*"([A-Z_]+)"', text))
    return names


def test_every_environment_variable_is_documented() -> None:
    names = source_environment()
    assert {"MLXCELD_SOCKET", "MLXCEL_CLUSTER_SECRET", "STATE_DIRECTORY"} <= names
    documented = (section_text(MAN / "mlxceld.8", "ENVIRONMENT")
                  + section_text(MAN / "mlxctl.1", "ENVIRONMENT"))
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", documented))
    assert not missing, f"not in an ENVIRONMENT section: {missing}"


def test_exit_codes_are_documented() -> None:
    codes = {edge.EXIT_FAILURE, edge.EXIT_USAGE, edge.EXIT_NOT_RUNNING, edge.EXIT_DENIED, 0, 130}
    tags = set(re.findall(r"^\.B (\d+)$", (MAN / "mlxctl.1").read_text(), re.M))
    assert {str(c) for c in codes} <= tags
    daemon = section_text(MAN / "mlxceld.8", "EXIT STATUS")
    assert all(re.search(rf"^{c}$", daemon, re.M) for c in (0, 1, 2)), daemon


def test_every_signal_the_daemon_handles_is_documented() -> None:
    handled = set(re.findall(r"signal\.(SIG[A-Z]+)", (ROOT / "mlxceld/daemon/root.py").read_text()))
    assert {"SIGTERM", "SIGINT", "SIGHUP"} <= handled
    text = section_text(MAN / "mlxceld.8", "SIGNALS")
    assert not sorted(s for s in handled if s not in text)
    assert "second SIGTERM or SIGINT" in text


def mandoc_lint(page: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mandoc", "-Tlint", "-W", "all", str(page)], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.skipif(shutil.which("mandoc") is None,
                    reason="mandoc is not installed (.ci/run installs it where it can)")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_mandoc_lint_is_clean(page: Path) -> None:
    done = mandoc_lint(page)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), \
        done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("mandoc") is None,
                    reason="mandoc is not installed (.ci/run installs it where it can)")
def test_mandoc_lint_reports_a_fault(tmp_path: Path) -> None:
    bad = tmp_path / "bad.1"
    bad.write_text((MAN / "mlxctl.1").read_text().replace(".SH NAME\n", ".SH NAME\n.XX\n"))
    done = mandoc_lint(bad)
    assert done.returncode != 0 and "XX" in done.stdout + done.stderr
