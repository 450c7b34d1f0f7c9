"""Options as JSON and back: a frozen dataclass of options written as the JSON object it
travels as (``object_json``), and read back field by field (``parse_kind``), each field
checked against its type hint; ``InvalidOption`` is a field's own rule broken
(``roles/options.py``'s checks). Generic over the dataclass: ``options.py`` holds the
roles' options and which role is which."""

from __future__ import annotations

import dataclasses
import types
from typing import TypeVar, Union, get_args, get_origin, get_type_hints

from mlxceld.errors import ConfigError

T = TypeVar("T")


class InvalidOption(ValueError):
    """A value of the right type that breaks its field's rule; ``parse_options`` names it."""

    def __init__(self, key: str, rule: str, value: object) -> None:
        super().__init__(f"{key} must {rule}, not {value!r}")
        self.key, self.rule, self.value = key, rule, value


def object_json(value: object) -> dict[str, object]:
    """A dataclass as a JSON object (tuples as lists, nested dataclasses as objects)."""
    assert dataclasses.is_dataclass(value) and not isinstance(value, type)
    return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}


def _to_json(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return object_json(value)
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    return value


def parse_kind(kind: type[T], raw: object, where: str) -> T:
    """``raw`` as a ``kind``: ``ConfigError`` naming the first field (``where.KEY``) that
    is missing, unknown, of the wrong type or breaks its rule."""
    if not isinstance(raw, dict):
        raise ConfigError(f"'{where}' must be a table of options, not {raw!r}",
                          hint=_hint(kind))
    fields = {f.name: f for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    hints = get_type_hints(kind)
    for key in raw:
        if key not in fields:
            raise ConfigError(f"unknown option '{where}.{key}'", hint=_hint(kind))
    values: dict[str, object] = {}
    for name, f in fields.items():
        if name in raw:
            values[name] = _value(hints[name], raw[name], f"{where}.{name}", _hint(kind))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"option '{where}.{name}' is missing", hint=_hint(kind))
    try:
        return kind(**values)
    except InvalidOption as exc:
        raise ConfigError(f"option '{where}.{exc.key}' must {exc.rule}, not {exc.value!r}",
                          hint=_hint(kind)) from None


def _value(tp: object, value: object, where: str, hint: str) -> object:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (a for a in args if a is not type(None))
        return _value(inner, value, where, hint)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _wrong(where, "a list", value, hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v, f"{where}[{i}]", hint) for i, v in enumerate(value))
        if len(value) != len(args):
            raise _wrong(where, f"a list of {len(args)}", value, hint)
        return tuple(_value(a, v, f"{where}[{i}]", hint)
                     for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return parse_kind(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _wrong(where, "true or false", value, hint)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _wrong(where, "an integer", value, hint)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _wrong(where, "a number", value, hint)
    if tp is str:
        if isinstance(value, str) and value:
            return value
        raise _wrong(where, "a non-empty string", value, hint)
    raise AssertionError(f"{where}: no parser for {tp!r}")


def _wrong(where: str, what: str, value: object, hint: str) -> ConfigError:
    return ConfigError(f"option '{where}' must be {what}, not {value!r}", hint=hint)


def _hint(kind: type) -> str:
    names = [f.name for f in dataclasses.fields(kind)]
    return f"known options here: {', '.join(names)} (mlxceld/roles/options.py)"
