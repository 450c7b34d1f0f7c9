"""The daemon's configuration: a TOML file, flags over it, and every refusal naming its key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlxceld.config.daemon import Config, Overrides, build_config, load_config
from mlxceld.errors import ConfigError
from mlxceld.paths import client_socket, default_config_file, default_socket, default_state_dir
from mlxceld.roles.options import EchoOptions
from mlxceld.supervisor.states import RestartPolicy

linux_only = pytest.mark.skipif(sys.platform == "darwin", reason="XDG locations are Linux's")

ENV = ("STATE_DIRECTORY", "CONFIGURATION_DIRECTORY", "RUNTIME_DIRECTORY", "XDG_STATE_HOME",
       "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No systemd or XDG variables from the outside; HOME is a temp dir."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def refusal(data: dict[str, Any], path: Path | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build_config(data, path, Overrides())
    assert info.value.hint, "every ConfigError tells the user what to do next"
    return info.value


# -- Defaults and overrides ----------------------------------------------------------------------


@linux_only
def test_defaults_without_file_or_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    config = build_config({}, None, Overrides())
    state = tmp_path / "xdg-state" / "mlxceld"
    assert config == Config(state_dir=state, socket=state / "mlxceld.sock")
    assert config.config_file is None
    assert config.log_level == "info"
    assert config.log_file is None
    assert config.policy == RestartPolicy()
    assert config.health_interval_s == 5.0
    assert config.log_max_bytes == 10 * 1024 * 1024
    assert config.log_backups == 3
    assert config.workers == ()


def test_file_values_are_read(tmp_path: Path) -> None:
    data = {
        "daemon": {"state_dir": "/srv/mx", "socket": "/run/mx.sock", "log_level": "debug",
                   "log_file": "/var/log/mx.log"},
        "supervisor": {"backoff_initial_s": 0.5, "flap_max_exits": 3, "health_interval_s": 2,
                       "log_max_bytes": 4096, "log_backups": 1},
        "workers": {"w1": {"role": "echo", "options": {"interval_s": 0.1},
                           "stop_timeout_s": 2.5}},
    }
    config = build_config(data, tmp_path / "mlxceld.toml", Overrides())
    assert config.state_dir == Path("/srv/mx")
    assert config.socket == Path("/run/mx.sock")
    assert config.log_level == "debug"
    assert config.log_file == Path("/var/log/mx.log")
    assert config.policy == RestartPolicy(backoff_initial_s=0.5, flap_max_exits=3)
    assert config.health_interval_s == 2.0
    assert (config.log_max_bytes, config.log_backups) == (4096, 1)
    (w1,) = config.workers
    assert (w1.name, w1.role, w1.options) == ("w1", "echo", EchoOptions(interval_s=0.1))
    # A worker's policy starts from [supervisor] and overrides what it names.
    assert w1.policy == RestartPolicy(backoff_initial_s=0.5, flap_max_exits=3, stop_timeout_s=2.5)


def test_flags_override_file_values(tmp_path: Path) -> None:
    data = {"daemon": {"state_dir": "/srv/file", "socket": "/run/file.sock",
                       "log_level": "error", "log_file": "/var/log/file.log"}}
    flags = Overrides(state_dir=tmp_path / "flag-state", socket=tmp_path / "flag.sock",
                      log_level="warning", log_file=tmp_path / "flag.log")
    config = build_config(data, tmp_path / "mlxceld.toml", flags)
    assert config.state_dir == tmp_path / "flag-state"
    assert config.socket == tmp_path / "flag.sock"
    assert config.log_level == "warning"
    assert config.log_file == tmp_path / "flag.log"


def test_relative_paths_resolve_against_the_config_files_dir(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    data = {"daemon": {"state_dir": "state", "socket": "run/ctl.sock", "log_file": "log/d.log"}}
    config = build_config(data, etc / "mlxceld.toml", Overrides())
    assert config.state_dir == etc / "state"
    assert config.socket == etc / "run" / "ctl.sock"
    assert config.log_file == etc / "log" / "d.log"


def test_socket_defaults_beside_the_configured_state_dir(tmp_path: Path) -> None:
    config = build_config({"daemon": {"state_dir": str(tmp_path / "s")}}, None, Overrides())
    assert config.socket == tmp_path / "s" / "mlxceld.sock"


def test_whole_float_for_an_int_policy_field_is_taken_as_int() -> None:
    config = build_config({"supervisor": {"flap_max_exits": 2.0}}, None, Overrides())
    assert config.policy.flap_max_exits == 2
    assert type(config.policy.flap_max_exits) is int


def test_zero_jitter_is_allowed_as_restart_policy_allows_it() -> None:
    config = build_config({"supervisor": {"backoff_jitter": 0}}, None, Overrides())
    assert config.policy.backoff_jitter == 0


def test_negative_jitter_is_refused() -> None:
    error = refusal({"supervisor": {"backoff_jitter": -0.1}})
    assert "'supervisor.backoff_jitter' must be a non-negative number, not -0.1" in str(error)


# -- Refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"deamon": {}}, "deamon"),
        ({"daemon": {"log_levl": "info"}}, "daemon.log_levl"),
        ({"supervisor": {"backoff_s": 1.0}}, "supervisor.backoff_s"),
        ({"workers": {"w1": {"role": "echo", "optoins": {}}}}, "workers.w1.optoins"),
        ({"workers": {"w1": {"role": "echo", "health_interval_s": 1.0}}},
         "workers.w1.health_interval_s"),
    ],
)
def test_unknown_key_is_refused_by_its_full_name(data: dict[str, Any], key: str,
                                                 tmp_path: Path) -> None:
    path = tmp_path / "mlxceld.toml"
    error = refusal(data, path)
    assert str(error) == f"{path}: unknown key '{key}'"
    assert "known keys here" in error.hint


def test_unknown_key_hint_lists_the_known_ones() -> None:
    error = refusal({"daemon": {"log_levl": "info"}})
    assert str(error) == "config: unknown key 'daemon.log_levl'"
    assert "daemon.log_level" in error.hint
    assert "daemon.state_dir" in error.hint


def test_bad_log_level_in_the_file() -> None:
    error = refusal({"daemon": {"log_level": "verbose"}})
    assert "'verbose'" in str(error)
    assert "debug, info, warning, error" in str(error)


def test_bad_log_level_from_the_flag() -> None:
    with pytest.raises(ConfigError, match="'loud'"):
        build_config({}, None, Overrides(log_level="loud"))


@pytest.mark.parametrize("value", ["", 3])
def test_daemon_strings_must_be_non_empty_strings(value: object) -> None:
    error = refusal({"daemon": {"state_dir": value}})
    assert "'daemon.state_dir' must be a non-empty string" in str(error)


@pytest.mark.parametrize(
    ("table", "key", "value"),
    [
        ("supervisor", "backoff_initial_s", 0),
        ("supervisor", "stop_timeout_s", -1.5),
        ("supervisor", "health_interval_s", 0),
        ("supervisor", "log_max_bytes", -10),
        ("supervisor", "start_timeout_s", "30"),
        ("supervisor", "liveness_failures", True),
    ],
)
def test_non_positive_or_non_numbers_are_refused(table: str, key: str, value: object) -> None:
    error = refusal({table: {key: value}})
    assert f"'{table}.{key}' must be a positive number, not {value!r}" in str(error)


def test_non_positive_number_in_a_worker_names_the_worker() -> None:
    error = refusal({"workers": {"w1": {"role": "echo", "stop_timeout_s": 0}}})
    assert "'workers.w1.stop_timeout_s' must be a positive number" in str(error)


def test_float_for_an_int_policy_field_is_refused() -> None:
    error = refusal({"supervisor": {"flap_max_exits": 2.5}})
    assert "'supervisor.flap_max_exits' must be a whole number" in str(error)


def test_float_for_an_int_policy_field_in_a_worker_is_refused() -> None:
    error = refusal({"workers": {"w1": {"role": "echo", "liveness_failures": 1.5}}})
    assert "'workers.w1.liveness_failures' must be a whole number" in str(error)


def test_restart_policy_validation_surfaces_as_config_error() -> None:
    error = refusal({"supervisor": {"backoff_jitter": 1.5}})
    assert str(error).startswith("config: [supervisor] RestartPolicy.backoff_jitter must be")
    assert isinstance(error.__cause__, ValueError)


def test_restart_policy_cross_field_rule_in_a_worker() -> None:
    data = {"supervisor": {"backoff_max_s": 2.0},
            "workers": {"w1": {"role": "echo", "backoff_initial_s": 5.0}}}
    error = refusal(data)
    assert "[workers.w1]" in str(error)
    assert "backoff_max_s must be >= backoff_initial_s" in str(error)


@pytest.mark.parametrize("name", ["Web", "-w", "a b", "x" * 64, ""])
def test_bad_worker_name(name: str) -> None:
    error = refusal({"workers": {name: {"role": "echo"}}})
    assert f"worker name {name!r} is not allowed" in str(error)


def test_longest_allowed_worker_name() -> None:
    config = build_config({"workers": {"x" * 63: {"role": "echo"}}}, None, Overrides())
    assert config.workers[0].name == "x" * 63


@pytest.mark.parametrize(("spec", "shown"), [({"role": "llama"}, "'llama'"), ({}, "None")])
def test_unknown_or_missing_role(spec: dict[str, Any], shown: str) -> None:
    error = refusal({"workers": {"w1": spec}})
    assert f"'workers.w1.role' must be one of echo, not {shown}" in str(error)


def test_options_must_be_a_table() -> None:
    error = refusal({"workers": {"w1": {"role": "echo", "options": [1, 2]}}})
    assert "'workers.w1.options' must be a table" in str(error)


@pytest.mark.parametrize(("options", "said"), [
    ({"interval_s": 0.1, "intervall_s": 2}, "unknown option 'workers.w1.options.intervall_s'"),
    ({"interval_s": "fast"}, "option 'workers.w1.options.interval_s' must be a number, "
                             "not 'fast'"),
    ({"ignore_term": 1}, "option 'workers.w1.options.ignore_term' must be true or false"),
    ({"exit_code": 2.5}, "option 'workers.w1.options.exit_code' must be an integer"),
    ({"interval_s": 0}, "option 'workers.w1.options.interval_s' must be > 0, not 0.0"),
])
def test_worker_options_are_checked_as_the_file_is_read(options: dict[str, Any],
                                                        said: str) -> None:
    error = refusal({"workers": {"w1": {"role": "echo", "options": options}}},
                    Path("/etc/mlxceld.toml"))
    assert str(error).startswith("/etc/mlxceld.toml: ") and said in str(error)
    assert "interval_s" in error.hint  # it names the role's options


def test_worker_must_be_a_table() -> None:
    error = refusal({"workers": {"w1": "echo"}})
    assert "'workers.w1' must be a table" in str(error)


@pytest.mark.parametrize("key", ["daemon", "supervisor", "workers"])
def test_top_level_sections_must_be_tables(key: str) -> None:
    error = refusal({key: 3})
    assert f"'{key}' must be a table, not int" in str(error)


# -- Loading the file ------------------------------------------------------------------------------


def test_load_config_reads_the_given_file(tmp_path: Path) -> None:
    path = tmp_path / "mlxceld.toml"
    path.write_text('[daemon]\nstate_dir = "st"\n\n[workers.w1]\nrole = "echo"\n')
    config = load_config(Overrides(config_file=path))
    assert config.config_file == path
    assert config.state_dir == tmp_path / "st"
    assert [w.name for w in config.workers] == ["w1"]


def test_load_config_missing_given_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(Overrides(config_file=path))
    assert str(info.value) == f"config file {path} does not exist"
    assert "--config" in info.value.hint


def test_load_config_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[daemon\nstate_dir = ")
    with pytest.raises(ConfigError) as info:
        load_config(Overrides(config_file=path))
    assert str(info.value).startswith(f"config file {path} is not valid TOML")
    assert info.value.hint


def test_load_config_given_a_directory_says_it_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(Overrides(config_file=tmp_path))


@linux_only
def test_absent_default_config_file_is_fine(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "st"))
    config = load_config(Overrides())
    assert config.config_file is None
    assert config.state_dir == tmp_path / "st" / "mlxceld"


@linux_only
def test_present_default_config_file_is_read(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    default = tmp_path / "cfg" / "mlxceld" / "mlxceld.toml"
    default.parent.mkdir(parents=True)
    default.write_text('[daemon]\nlog_level = "debug"\nstate_dir = "here"\n')
    config = load_config(Overrides())
    assert config.config_file == default
    assert config.log_level == "debug"
    assert config.state_dir == default.parent / "here"


# -- Default locations -----------------------------------------------------------------------------


def test_systemd_directories_win(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/mlxceld:/var/lib/other")
    monkeypatch.setenv("CONFIGURATION_DIRECTORY", "/etc/mlxceld")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/mlxceld:/run/other")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xs"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xc"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xr"))
    assert default_state_dir() == Path("/var/lib/mlxceld")
    assert default_config_file() == Path("/etc/mlxceld/mlxceld.toml")
    assert default_socket(tmp_path) == Path("/run/mlxceld/mlxceld.sock")
    assert client_socket() == Path("/run/mlxceld/mlxceld.sock")


@linux_only
def test_xdg_directories(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xs"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xc"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", f"{tmp_path / 'xr'}:/elsewhere")
    assert default_state_dir() == tmp_path / "xs" / "mlxceld"
    assert default_config_file() == tmp_path / "xc" / "mlxceld" / "mlxceld.toml"
    assert default_socket(Path("/ignored")) == tmp_path / "xr" / "mlxceld" / "mlxceld.sock"
    assert client_socket() == tmp_path / "xr" / "mlxceld" / "mlxceld.sock"


@linux_only
def test_home_fallbacks(clean_env: Path) -> None:
    home = clean_env
    assert default_state_dir() == home / ".local" / "state" / "mlxceld"
    assert default_config_file() == home / ".config" / "mlxceld" / "mlxceld.toml"
    assert default_socket(Path("/srv/st")) == Path("/srv/st/mlxceld.sock")
    assert client_socket() == home / ".local" / "state" / "mlxceld" / "mlxceld.sock"


@linux_only
def test_empty_xdg_variables_count_as_unset(monkeypatch: pytest.MonkeyPatch,
                                            clean_env: Path) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", "")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "")
    monkeypatch.setenv("STATE_DIRECTORY", "")
    assert default_state_dir() == clean_env / ".local" / "state" / "mlxceld"
    assert default_socket(Path("/srv/st")) == Path("/srv/st/mlxceld.sock")


def test_a_log_file_that_cannot_be_opened_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "mlxceld.log"
    out = subprocess.run(
        [sys.executable, "-m", "mlxceld", "--state-dir", str(tmp_path / "state"),
         "--socket", str(tmp_path / "ctl.sock"), "--log-file", str(missing)],
        capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert f"log file {missing} cannot be opened" in out.stderr
    assert "[daemon] log_file" in out.stderr and "Traceback" not in out.stderr


def test_the_openai_ports_connection_bounds_are_read(tmp_path: Path) -> None:
    from mlxceld.config.serve import router_options

    default = build_config({}, None, Overrides()).serve
    assert (default.max_connections, default.header_timeout_s, default.body_timeout_s,
            default.write_timeout_s) == (1024, 10.0, 60.0, 20.0)
    data = {"serve": {"model": "org/model", "max_connections": 64, "header_timeout_s": 2,
                      "body_timeout_s": 0.5, "write_timeout_s": 3}}
    options = router_options(build_config(data, tmp_path / "mlxceld.toml", Overrides()).serve)
    assert (options.max_connections, options.header_timeout_s, options.body_timeout_s,
            options.write_timeout_s) == (64, 2.0, 0.5, 3.0)


def test_the_stage_silence_bound_reaches_the_router_and_the_stage(tmp_path: Path) -> None:
    """``[serve] stage_silence_s``: the router's heartbeat on its stage links, and (through
    the roster) a stage worker's on its links to other stages."""
    from mlxceld.config.serve import router_options

    assert build_config({}, None, Overrides()).serve.stage_silence_s == 3.0
    data = {"serve": {"model": "org/model", "stage_silence_s": 1.5}}
    serve = build_config(data, tmp_path / "mlxceld.toml", Overrides()).serve
    assert serve.stage_silence_s == 1.5
    assert router_options(serve).stage_silence_s == 1.5


def test_the_max_tokens_bound_reaches_the_router(tmp_path: Path) -> None:
    """``[serve] max_tokens`` / ``--max-tokens`` (the flag wins); unset: None, the context."""
    from mlxceld.config.serve import router_options

    data = {"serve": {"model": "org/model"}}
    assert router_options(build_config(data, None, Overrides()).serve).max_tokens is None
    data = {"serve": {"model": "org/model", "max_tokens": 300}}
    serve = build_config(data, tmp_path / "mlxceld.toml", Overrides()).serve
    assert router_options(serve).max_tokens == 300
    serve = build_config(data, tmp_path / "mlxceld.toml", Overrides(max_tokens=20)).serve
    assert router_options(serve).max_tokens == 20
    with pytest.raises(ConfigError, match="--max-tokens must be at least 1, not 0"):
        build_config(data, None, Overrides(max_tokens=0))


@pytest.mark.parametrize(("key", "value", "says"), [
    ("max_tokens", 0, "must be at least 1, not 0"),
    ("max_tokens", 1.5, "must be an integer, not 1.5"),
    ("max_connections", 0, "must be at least 1, not 0"),
    ("max_connections", "many", "must be"),
    ("header_timeout_s", 0, "must be a number of seconds above 0, not 0"),
    ("header_timeout_s", True, "must be a number of seconds above 0, not True"),
    ("body_timeout_s", float("inf"), "must be a number of seconds above 0, not inf"),
    ("body_timeout_s", "60", "must be a number of seconds above 0, not '60'"),
    ("write_timeout_s", 0, "must be a number of seconds above 0, not 0"),
    ("write_timeout_s", "20", "must be a number of seconds above 0, not '20'"),
    ("stage_silence_s", 0, "must be a number of seconds above 0, not 0"),
    ("stage_silence_s", -1.5, "must be a number of seconds above 0, not -1.5"),
])
def test_bad_connection_bounds_are_refused_by_name(key: str, value: object, says: str) -> None:
    error = refusal({"serve": {key: value}})
    assert f"'serve.{key}' {says}" in str(error)


def test_a_tp_rank_is_no_workers_role_and_its_names_are_reserved() -> None:
    error = refusal({"workers": {"tp-1": {"role": "echo"}}})
    assert "worker name 'tp-1' is reserved for a tensor-parallel rank" in str(error)
    error = refusal({"workers": {"w1": {"role": "tp"}}})
    assert "'workers.w1.role' must be one of echo, not 'tp'" in str(error)
