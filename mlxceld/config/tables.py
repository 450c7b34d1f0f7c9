"""A TOML document's tables and values, checked as they are read: each refusal is a
``ConfigError`` naming where (``where``: the file, or the flags), the key (with its
table's ``prefix``, e.g. ``daemon.``) and what it must be, with a hint how to write it."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxceld.errors import ConfigError


def read_toml(path: Path, *, required: bool) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"config file {path} does not exist",
            hint="create it, or drop --config to use the defaults",
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}",
                          hint="fix the line it names") from exc
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}",
                          hint="check its permissions") from exc


def check_keys(table: Mapping[str, Any], known: set[str], where: str, prefix: str) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(
                f"{where}: unknown key '{prefix}{key}'",
                hint=f"known keys here: {', '.join(sorted(prefix + k for k in known))}",
            )


def table_of(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: '{key}' must be a table, not {type(value).__name__}",
                          hint=f"write it as [{key}]")
    return value


def string(table: Mapping[str, Any], key: str, where: str, prefix: str) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: '{prefix}{key}' must be a non-empty string",
                          hint=f'write it as {key} = "..."')
    return value


def path_of(table: Mapping[str, Any], key: str, base: Path, where: str,
          prefix: str = "daemon.") -> Path | None:
    value = string(table, key, where, prefix)
    if value is None:
        return None
    p = Path(value).expanduser()
    return p if p.is_absolute() else base / p


def number(table: Mapping[str, Any], key: str, where: str, prefix: str, default: float,
            *, allow_zero: bool = False) -> float:
    value = table.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, int | float) or value < 0
            or (value == 0 and not allow_zero)):
        kind = "non-negative" if allow_zero else "positive"
        raise ConfigError(f"{where}: '{prefix}{key}' must be a {kind} number, not {value!r}",
                          hint=f"for example {key} = {default}")
    return float(value)
