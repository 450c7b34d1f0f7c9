"""``[serve] model_name`` as names (aliases), ``allowed_origins`` and
``generation_config`` (and their flags): checked at the edge, each refusal naming its key,
carried to the router worker through the bootstrap pipe (``config/clients.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxceld.config.daemon import Overrides, build_config
from mlxceld.config.serve import router_options
from mlxceld.errors import ConfigError
from mlxceld.roles import ROUTER
from mlxceld.roles.options import RouterOptions, options_json, parse_options

FILE = Path("/srv/mx/mlxceld.toml")
MODEL = {"model": "org/model"}  # a repo id: nothing is read


def serve_options(table: dict[str, object], flags: Overrides | None = None) -> RouterOptions:
    cfg = build_config({"serve": {**MODEL, **table}}, FILE, flags or Overrides())
    options = router_options(cfg.serve)
    again = parse_options(ROUTER, options_json(options))  # as the worker reads them
    assert again == options
    assert isinstance(again, RouterOptions)
    return again


def test_unset_one_name_no_cors_and_the_models_sampling() -> None:
    options = serve_options({})
    assert (options.model_name, options.model_aliases) == ("model", ())
    assert (options.allowed_origins, options.generation_config) == ((), "auto")


@pytest.mark.parametrize("names", [["qwen3", "gpt-4o-mini", "org/x"], "qwen3, gpt-4o-mini,org/x"])
def test_names_as_a_list_or_a_comma_string(names: object) -> None:
    options = serve_options({"model_name": names})
    assert (options.model_name, options.model_aliases) == ("qwen3", ("gpt-4o-mini", "org/x"))


def test_the_flags_win() -> None:
    options = serve_options({"model_name": "a", "allowed_origins": "*",
                             "generation_config": "auto"},
                            Overrides(model_name="b,c", allowed_origins="HTTP://Local:3000",
                                      generation_config="none"))
    assert (options.model_name, options.model_aliases) == ("b", ("c",))
    assert (options.allowed_origins, options.generation_config) == (("http://local:3000",),
                                                                    "none")


def test_origins() -> None:
    assert serve_options({"allowed_origins": "*"}).allowed_origins == ("*",)
    assert serve_options({"allowed_origins": ["https://a.example", "http://[::1]:8080",
                                              "https://a.example"]}).allowed_origins == \
        ("https://a.example", "http://[::1]:8080")


@pytest.mark.parametrize(("table", "says"), [
    ({"model_name": "a,,b"}, "'serve.model_name': model name '' must be 1 to 256"),
    ({"model_name": "has space"}, "model name 'has space' must be"),
    ({"model_name": "a,b,a"}, "'serve.model_name' names a model twice: a, b, a"),
    ({"model_name": 3}, "'serve.model_name' must be a string or a list of strings, not 3"),
    ({"model_name": []}, "'serve.model_name' must be a string or a list of strings, not []"),
    ({"allowed_origins": "localhost:3000"}, "'serve.allowed_origins': 'localhost:3000' is "
                                            "not an origin"),
    ({"allowed_origins": ["http://a.example/"]}, "'http://a.example/' is not an origin"),
    ({"allowed_origins": ["http://a.example:70000"]}, "'http://a.example:70000' is not an"),
    ({"allowed_origins": ["*", "http://a.example"]}, "'*' allows any origin; list no others"),
    ({"allowed_origins": True}, "must be a string or a list of strings, not True"),
    ({"generation_config": "vllm"}, "'serve.generation_config' must be auto or none, not "
                                    "'vllm'"),
])
def test_a_bad_value_is_refused_naming_its_key(table: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({"serve": {**MODEL, **table}}, FILE, Overrides())
    assert says in err.value.message
    assert str(FILE) in err.value.message and err.value.hint


def test_a_bad_flag_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError) as err:
        build_config({"serve": MODEL}, FILE, Overrides(model_name="a, a"))
    assert err.value.message.startswith("--model-name names a model twice")
    with pytest.raises(ConfigError) as err:
        build_config({"serve": MODEL}, FILE, Overrides(generation_config="off"))
    assert err.value.message.startswith("--generation-config must be auto or none")


def test_mlxctl_serves_names_as_the_file_does(tmp_path: Path) -> None:
    """`mlxctl serve DIR --name a,b` keeps its names as one string (config/serve.py)."""
    cfg = build_config({"serve": {}}, FILE, Overrides()).serve.with_model(str(tmp_path), "a,b")
    assert (cfg.served_name, cfg.served_names) == ("a", ("a", "b"))
    assert cfg.with_model(str(tmp_path / "qwen3")).served_names == ("qwen3",)


def test_the_router_reads_the_models_defaults_unless_told_none(tmp_path: Path) -> None:
    from mlxceld.models.generation import SamplingDefaults
    from mlxceld.workers.router import sampling_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 20}')
    auto = serve_options({"model": str(tmp_path)})
    none = serve_options({"model": str(tmp_path), "generation_config": "none"})
    assert sampling_defaults(auto, str(tmp_path)) == SamplingDefaults(temperature=0.6, top_k=20)
    assert sampling_defaults(none, str(tmp_path)) == SamplingDefaults()
