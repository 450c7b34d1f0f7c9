"""errors.py's drawing of the exception tree is whole and true: every exception class
defined in a module of mlxceld appears in it once, under its real base (a foreign base,
``Exception`` or ``ValueError``, as a root of the drawing)."""

from __future__ import annotations

import builtins
import importlib
import inspect
import pkgutil

import mlxceld
from mlxceld import errors


def drawn() -> dict[str, str]:
    """Each class the drawing names -> the class drawn above it (its base); a root of the
    drawing (a builtin) -> ""."""
    doc = errors.__doc__ or ""
    lines = doc.splitlines()
    start = lines.index("    Exception")
    tree: dict[str, str] = {}
    parents: list[str] = []  # the names on the path to the current entry, by depth
    for line in lines[start:]:
        if not line.strip():
            break
        body = line[4:]
        if body[:1].isalpha():  # a root: a foreign base
            name, depth = body.split()[0], 0
        elif "── " in body:
            at = body.index("── ") + 3
            name, depth = body[at:].split()[0], at // 4
        else:
            continue  # a description's second line
        assert name not in tree, f"{name} is drawn twice"
        del parents[depth:]
        tree[name] = parents[-1] if parents else ""
        parents.append(name)
    return tree


def defined() -> dict[str, str]:
    """Every exception class defined at the top of a module of mlxceld -> its first base's
    name (a class with a second base, e.g. ``ValueError``, is drawn under its first and
    says the second in its description)."""
    found: dict[str, str] = {}
    for info in pkgutil.walk_packages(mlxceld.__path__, "mlxceld."):
        if info.name.endswith("__main__"):  # runs the program when imported
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) \
                    and obj.__module__ == module.__name__:
                assert name not in found, f"two exception classes named {name}"
                found[name] = obj.__bases__[0].__name__
    return found


def test_the_drawing_names_every_exception_class_under_its_real_base() -> None:
    tree, real = drawn(), defined()
    roots = {name for name, base in tree.items() if not base}
    assert roots == {"Exception", "ValueError"}
    assert all(isinstance(getattr(builtins, r), type) for r in roots)
    assert {n: b for n, b in tree.items() if b} == real


def test_the_drawing_is_read_as_drawn() -> None:
    tree = drawn()
    assert tree["MlxceldError"] == "Exception"
    assert tree["RequestTooLarge"] == "BadRequest"
    assert tree["ResolveError"] == "NetError"
    assert tree["BeaconError"] == "RemoteProtocolError"
    assert tree["RequestRefused"] == "ConstraintError"
    assert tree["SecretError"] == "ValueError"
