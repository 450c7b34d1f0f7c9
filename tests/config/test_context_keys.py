"""``[serve] context_length`` (``--context-length``) and ``[serve] prompt_cache_bytes``:
checked at the edge, each refusal naming its key, carried to the router worker, and the
context served the lesser of the model's and the cap (``models/context.py``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.config.serve import router_options
from mlxceld.errors import ConfigError
from mlxceld.models.context import DEFAULT_CONTEXT, model_context, served_context
from mlxceld.roles import ROUTER
from mlxceld.roles.options import RouterOptions, options_json, parse_options

MODEL = {"model": "org/model"}  # a repo id: nothing is read


def serve_options(table: dict[str, object], flags: Overrides | None = None) -> RouterOptions:
    cfg = build_config({"serve": {**MODEL, **table}}, Path("/srv/mx/mlxceld.toml"),
                       flags or Overrides())
    return router_options(cfg.serve)


def test_unset_the_model_context_and_the_default_cache_reach_the_router() -> None:
    options = serve_options({})
    assert (options.context_length, options.prompt_cache_bytes) == (None, None)


def test_both_keys_reach_the_router_and_the_flag_wins() -> None:
    options = serve_options({"context_length": 8192, "prompt_cache_bytes": 0})
    assert (options.context_length, options.prompt_cache_bytes) == (8192, 0)
    assert serve_options({"context_length": 8192},
                         Overrides(context_length=1024)).context_length == 1024
    # and through the bootstrap pipe, as the worker reads them
    again = parse_options(ROUTER, options_json(options))
    assert isinstance(again, RouterOptions)
    assert (again.context_length, again.prompt_cache_bytes) == (8192, 0)


@pytest.mark.parametrize(("key", "value", "says"), [
    ("context_length", 0, "must be at least 1, not 0"),
    ("context_length", -4096, "must be at least 1, not -4096"),
    ("context_length", 1.5, "must be an integer, not 1.5"),
    ("context_length", "32k", "must be an integer, not '32k'"),
    ("context_length", True, "must be an integer, not True"),
    ("prompt_cache_bytes", -1, "must be 0 or more, not -1"),
    ("prompt_cache_bytes", 2.5e9, "must be an integer, not 2500000000.0"),
    ("prompt_cache_bytes", "2GiB", "must be an integer, not '2GiB'"),
    ("prompt_cache_bytes", False, "must be an integer, not False"),
])
def test_a_bad_value_is_refused_naming_its_key(key: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({"serve": {key: value}}, Path("/srv/mx/mlxceld.toml"), Overrides())
    assert f"/srv/mx/mlxceld.toml: 'serve.{key}' {says}" in err.value.message
    assert err.value.hint


def test_a_bad_flag_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="--context-length must be at least 1, not 0"):
        build_config({}, None, Overrides(context_length=0))


@pytest.mark.parametrize(("key", "value", "rule"), [
    ("context_length", 0, "be >= 1"), ("prompt_cache_bytes", -1, "be >= 0")])
def test_the_worker_refuses_a_bad_option_by_name(key: str, value: int, rule: str) -> None:
    raw = {**options_json(serve_options({})), key: value}
    with pytest.raises(ConfigError, match=f"option 'options.{key}' must {rule}, not {value}"):
        parse_options(ROUTER, raw)


def test_the_served_context_is_the_lesser_of_the_models_and_the_cap(
        caplog: pytest.LogCaptureFixture) -> None:
    config = {"max_position_embeddings": 32768}
    assert served_context(config, None) == 32768
    assert served_context(config, 4096) == 4096
    assert served_context(config, 32768) == 32768
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="mlxceld.models.context"):
        assert served_context(config, 131072, "qwen3") == 32768  # a ceiling: the model's
    assert caplog.messages == ["[serve] context_length 131072 is above qwen3's own context "
                               "of 32768 tokens: serving 32768"]


def test_where_a_model_states_its_context() -> None:
    assert model_context({"max_position_embeddings": 2048}) == 2048
    assert model_context({"max_seq_len": 1024}) == 1024
    assert model_context({"text_config": {"max_position_embeddings": 8192}}) == 8192
    assert model_context({"max_position_embeddings": None, "vocab_size": 10}) is None
    # a config that states none: the cap where one is set, else the default
    assert served_context({}, None) == DEFAULT_CONTEXT
    assert served_context({}, 100_000) == 100_000
