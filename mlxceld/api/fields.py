"""Typed reads of a JSON object's fields, each refusal an ``ApiError`` naming the field.

``null`` counts as absent everywhere: some clients send every optional field,
unset ones as null. Booleans are never numbers here, though Python says so.
"""

from __future__ import annotations

import json
import math
from typing import Any

from mlxceld.api.errors import ApiError, invalid

SHOWN_CHARS = 40


def parse_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object. NaN and Infinity are not JSON; nor is a body
    nested deeper than the parser's recursion allows."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise invalid("the request body is nested too deeply to be parsed") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, oversized int literals
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid(f"the request body must be a JSON object, not {kind(value)}")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def kind(value: Any) -> str:
    """How a JSON value's type is named in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def show(value: Any) -> str:
    """A value as JSON, cut short enough for an error message."""
    try:
        text = json.dumps(value)
    except ValueError:  # an integer past Python's conversion limit
        return "a very long number"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def check_text(text: str, param: str) -> str:
    """Refuse strings that cannot be UTF-8 encoded (JSON allows lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{param!r} holds an unpaired UTF-16 surrogate", param) from None
    return text


def member(item: Any, path: str) -> Fields:
    """An array's member that must be an object (a message, a tool, a content part), as
    ``Fields`` named by its path."""
    if not isinstance(item, dict):
        raise invalid(f"{path!r} must be an object, not {kind(item)}", path)
    return Fields(item, path)


class Fields:
    """The fields of one JSON object; ``name`` in messages is the field's path."""

    def __init__(self, obj: dict[str, Any], prefix: str = "") -> None:
        self._obj = obj
        self._prefix = prefix

    def path(self, name: str) -> str:
        return f"{self._prefix}.{name}" if self._prefix else name

    def get(self, name: str) -> Any:
        return self._obj.get(name)

    def wrong(self, name: str, wanted: str) -> ApiError:
        value = self._obj.get(name)
        return invalid(f"{self.path(name)!r} must be {wanted}, not {kind(value)}", self.path(name))

    def object(self, name: str, wanted: str = "an object") -> dict[str, Any] | None:
        """An object-valued field, or None when absent."""
        value = self.get(name)
        if value is not None and not isinstance(value, dict):
            raise self.wrong(name, wanted)
        return value

    def array(self, name: str, wanted: str = "an array") -> list[Any] | None:
        """An array-valued field, or None when absent."""
        value = self.get(name)
        if value is not None and not isinstance(value, list):
            raise self.wrong(name, wanted)
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.wrong(name, "a boolean")
        return value

    def string(self, name: str) -> str | None:
        value = self.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.wrong(name, "a string")
        return check_text(value, self.path(name))

    def integer(self, name: str, low: int, high: int | None = None) -> int | None:
        value = self.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.wrong(name, "an integer")
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"between {low} and {high}"
            raise invalid(f"{self.path(name)!r} must be an integer {bounds}, not {show(value)}",
                          self.path(name))
        return value

    def number(self, name: str, default: float, low: float, high: float, *,
               low_open: bool = False) -> float:
        value = self.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.wrong(name, "a number")
        # Compared before float(): an integer literal may be too large for a float.
        too_low = value <= low if low_open else value < low
        if (isinstance(value, float) and not math.isfinite(value)) or too_low or value > high:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise invalid(f"{self.path(name)!r} must be a number in {interval}, not {show(value)}",
                          self.path(name))
        return float(value)
