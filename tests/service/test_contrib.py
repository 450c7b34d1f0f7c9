"""The service files: example TOMLs through the real loaders, the launchd plists, the systemd
unit through ``systemd-analyze verify``, and the Homebrew formula's service block (the rest
of the formula is tests/service/test_packaging.py's)."""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer

from mlxceld.cli import app as mlxceld_app
from mlxceld.cluster.clusterfile.load import load_cluster
from mlxceld.cluster.clusterfile.placement import place, placed_config
from mlxceld.config.daemon import Overrides, build_config, load_config
from mlxceld.models import preset, write_fixture
from mlxceld.paths import MACOS_SYSTEM_SOCKET
from mlxctl.app import app as mlxctl_app

ROOT = Path(__file__).resolve().parents[2]
CONTRIB = ROOT / "contrib"
UNIT = CONTRIB / "systemd" / "mlxceld.service"
FORMULA = ROOT / "packaging" / "homebrew" / "mlxceld.rb"
PLISTS = sorted((CONTRIB / "launchd").glob("*/*.plist"))
CLUSTER_EXAMPLES = sorted(p for p in (CONTRIB / "cluster").glob("*.toml")
                          if not load_cluster(p).serving)  # pipelines
SERVING_EXAMPLES = sorted(p for p in (CONTRIB / "cluster").glob("*.toml")
                          if load_cluster(p).serving)  # routers over replicas and pools
TOOL_TIMEOUT_S = 60
# mlxctl as its console script runs it: the program name is what completion binds to.
MLXCTL = [sys.executable, "-c", "from mlxctl.app import app; app(prog_name='mlxctl')"]


def mlxceld_flags() -> set[str]:
    command = typer.main.get_command(mlxceld_app)
    return {o for p in command.params if p.param_type_name == "option" for o in p.opts}


# -- example TOMLs -------------------------------------------------------------------------


def test_example_config_loads_with_the_real_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    cfg = load_config(Overrides(config_file=CONTRIB / "mlxceld.toml"))
    assert cfg.config_file == CONTRIB / "mlxceld.toml"
    assert cfg.cluster_peers == ("192.168.1.11:19000", "192.168.1.12:19000")
    assert (cfg.serve.host, cfg.serve.port, cfg.serve.model) == ("127.0.0.1", 8080, None)
    assert cfg.log_backups == 3 and cfg.policy.stop_timeout_s == 10.0
    # Under systemd the unit's directories are the defaults the example leaves in place.
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/mlxceld")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/mlxceld")
    cfg = load_config(Overrides(config_file=CONTRIB / "mlxceld.toml"))
    assert cfg.state_dir == Path("/var/lib/mlxceld")
    assert cfg.socket == Path("/run/mlxceld/mlxceld.sock")


def test_there_are_cluster_examples() -> None:
    assert len(CLUSTER_EXAMPLES) >= 2 and SERVING_EXAMPLES


@pytest.mark.parametrize("example", CLUSTER_EXAMPLES, ids=lambda p: p.name)
def test_cluster_example_places_every_node_on_a_fixture_model(example: Path,
                                                              tmp_path: Path) -> None:
    cfg = load_cluster(example)
    assert cfg.stages and cfg.coordinator
    assert cfg.stages[-1].layers is not None
    layers = cfg.stages[-1].layers[1]
    model = tmp_path / "model"
    write_fixture(model, preset("tiny", family="qwen3", layers=layers))
    for node in cfg.nodes:
        placed = place(example, node.id, str(model))
        assert placed.node.id == node.id
    # A model with one layer fewer than the stages cover is refused.
    short = tmp_path / "short"
    write_fixture(short, preset("tiny", family="qwen3", layers=layers - 1))
    with pytest.raises(Exception, match="layer"):
        place(example, cfg.stages[0].id, str(short))


@pytest.mark.parametrize("example", SERVING_EXAMPLES, ids=lambda p: p.name)
def test_serving_example_places_every_node(example: Path, tmp_path: Path) -> None:
    cfg = load_cluster(example)
    model = tmp_path / "model"
    model.mkdir()
    base = build_config({"daemon": {"state_dir": str(tmp_path)}}, None,
                        Overrides(model=str(model)))
    roles = {node.id: placed_config(base, cfg, node, Overrides()).serve.node_role
             for node in cfg.nodes}
    assert roles == {n.id: n.role for n in cfg.nodes}


# -- launchd -------------------------------------------------------------------------------


def test_there_is_a_user_and_a_system_plist() -> None:
    assert [p.parent.name for p in PLISTS] == ["system", "user"]


@pytest.mark.parametrize("path", PLISTS, ids=lambda p: p.parent.name)
def test_plist_parses_and_has_the_required_keys(path: Path) -> None:
    with path.open("rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "org.mlxceld.mlxceld"
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restart on failure only
    assert plist["StandardOutPath"].startswith("/")  # launchd expands no ~
    assert plist["StandardErrorPath"].endswith("/mlxceld.log")
    assert plist["ExitTimeOut"] >= 25  # the default drain: 20 s router + 5 s slack
    assert plist["Umask"] == 0o077
    program, *args = plist["ProgramArguments"]
    assert Path(program).name == "mlxceld"
    flags = {a for a in args if a.startswith("-")}
    assert flags <= mlxceld_flags(), "the plist passes a flag mlxceld does not have"
    given = dict(zip(args[::2], args[1::2], strict=True))
    # The daemon writes and rotates the file launchd sends its early stderr to.
    assert given["--log-file"] == plist["StandardErrorPath"]
    if path.parent.name == "system":
        assert plist["UserName"] == "_mlxceld"
        assert "--state-dir" in args
        # The socket where mlxctl looks for the system daemon, open to the operator group.
        assert Path(given["--socket"]) == MACOS_SYSTEM_SOCKET
        assert given["--socket-group"] == plist["GroupName"] == "_mlxceld"
        assert Path(given["--log-file"]).parent.name == "mlxceld"  # a directory it owns
    else:
        assert set(given) == {"--log-file"}, \
            "the per-user agent runs with the defaults mlxctl also uses"
        assert "UserName" not in plist


# -- systemd -------------------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_unit_has_the_service_settings() -> None:
    s = unit_settings()
    for key, value in {"Type": "notify", "Restart": "on-failure", "StateDirectory": "mlxceld",
                       "StateDirectoryMode": "0700", "RuntimeDirectory": "mlxceld",
                       "RuntimeDirectoryMode": "0750", "UMask": "0077",
                       "User": "mlxceld", "Group": "mlxceld",
                       "NoNewPrivileges": "yes", "ProtectSystem": "strict",
                       "PrivateTmp": "yes", "ProtectKernelTunables": "yes",
                       "ProtectControlGroups": "yes", "LockPersonality": "yes",
                       "RestrictRealtime": "yes", "KillMode": "mixed"}.items():
        assert s.get(key) == [value], key
    assert set(s["RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET", "AF_INET6",
                                                           "AF_NETLINK"}
    assert s["ReadWritePaths"]
    assert s["RestartPreventExitStatus"] == ["2"]  # a config error is not retried
    assert int(s["TimeoutStopSec"][0].rstrip("s")) >= 25
    # One flag, the unit's own business (its group and RuntimeDirectory=); the rest is the
    # config file's.
    assert s["ExecStart"] == ["/usr/local/bin/mlxceld --socket-group mlxceld"]
    # A reload checks the file first (the same flags), then sends SIGHUP.
    assert s["ExecReload"] == ["/usr/local/bin/mlxceld --check-config --socket-group mlxceld",
                               "/bin/kill -HUP $MAINPID"]


def test_the_units_group_is_the_one_sysusers_makes() -> None:
    """The socket's group exists where the unit is installed: sysusers' `u mlxceld` makes
    the user and a group of the same name, which the unit runs as and opens the socket to."""
    entries = [line.split() for line in (UNIT.parent / "mlxceld.sysusers").read_text()
               .splitlines() if line.strip() and not line.startswith("#")]
    assert [e[:3] for e in entries] == [["u", "mlxceld", "-"]]
    flags = unit_settings()["ExecStart"][0].split()[1:]
    assert set(flags[::2]) <= mlxceld_flags()
    assert dict(zip(flags[::2], flags[1::2], strict=True)) == {"--socket-group": "mlxceld"}
    assert unit_settings()["Group"] == ["mlxceld"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not on PATH (it comes with systemd)")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify insists that ExecStart's binary exists: check a copy that runs this Python's
    # mlxceld entry point (or /bin/true where pip put none), and says nothing else changed.
    binary = shutil.which("mlxceld") or "/bin/true"
    text = UNIT.read_text()
    copy = tmp_path / "mlxceld.service"
    text = re.sub(r"(?m)^ExecReload=/usr/local/bin/mlxceld .*$", f"ExecReload={binary}", text)
    copy.write_text(re.sub(r"(?m)^ExecStart=.*$", f"ExecStart={binary}", text))
    env = {**os.environ, "SYSTEMD_LOG_LEVEL": "warning"}
    man = "no"
    if shutil.which("man"):
        # Documentation=man:... is checked against our own pages, laid out as man expects.
        for page in (ROOT / "man").iterdir():
            section = tmp_path / "man" / f"man{page.suffix[1:]}"
            section.mkdir(parents=True, exist_ok=True)
            shutil.copy(page, section / page.name)
        env["MANPATH"] = str(tmp_path / "man")
        man = "yes"
    done = subprocess.run(["systemd-analyze", "verify", f"--man={man}", str(copy)],
                          capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr
    # Unknown keys are only warnings to verify; we take any output as a failure.
    assert done.stderr.strip() == "" and done.stdout.strip() == "", done.stderr + done.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not on PATH (it comes with systemd)")
def test_verify_catches_a_misspelt_key(tmp_path: Path) -> None:
    """The check above can fail: a unit with a typo is reported."""
    bad = tmp_path / "mlxceld.service"
    bad.write_text(UNIT.read_text().replace("ExecStart=/usr/local/bin/mlxceld",
                                            "ExecStart=/bin/true")
                   .replace("KillMode=", "KillMod="))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", str(bad)],
                          capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    assert "Unknown key 'KillMod'" in done.stderr


# -- Homebrew ------------------------------------------------------------------------------


def test_formula_service_block_runs_the_daemon_with_brews_config() -> None:
    text = FORMULA.read_text()
    block = re.search(r"(?ms)^  service do\n(.*?)^  end\n", text)
    assert block, "no service do ... end block"
    body = block[1]
    # The config file post_install writes, which keeps state and socket under var/
    # (tests/service/test_packaging.py runs post_install).
    assert re.search(r'^\s+run \[opt_bin/"mlxceld", "--config", etc/"mlxceld/mlxceld.toml"\]$',
                     body, re.M), body
    assert re.search(r"^\s+keep_alive ", body, re.M)
    assert 'log_path var/"log/mlxceld.log"' in body
    assert 'error_log_path var/"log/mlxceld.log"' in body
    timeout = re.search(r"stop_timeout (\d+)", body)
    assert timeout and int(timeout[1]) >= 25, "stop_timeout below the drain deadline"
    for page in ("man1", "man5", "man8"):
        assert f"{page}.install" in text
    assert 'generate_completions_from_executable(bin/"mlxctl", shell_parameter_format: ' \
           ":typer)" in text


def test_mlxctl_prints_completions_the_way_homebrew_asks() -> None:
    """Homebrew's :typer format runs ``mlxctl --show-completion SHELL`` with shell
    detection off; the script must name mlxctl's completion variable."""
    for shell in ("bash", "zsh", "fish"):
        done = subprocess.run([*MLXCTL, "--show-completion", shell],
                              capture_output=True, text=True, timeout=TOOL_TIMEOUT_S,
                              env={**os.environ,
                                   "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
        assert done.returncode == 0, done.stderr
        assert "_MLXCTL_COMPLETE" in done.stdout, (shell, done.stdout[:200])
    # And the completion itself answers: `mlxctl st<TAB>`.
    done = subprocess.run(MLXCTL, capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT_S,
                          env={**os.environ, "_MLXCTL_COMPLETE": "complete_bash",
                               "COMP_WORDS": "mlxctl st", "COMP_CWORD": "1"})
    assert set(done.stdout.split()) >= {"status", "stop"}, done.stdout + done.stderr
    assert mlxctl_app  # the app the man-page test walks is the one that completes


def test_formula_toml_and_unit_agree_on_the_drain() -> None:
    """stop_timeout (brew), ExitTimeOut (launchd) and TimeoutStopSec (systemd) are one
    number, so no service manager cuts the drain shorter than another."""
    brew = int(re.search(r"stop_timeout (\d+)", FORMULA.read_text())[1])  # type: ignore[index]
    unit = int(unit_settings()["TimeoutStopSec"][0].rstrip("s"))
    plists = {plistlib.loads(p.read_bytes())["ExitTimeOut"] for p in PLISTS}
    assert {brew, unit} | plists == {brew}
    assert tomllib.loads((CONTRIB / "mlxceld.toml").read_text())["supervisor"][
        "stop_timeout_s"] < brew
