"""The rooms of mlxceld form a one-way stack (ARCHITECTURE.md): each module imports only
from its own room or the rooms below it. Read from the sources with ``ast``, so that a
wrong import fails here naming the file, the line and the import, before any cycle
shows up at run time. ``if TYPE_CHECKING:`` imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlxceld"

# Bottom first. A room is a package under mlxceld/ or a top-level module.
STACK = [
    "wire",  # the sans-IO protocol core: imports nothing of ours
    "errors", "types", "paths", "privatefile", "failpoints", "roles", "sdnotify", "tasks",
    "logformat",
    "state", "models", "net",
    "guard",  # what every HTTP listener lets a connection hold (control socket, OpenAI port)
    "supervisor", "control",
    "config",
    "drain",  # the drain state (state/drains.py) and the router told of it
    "discovery", "engine", "pipeline",
    "replicas",  # a router's pool of replica engines and the wire to the nodes serving them
    "api",
    "workers",
    "cluster",
    "observe",  # the daemon's /metrics: its own and its workers', read at each scrape
    # the composition root and its windows: roster, serving, draining, stage watch, replica
    # peers (each the daemon's side of one concern)
    "daemon",
    "preflight",  # `mlxceld --check-config`: the start-up's checks that change nothing
    "cli", "__main__",
]
RANK = {room: i for i, room in enumerate(STACK)}
# What mlxctl may use: the control client and what it needs; never the daemon's insides
# (its database, supervisor, network shell) nor the daemon itself.
CLI_FORBIDDEN = {"daemon", "cli", "state", "supervisor", "net", "discovery", "pipeline",
                 "engine", "api", "workers"}


def room_of(module: str) -> str | None:
    """The room of ``mlxceld.X...`` (None: not ours, or the package's own attributes)."""
    parts = module.split(".")
    if parts[0] != "mlxceld" or len(parts) < 2:
        return None
    name = parts[1]
    if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file():
        return name
    return None  # an attribute of mlxceld itself, e.g. __version__


def imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute import in ``path``: (line, module or module.name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def own_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_room_is_in_the_stack() -> None:
    rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in own_modules()}
    assert rooms - {"__init__"} == set(STACK), (
        f"rooms missing from STACK (add them where they belong): "
        f"{sorted(rooms - {'__init__'} - set(STACK))}; in STACK but gone: "
        f"{sorted(set(STACK) - rooms)}")


def test_imports_point_down_the_stack() -> None:
    wrong = []
    for path in own_modules():
        here = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if here == "__init__":
            continue
        for line, name in imports(path):
            there = room_of(name)
            if there is None or there == here:
                continue
            if RANK[there] > RANK[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {name} "
                             f"({there} is above {here})")
    assert not wrong, "imports up the stack:\n" + "\n".join(wrong)


# The inner rooms of the two flat rooms that grew most: what each may import of its own
# room's other inner rooms. A module directly in the room (api/chatting.py) is its core;
# the core may use the low inner rooms (``LOW``) but not the high ones, which only the
# room's entry points (``ENTRIES``: the app and the field tables) assemble.
INNER: dict[str, dict[str, set[str]]] = {
    "api": {"tools": set(), "edge": set(), "responses": {"tools"}, "anthropic": {"tools"}},
    "control": {"clients": set()},
}
LOW = {"api": {"tools", "edge"}, "control": set()}
ENTRIES = {"api": {"app", "endpoints", "fielddoc", "__init__"}, "control": {"__init__"}}


def inner_of(room: str, parts: tuple[str, ...]) -> str | None:
    """The inner room of ``room`` that ``parts`` (a module's path below it) lies in."""
    return parts[0] if len(parts) > 1 and parts[0] in INNER[room] else None


def test_inner_rooms_import_only_what_they_may() -> None:
    wrong = []
    for room, allowed in INNER.items():
        for path in (PACKAGE / room).rglob("*.py"):
            parts = path.relative_to(PACKAGE / room).with_suffix("").parts
            here = inner_of(room, parts)
            for line, name in imports(path):
                names = name.split(".")
                if names[:2] != ["mlxceld", room] or len(names) < 4:
                    continue
                there = inner_of(room, tuple(names[2:]))
                if there is None or there == here:
                    continue
                if here is None:
                    ok = there in LOW[room] or parts[0] in ENTRIES[room]
                else:
                    ok = there in allowed[here]
                if not ok:
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not wrong, "imports across inner rooms:\n" + "\n".join(wrong)


def test_every_inner_room_is_named() -> None:
    for room, inner in INNER.items():
        found = {p.name for p in (PACKAGE / room).iterdir()
                 if p.is_dir() and (p / "__init__.py").exists()}
        assert found == set(inner), (room, found)


def test_the_wire_imports_nothing_of_ours() -> None:
    ours = [f"{p.relative_to(ROOT)}:{line}: {name}"
            for p in own_modules() if p.relative_to(PACKAGE).parts[0] == "wire"
            for line, name in imports(p)
            if room_of(name) not in (None, "wire")]
    assert not ours, ours


def test_mlxctl_talks_to_the_daemon_only_through_its_client() -> None:
    wrong = [f"{p.relative_to(ROOT)}:{line}: {name}"
             for p in sorted((ROOT / "mlxctl").glob("*.py"))
             for line, name in imports(p) if room_of(name) in CLI_FORBIDDEN]
    assert not wrong, wrong


@pytest.mark.parametrize(("source", "room"), [
    ("from mlxceld.cluster.coordinator import Coordinator", "cluster"),
    ("from mlxceld import __version__", None),
    ("import mlxceld.wire.address", "wire"),
    ("from mlxceld.roles import WORKER_ROLES", "roles"),
])
def test_the_check_sees_each_kind_of_import(source: str, room: str | None,
                                            tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(source + "\n")
    (line, name), = imports(path)
    assert line == 1 and room_of(name) == room


def test_architecture_names_every_room_once() -> None:
    """ARCHITECTURE.md's rooms table has a row naming each room of the stack (a new room
    gets its line there), and no row for a room that is gone."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text[text.index("| room | what lives there |"):text.index("### Where to look")]
    named = [name.strip("`/") for row in table.splitlines()[2:] if row.startswith("| ")
             for name in row.split(" | ")[0][2:].split(", ")]
    assert sorted(named) == sorted(STACK), (sorted(set(STACK) - set(named)),
                                            sorted(set(named) - set(STACK)))
