"""`mlxceld --check-config`: the real entry point, run as a subprocess, says "config OK" (exit
0) or the first error naming the file, key or flag (exit 2), and starts and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxceld", "--check-config", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_good_file_is_ok_and_nothing_is_started_or_written(tmp_path: Path,
                                                              fixture_dir: Path) -> None:
    secret = write(tmp_path / "secret", "s" * 32 + "\n")
    secret.chmod(0o600)
    key = write(tmp_path / "key", "sk-local-key\n")
    key.chmod(0o600)
    cfg = write(tmp_path / "mlxceld.toml", f"""
[daemon]
state_dir = "state"
socket = "run/ctl.sock"
log_file = "daemon.log"
cluster_secret_file = "secret"
stage_ports = "19100-19199"
[serve]
model = "{fixture_dir / 'llama'}"
port = 18080
api_key_file = "key"
""")
    done = check("--config", str(cfg))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"config OK: {cfg}"
    assert done.stderr == ""
    for made in ("state", "run", "daemon.log"):  # no state dir, socket or log file
        assert not (tmp_path / made).exists()


def test_the_default_config_file_is_found(tmp_path: Path) -> None:
    home = tmp_path / "xdg"
    write((home / "mlxceld").mkdir(parents=True) or home / "mlxceld" / "mlxceld.toml",
          f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n')
    done = check(env={"XDG_CONFIG_HOME": str(home), "HOME": str(tmp_path),
                      "CONFIGURATION_DIRECTORY": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"config OK: {home / 'mlxceld' / 'mlxceld.toml'}"


@pytest.mark.parametrize(("toml", "names"), [
    ('[daemon\nlog_level = "info"\n', "is not valid TOML"),
    ('[daemon]\nlog_levle = "info"\n', "daemon.log_levle"),
    ('[daemon]\nlog_level = "loud"\n', "log level 'loud'"),
    ('[serve]\nport = "http"\n', "'serve.port' must be an integer"),
    ('[serve]\nmodel = "no/such/dir/here/x"\n', "does not exist"),
    ('[daemon]\nstage_ports = "19200-19100"\n', "daemon.stage_ports"),
    ('[daemon]\nagent_addr = "nowhere:port"\n', "daemon.agent_addr"),
    ('[daemon]\ncluster_secret_file = "short"\n', "holds 5 byte(s)"),
    ('[daemon]\ncluster_secret_file = "missing"\n', "cannot be read"),
    ('[serve]\nnode_role = "router"\nreplicas = ["10.0.0.2"]\n', "needs the cluster secret"),
    ('[daemon]\nlog_file = "no-dir/daemon.log"\n', "log file"),
    ('[daemon]\ncheck_config = true\n', "--check-config is a flag only"),
    ('[daemon]\npp_auto = 2\n', "--pp-auto needs the model to plan"),
    ('[daemon]\ndistributed_config = "nope.toml"\nnode_id = "stage-0"\n', "nope.toml"),
])
def test_a_bad_file_names_its_fault(tmp_path: Path, toml: str, names: str) -> None:
    write(tmp_path / "short", "12345").chmod(0o600)
    cfg = write(tmp_path / "bad.toml", f'{toml}\n')
    if "[daemon]" in toml and "state_dir" not in toml:
        cfg.write_text(toml.replace("[daemon]\n", f'[daemon]\nstate_dir = "{tmp_path}/st"\n'))
    done = check("--config", str(cfg), "--state-dir", str(tmp_path / "st"))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    first = done.stderr.splitlines()[0]
    assert first.startswith("mlxceld: error: ") and names in done.stderr, done.stderr
    assert not (tmp_path / "st").exists()


def test_a_bad_flag_is_named(tmp_path: Path) -> None:
    done = check("--log-format", "xml", "--state-dir", str(tmp_path / "st"),
                 env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert done.returncode == 2
    assert "log format 'xml'" in done.stderr and "--log-format" in done.stderr
    done = check("--config", str(tmp_path / "absent.toml"))
    assert done.returncode == 2 and str(tmp_path / "absent.toml") in done.stderr


def test_a_secret_others_may_read_is_warned_of(tmp_path: Path) -> None:
    secret = write(tmp_path / "secret", "s" * 32)
    secret.chmod(0o644)
    cfg = write(tmp_path / "c.toml", f'[daemon]\nstate_dir = "st"\ncluster_secret_file = '
                f'"{secret}"\n')
    done = check("--config", str(cfg))
    assert done.returncode == 0, done.stderr
    assert "readable by group or others" in done.stderr and "chmod 600" in done.stderr


def test_a_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "st", "not a dir")
    done = check("--state-dir", str(tmp_path / "st"), env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert done.returncode == 2 and "is not a directory" in done.stderr
