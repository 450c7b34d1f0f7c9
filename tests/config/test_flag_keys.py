"""Every flag of `mlxceld` has a config-file key that does what the flag does, or is in the
documented flag-only list; a flag-only key in the file is refused by name."""

from __future__ import annotations

import dataclasses
import grp
import os
from pathlib import Path
from typing import Any

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.daemon import FLAG_KEYS, FLAG_ONLY, Config, build_config
from mlxceld.errors import ConfigError

# A value for each flag as typed, the same value as written in the file, and flags that
# must come with it (on both sides). Paths are absolute: relative ones resolve against the
# working directory (a flag) or the file's directory (a key), by design.
GROUP = grp.getgrgid(os.getgid()).gr_name
SAMPLES: dict[str, tuple[str | None, Any, tuple[str, ...]]] = {
    "--state-dir": ("/srv/mx/state", "/srv/mx/state", ()),
    "--socket": ("/srv/mx/ctl.sock", "/srv/mx/ctl.sock", ()),
    "--log-level": ("debug", "debug", ()),
    "--log-file": ("/srv/mx/log", "/srv/mx/log", ()),
    "--log-format": ("json", "json", ()),
    "--model": ("MODEL", "MODEL", ()),  # a real directory, below
    "--model-name": ("tiny", "tiny", ()),
    "--allowed-origins": ("http://a.example,https://B.example:8443",
                          ["http://a.example", "https://b.example:8443"], ()),
    "--generation-config": ("none", "none", ()),
    "--host": ("0.0.0.0", "0.0.0.0", ()),
    "--port": ("9090", 9090, ()),
    "--api-key-file": ("/srv/mx/key", "/srv/mx/key", ()),
    "--max-tokens": ("2048", 2048, ()),
    "--context-length": ("8192", 8192, ()),
    "--serving-port": ("19200", 19200, ()),
    "--cluster-secret-file": ("/srv/mx/secret", "/srv/mx/secret", ()),
    "--agent-addr": ("10.0.0.1:19001", "10.0.0.1:19001", ()),
    "--distributed-config": ("/srv/mx/c.toml", "/srv/mx/c.toml", ("--node-id", "stage-1")),
    "--node-id": ("stage-1", "stage-1", ("--distributed-config", "/srv/mx/c.toml")),
    "--cluster-name": ("lab", "lab", ()),
    "--cluster-peers": ("10.0.0.2:19000,10.0.0.3:19000", ["10.0.0.2:19000", "10.0.0.3:19000"],
                        ()),
    "--cluster-discovery": ("mdns", "mdns", ()),
    "--pp-auto": ("3", 3, ()),
    "--pp-peer": (None, True, ()),  # a switch
    "--mesh": ("auto", "auto", ("--pp-auto", "4")),
    "--cluster-config-out": ("/srv/mx/out.toml", "/srv/mx/out.toml", ()),
    "--stage-ports": ("19100-19199", "19100-19199", ()),
    "--node-role": ("router", "router", ("--replicas", "10.0.0.2")),
    "--replicas": ("10.0.0.2,mac-3", ["10.0.0.2", "mac-3:19000"], ("--node-role", "router")),
    "--pipeline-coordinator": ("10.0.0.1", "10.0.0.1:19000", ("--node-role", "router")),
    "--standby": (None, True, ("--node-role", "router", "--pipeline-coordinator", "10.0.0.1")),
    "--prefill-peers": ("10.0.0.3", ["10.0.0.3:19000"],
                        ("--node-role", "router", "--decode-peers", "10.0.0.4")),
    "--decode-peers": ("10.0.0.4:19001", ["10.0.0.4:19001"],
                       ("--node-role", "router", "--prefill-peers", "10.0.0.3")),
    "--kv-compression": ("int8+lz4", "int8+lz4", ()),
    "--tp-size": ("2", 2, ()),
    "--tp-moe-mode": ("shard", "shard", ("--tp-size", "2")),
    "--tp-embedding-mode": ("replicate", "replicate", ("--tp-size", "2")),
    "--tp-lm-head-mode": ("replicate", "replicate", ("--tp-size", "2")),
    "--tp-peers": ("10.0.0.11", ["10.0.0.11:19000"], ("--tp-size", "2")),
    "--kv-bits": ("8", 8, ()),
    "--kv-group-size": ("32", 32, ("--kv-bits", "8")),
    "--quantized-kv-start": ("100", 100, ("--kv-bits", "4")),
    "--draft-model": ("MODEL", "MODEL", ()),
    "--num-draft-tokens": ("6", 6, ("--draft-model", "org/draft")),
    # A group that exists here; a group's socket may not be inside the state dir.
    "--socket-group": (GROUP, GROUP, ("--socket", "/run/mlxceld-flag-keys/ctl.sock")),
}
ROOT = Path(__file__).resolve().parents[2]
ORIGINS = {"config_file", "cluster_secret_origin"}  # where a value came from, not the value


def cli_flags() -> set[str]:
    command = typer.main.get_command(app)
    return {o for p in command.params if p.param_type_name == "option"
            for o in p.opts if o.startswith("--")} - {"--help"}


def parse(args: list[str]) -> Any:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        return overrides(ctx.params)


def values(cfg: Config) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ORIGINS}


def test_every_flag_has_a_key_or_is_flag_only() -> None:
    flags = cli_flags()
    assert {"--pp-auto", "--stage-ports", "--config", "--dry-run"} <= flags  # the walk works
    assert not FLAG_KEYS.keys() & FLAG_ONLY.keys()
    assert flags == FLAG_KEYS.keys() | FLAG_ONLY.keys(), (
        f"without a key or a place in FLAG_ONLY: "
        f"{sorted(flags - FLAG_KEYS.keys() - FLAG_ONLY.keys())}; "
        f"listed but not a flag: {sorted((FLAG_KEYS.keys() | FLAG_ONLY.keys()) - flags)}")
    assert SAMPLES.keys() == FLAG_KEYS.keys()


@pytest.mark.parametrize("flag", sorted(FLAG_KEYS))
def test_the_key_does_what_the_flag_does(flag: str, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    typed, written, companions = SAMPLES[flag]
    typed = str(model) if typed == "MODEL" else typed
    written = str(model) if written == "MODEL" else written
    table, key = FLAG_KEYS[flag].split(".")
    path = tmp_path / "mlxceld.toml"
    base = {"daemon": {"state_dir": str(tmp_path / "s")}} if flag != "--state-dir" else {}

    by_flag = build_config(base, path, parse([*companions, flag, *([typed] if typed else [])]))
    data = {**base, table: {**base.get(table, {}), key: written}}
    by_key = build_config(data, path, parse(list(companions)))
    unset = build_config(base, path, parse([]))
    assert values(by_key) == values(by_flag)
    assert values(by_key) != values(unset), f"{FLAG_KEYS[flag]} changed nothing"


def test_every_key_is_documented() -> None:
    man = (ROOT / "man" / "mlxceld.8").read_text()
    page = man.split(".SH CONFIGURATION FILE")[1].split("\n.SH ")[0]
    docstring = (ROOT / "mlxceld" / "config/daemon.py").read_text()
    for flag, where in FLAG_KEYS.items():
        key = where.split(".")[1]
        assert key in page, f"{where} ({flag}) is not in mlxceld(8), CONFIGURATION FILE"
        if where.startswith("daemon."):
            assert f"\n    {key} = " in docstring, f"{where} is not in config/daemon.py's docstring"


@pytest.mark.parametrize("key", ["dry_run", "reset_state", "config", "version"])
def test_a_flag_only_key_in_the_file_is_refused_by_name(key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({"daemon": {key: True}}, tmp_path / "m.toml", parse([]))
    flag = "--" + key.replace("_", "-")
    assert err.value.message.startswith(f"{tmp_path / 'm.toml'}: 'daemon.{key}' cannot be set "
                                        f"in the config file: {flag} is a flag only")
    assert flag in err.value.hint


def test_pp_auto_from_the_file_is_checked_like_the_flag(tmp_path: Path) -> None:
    where = tmp_path / "m.toml"
    for bad in (0, 65, True, "2"):
        with pytest.raises(ConfigError, match=r"'daemon\.pp_auto'"):
            build_config({"daemon": {"pp_auto": bad}}, where, parse([]))
    with pytest.raises(ConfigError, match=r"pp_peer \(--pp-peer\) excludes pp_auto"):
        build_config({"daemon": {"pp_auto": 2}}, where, parse(["--pp-peer"]))
    with pytest.raises(ConfigError, match="exclude each other"):
        build_config({"daemon": {"pp_auto": 2, "distributed_config": "c.toml",
                                 "node_id": "n"}}, where, parse([]))
    cfg = build_config({"daemon": {"pp_auto": 2}}, where, parse(["--pp-auto", "4",
                                                                 "--dry-run"]))
    assert (cfg.pp_auto, cfg.dry_run) == (4, True)  # the flag wins; --dry-run goes with both
    assert build_config({"daemon": {"pp_auto": 2}}, where, parse(["--dry-run"])).dry_run


def test_relative_secret_and_out_files_resolve_against_the_files_dir(tmp_path: Path) -> None:
    cfg = build_config({"daemon": {"cluster_secret_file": "secret",
                                   "cluster_config_out": "out.toml"}},
                       tmp_path / "m.toml", parse([]))
    assert cfg.cluster_secret_file == tmp_path / "secret"
    assert cfg.cluster_secret_origin == f"{tmp_path / 'm.toml'}: 'daemon.cluster_secret_file'"
    assert cfg.cluster_config_out == tmp_path / "out.toml"
    flagged = build_config({"daemon": {"cluster_secret_file": "secret"}}, tmp_path / "m.toml",
                           parse(["--cluster-secret-file", "/etc/s"]))
    assert (flagged.cluster_secret_file, flagged.cluster_secret_origin) == (
        Path("/etc/s"), "--cluster-secret-file")
