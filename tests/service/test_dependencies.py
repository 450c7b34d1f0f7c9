"""pyproject.toml's dependencies against the code: every third-party module that mlxceld/
or mlxctl/ imports is declared, every declaration is used, and the floors that were set
for a reason (a CVE, an API) are still there and hold in this environment."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
OURS = {"mlxceld", "mlxctl"}
# Declared but never imported by name, each with why it is declared anyway.
INDIRECT: dict[str, str] = {}


def requirements() -> list[Requirement]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]


def declared() -> dict[str, list[Requirement]]:
    out: dict[str, list[Requirement]] = {}
    for req in requirements():
        out.setdefault(canonicalize_name(req.name), []).append(req)
    return out


def imported_names(tree: ast.AST) -> Iterator[str]:
    """Top-level module names: import statements, and import_module() of a literal prefix
    (``import_module(f"mlx_lm.models.{family}")`` imports mlx_lm)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.split(".")[0]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args):
            arg = node.args[0]
            head = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else arg
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                yield head.value.split(".")[0]


def third_party_imports() -> dict[str, set[str]]:
    """Each third-party top-level module, with the files that import it."""
    out: dict[str, set[str]] = {}
    for package in sorted(OURS):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in imported_names(ast.parse(path.read_text(), str(path))):
                if name not in sys.stdlib_module_names and name not in OURS:
                    out.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return out


def undeclared(imports: dict[str, set[str]], names: set[str]) -> list[str]:
    """One line per imported module that no declared distribution provides."""
    providers = importlib.metadata.packages_distributions()
    out = []
    for module, files in sorted(imports.items()):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists & names:
            which = ", ".join(sorted(dists)) or "no installed distribution"
            out.append(f"{sorted(files)[0]} imports '{module}' (from {which}), which "
                       "pyproject.toml does not declare: add it to [project] dependencies")
    return out


def test_the_import_walk_sees_what_the_code_imports() -> None:
    imports = third_party_imports()
    assert {"mlx", "mlx_lm", "uvicorn", "tokenizers", "jinja2"} <= imports.keys()
    assert "mlxceld/models/fixtures/tokenizer.py" in imports["tokenizers"]
    assert not {"os", "asyncio", "mlxceld", "mlxctl"} & imports.keys()


def test_every_imported_module_is_declared() -> None:
    problems = undeclared(third_party_imports(), set(declared()))
    assert not problems, "\n".join(problems)


def test_an_undeclared_import_is_reported() -> None:
    """The check above can fail: drop tokenizers from the declarations."""
    names = set(declared()) - {"tokenizers"}
    problems = undeclared(third_party_imports(), names)
    assert len(problems) == 1
    assert problems[0].startswith("mlxceld/models/fixtures/tokenizer.py imports 'tokenizers'")


def test_every_declared_dependency_is_imported_or_says_why_not() -> None:
    providers = importlib.metadata.packages_distributions()
    used = {canonicalize_name(d) for m in third_party_imports() for d in providers.get(m, [])}
    unused = sorted(set(declared()) - used - set(INDIRECT))
    assert not unused, f"declared in pyproject.toml but never imported: {unused}"


def allows(name: str, version: str) -> bool:
    return all(r.specifier.contains(version, prereleases=True) for r in declared()[name])


def test_the_floors_and_caps_that_have_reasons() -> None:
    assert not allows("h11", "0.15.0") and allows("h11", "0.16.0")  # CVE-2025-43859
    assert not allows("jinja2", "3.1.5") and allows("jinja2", "3.1.6")  # sandbox escapes
    # mlx-lm: 0.32's BatchGenerator, and nothing newer until the suite has run on it.
    assert not allows("mlx-lm", "0.31.3") and allows("mlx-lm", "0.32.2")
    assert not allows("mlx-lm", "0.33.0")
    assert not allows("mlx", "0.32.1") and not allows("mlx", "0.33.0")


def test_this_environment_has_the_declared_versions() -> None:
    """The tests run on what pyproject.toml allows (an install older than a new pin
    would pass here while testing versions we no longer ship)."""
    wrong = []
    for req in requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = importlib.metadata.version(req.name)
        if not req.specifier.contains(version, prereleases=True):
            wrong.append(f"{req.name} {version} is installed; pyproject.toml asks {req}")
    assert not wrong, "\n".join(wrong) + "\nrun: make install"
