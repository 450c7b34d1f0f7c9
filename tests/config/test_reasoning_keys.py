"""``[serve] reasoning_field`` and ``[serve] unknown_fields``: checked at the edge, each
refusal naming its key, carried to the router worker through its bootstrap pipe, and
agreeing with what the app takes (``api/reasoning.py``, ``api/ignoring.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.api.ignoring import UNKNOWN_FIELDS as APP_UNKNOWN_FIELDS
from mlxceld.api.reasoning import REASONING_KEYS
from mlxceld.config.daemon import Overrides, build_config
from mlxceld.config.serve import router_options
from mlxceld.errors import ConfigError
from mlxceld.roles import ROUTER
from mlxceld.roles.options import (
    REASONING_FIELDS,
    UNKNOWN_FIELDS,
    RouterOptions,
    options_json,
    parse_options,
)

WHERE = Path("/srv/mx/mlxceld.toml")


def serve_options(table: dict[str, object]) -> RouterOptions:
    cfg = build_config({"serve": {"model": "org/model", **table}}, WHERE, Overrides())
    return router_options(cfg.serve)


def test_the_choices_are_the_apps() -> None:
    assert REASONING_FIELDS == REASONING_KEYS and UNKNOWN_FIELDS == APP_UNKNOWN_FIELDS


def test_defaults_and_set_values_reach_the_router_worker() -> None:
    options = serve_options({})
    assert (options.reasoning_field, options.unknown_fields) == ("reasoning_content", "refuse")
    options = serve_options({"reasoning_field": "both", "unknown_fields": "warn"})
    again = parse_options(ROUTER, options_json(options))
    assert isinstance(again, RouterOptions)
    assert (again.reasoning_field, again.unknown_fields) == ("both", "warn")


@pytest.mark.parametrize(("key", "value", "says"), [
    ("reasoning_field", "thinking", "must be one of reasoning_content, reasoning, both, not "
                                    "'thinking'"),
    ("reasoning_field", 1, "must be a string, not 1"),
    ("unknown_fields", "ignore", "must be one of refuse, warn, not 'ignore'"),
    ("unknown_fields", True, "must be a string, not True"),
])
def test_a_bad_value_is_refused_naming_its_key(key: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({"serve": {key: value}}, WHERE, Overrides())
    assert f"{WHERE}: 'serve.{key}' {says}" in err.value.message
    assert err.value.hint


def test_the_worker_refuses_a_bad_option_by_name() -> None:
    raw = {**options_json(serve_options({})), "unknown_fields": "loud"}
    with pytest.raises(ConfigError) as err:
        parse_options(ROUTER, raw)
    assert "option 'options.unknown_fields' must be one of refuse, warn, not 'loud'" in \
        err.value.message
