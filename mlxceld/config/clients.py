"""What the router port shows its clients: the model's names, the origins CORS allows,
and whether the model's ``generation_config.json`` gives the sampling defaults.

``[serve]`` keys (flags win)::

    model_name = ["qwen3", "gpt-4o-mini"]   # or "qwen3,gpt-4o-mini" (--model-name a,b):
                                            # the first is the id, the others aliases
    allowed_origins = ["http://localhost:3000"]   # or "*" (--allowed-origins); default
                                                  # none: no CORS (api/edge/cors.py)
    generation_config = "auto"              # auto: the model's sampling defaults; none:
                                            # OpenAI's (--generation-config)

A name is 1 to ``MAX_NAME_CHARS`` printable characters without spaces or commas (a name
may hold ``/``: ``Qwen/Qwen3-8B``); an origin is ``http(s)://host[:port]``, nothing
after it, as a browser sends it in ``Origin``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Literal

from mlxceld.errors import ConfigError

MAX_NAME_CHARS: Final = 256
GENERATION_CONFIGS: Final = ("auto", "none")
GenerationConfig = Literal["auto", "none"]
_ORIGIN: Final = re.compile(r"https?://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(:[0-9]{1,5})?")


def _listed(value: object, what: str, example: str) -> list[str]:
    """A list of strings, or a comma-separated string, as its items."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",")]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [item.strip() for item in value]
    raise ConfigError(f"{what} must be a string or a list of strings, not {value!r}",
                      hint=f"for example {example}")


def parse_model_names(value: object, what: str) -> str | None:
    """``value`` (``--model-name``, ``serve.model_name``, `mlxctl serve`'s name: a string
    or a list) as the names joined by commas, the primary first; None for None."""
    if value is None:
        return None
    names = _listed(value, what, '"qwen3,gpt-4o-mini"')
    for name in names:
        if not name or len(name) > MAX_NAME_CHARS or not name.isprintable() or \
                any(c.isspace() for c in name):
            raise ConfigError(f"{what}: model name {name!r} must be 1 to {MAX_NAME_CHARS} "
                              "printable characters without spaces",
                              hint="separate several names with commas: a,b")
    if len(set(names)) != len(names):
        raise ConfigError(f"{what} names a model twice: {', '.join(names)}",
                          hint="give each name once")
    return ",".join(names)


def parse_origins(flag: str | None, table: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """``--allowed-origins`` (winning) or ``serve.allowed_origins``, lower case; ``("*",)``
    for any origin; () when neither is given (no CORS)."""
    raw: object = flag if flag is not None else table.get("allowed_origins")
    what = "--allowed-origins" if flag is not None else f"{where}: 'serve.allowed_origins'"
    if raw is None:
        return ()
    origins = [o.lower() for o in _listed(raw, what, '["http://localhost:3000"] or "*"')]
    if "*" in origins:
        if len(origins) > 1:
            raise ConfigError(f"{what}: '*' allows any origin; list no others beside it",
                              hint='allowed_origins = "*"')
        return ("*",)
    for origin in origins:
        port = origin.rpartition(":")[2]
        if not _ORIGIN.fullmatch(origin) or (port.isdigit() and not 1 <= int(port) <= 65535):
            raise ConfigError(f"{what}: {origin!r} is not an origin",
                              hint="an origin is scheme://host[:port], as in "
                              "http://localhost:3000, with no path or trailing slash; or '*'")
    return tuple(dict.fromkeys(origins))


def parse_generation_config(flag: str | None, table: Mapping[str, Any],
                            where: str) -> GenerationConfig:
    """``--generation-config`` (winning) or ``serve.generation_config``: auto (default) or
    none."""
    raw: object = flag if flag is not None else table.get("generation_config", "auto")
    if raw not in GENERATION_CONFIGS:
        what = ("--generation-config" if flag is not None
                else f"{where}: 'serve.generation_config'")
        raise ConfigError(f"{what} must be auto or none, not {raw!r}",
                          hint="auto: the model's generation_config.json gives the sampling "
                          "defaults; none: OpenAI's")
    return raw
