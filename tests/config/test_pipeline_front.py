"""``--pipeline-coordinator`` ([serve] pipeline_coordinator): a router in front of a
pipeline names its coordinator's agent address; refused by name where it does not go
(config/front.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.daemon import Config, build_config
from mlxceld.errors import ConfigError


def config(tmp_path: Path, args: list[str], serve: dict[str, object] | None = None) -> Config:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        flags = overrides(ctx.params)
    data = {"daemon": {"state_dir": str(tmp_path / "s")}, "serve": serve or {}}
    return build_config(data, tmp_path / "m.toml", flags)


def test_a_host_alone_is_the_default_agent_port_and_discovery_is_not_needed(
        tmp_path: Path) -> None:
    cfg = config(tmp_path, ["--node-role", "router", "--pipeline-coordinator", "Studio-1.local"])
    assert cfg.serve.pipeline_coordinator == "studio-1.local:19000"
    assert cfg.serve.replicas == ()  # no --cluster-peers: a front discovers no replicas
    by_key = config(tmp_path, ["--node-role", "router"],
                    serve={"pipeline_coordinator": "10.0.0.1:19001"})
    assert by_key.serve.pipeline_coordinator == "10.0.0.1:19001"
    assert config(tmp_path, []).serve.pipeline_coordinator is None


@pytest.mark.parametrize("args,serve,said", [
    (["--pipeline-coordinator", "10.0.0.1"], {}, "is for --node-role router"),
    (["--node-role", "router", "--pipeline-coordinator", "10.0.0.1", "--replicas",
      "10.0.0.2"], {}, "excludes --replicas"),
    (["--node-role", "router", "--pipeline-coordinator", "0.0.0.0:19000"], {}, "wildcard"),
    (["--node-role", "router", "--pipeline-coordinator", "a,b"], {}, "one agent address"),
    (["--node-role", "router"], {"pipeline_coordinator": 19000}, "one agent address"),
    (["--node-role", "router"], {"pipeline_coordinator": "studio.local:0"},
     "has port 0, outside 1-65535"),
    (["--node-role", "router"], {"pipeline_coordinator": "[fd00::1]:65536"},
     "has port 65536, outside 1-65535"),
    (["--node-role", "router"], {"pipeline_coordinator": "studio.local:x"},
     "has port 'x', not a number"),
    (["--node-role", "router"], {"pipeline_coordinator": "studio_1!:19000"},
     "neither an IP address nor a hostname"),
    (["--node-role", "router", "--pipeline-coordinator", "studio.local:0"], {},
     "outside 1-65535"),
])
def test_it_is_refused_by_name_where_it_does_not_go(tmp_path: Path, args: list[str],
                                                    serve: dict[str, object],
                                                    said: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(tmp_path, args, serve=serve)
    assert said in err.value.message
    assert "pipeline_coordinator" in err.value.message or "--pipeline-coordinator" in \
        err.value.message


def test_a_host_name_is_kept_as_written_and_resolved_when_dialed(tmp_path: Path) -> None:
    """No DNS at start (config/peers.py): a name is the coordinator's as written, even one
    that does not resolve now; the router asks it each ``FOLLOW_S`` and a name that does
    not resolve then shows as the front's ``unreachable`` with why
    (daemon/following.py)."""
    for name in ("localhost:19001", "no-such-host.invalid:19000"):
        cfg = config(tmp_path, ["--node-role", "router"], serve={"pipeline_coordinator": name})
        assert cfg.serve.pipeline_coordinator == name


def test_standby_goes_with_a_pipeline_coordinator_only(tmp_path: Path) -> None:
    """``--standby`` / ``[serve] standby`` (daemon/standby.py): on a router in front of a
    pipeline; refused by name elsewhere (exit 2 at start)."""
    front = ["--node-role", "router", "--pipeline-coordinator", "10.0.0.1"]
    assert config(tmp_path, [*front, "--standby"]).serve.standby
    assert config(tmp_path, front, serve={"standby": True}).serve.standby
    assert not config(tmp_path, front).serve.standby
    for args, serve, said in ((["--standby"], {}, "--standby is for a router in front"),
                              (["--node-role", "router"], {"standby": True},
                               "'serve.standby' is for a router in front"),
                              (front, {"standby": "yes"}, "must be true or false")):
        with pytest.raises(ConfigError) as err:
            config(tmp_path, args, serve=serve)
        assert said in err.value.message, err.value.message
