"""The keyring of a real daemon: mlxctl secret end to end, and where a secret must never appear."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from mlxceld.errors import ControlError
from mlxceld.wire.secret import key_id, trim_secret_file

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons

ONE_ECHO = FAST_POLICY + """
[workers.alpha]
role = "echo"
options = { interval_s = 0.1 }
"""


def ctl_json(d: DaemonProc, *args: str) -> dict[str, object]:
    out = d.ctl(*args, "--json")
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    body: dict[str, object] = json.loads(out.stdout)
    return body


def keys(d: DaemonProc) -> dict[str, str]:
    """Through the typed client (in-process: each mlxctl run costs a Python start-up)."""
    items = d.api(lambda c: c.secrets())["keys"]
    return {k["key_id"]: k["state"] for k in items}


def state_bytes(d: DaemonProc) -> bytes:
    return b"".join(p.read_bytes() for p in d.state_dir.glob("state.db*"))


def all_argv() -> str:
    text = []
    for p in psutil.process_iter(["cmdline"]):
        text.append(" ".join(p.info["cmdline"] or []))
    return "\n".join(text)


def assert_nowhere(d: DaemonProc, secret: bytes) -> None:
    """Not in the daemon's log, its database, any worker log, nor any process's argv."""
    for form in (secret, secret.hex().encode()):
        assert form not in d.stderr().encode()
        assert form not in state_bytes(d)
        for log in (d.state_dir / "logs").glob("*"):
            assert form not in log.read_bytes(), log
        assert form.decode() not in all_argv()


def test_generate_install_list_use_remove(daemons: Daemons, tmp_path: Path) -> None:
    d = daemons.make().start()
    assert keys(d) == {}
    first, second = tmp_path / "first.key", tmp_path / "second.key"
    gen = ctl_json(d, "secret", "generate", str(first))
    assert gen["schema"] == "mlxctl.secret_generate/1" and "secret" not in gen
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    s1 = trim_secret_file(first.read_bytes())
    assert len(s1) == 64 and gen["key_id"] == key_id(s1).hex()
    again = d.ctl("secret", "generate", str(first))
    assert again.returncode == 1 and "--force" in again.stderr
    assert trim_secret_file(first.read_bytes()) == s1  # untouched
    second.write_bytes(b"second-secret-" + b"2" * 20 + b"\n")
    s2 = trim_secret_file(second.read_bytes())
    k1, k2 = key_id(s1).hex(), key_id(s2).hex()

    inst = ctl_json(d, "secret", "install", str(first), "--primary")
    assert inst["schema"] == "mlxctl.secret_install/1"
    listed = ctl_json(d, "secret", "list")
    assert listed["schema"] == "mlxctl.secrets/1"
    assert [(k["key_id"], k["state"]) for k in listed["keys"]] == [(k1, "primary")]  # type: ignore
    d.api(lambda c: c.install_secret(s2))
    assert keys(d) == {k1: "primary", k2: "installed"}

    refused = d.ctl("secret", "remove", k1, "--json")
    assert refused.returncode == 1
    err = json.loads(refused.stdout)["error"]
    assert err["code"] == "key_is_primary" and k1 in err["message"]
    assert f"mlxctl secret use {k2}" in err["hint"]
    with pytest.raises(ControlError, match="0000000000000000") as unknown:
        d.api(lambda c: c.use_secret("00" * 8))
    assert unknown.value.code == "unknown_key" and unknown.value.status == 404
    with pytest.raises(ControlError, match="'nothex' is not a key id"):
        d.api(lambda c: c.use_secret("nothex"))

    assert ctl_json(d, "secret", "use", k2)["schema"] == "mlxctl.secret_use/1"
    assert keys(d) == {k1: "installed", k2: "primary"}
    assert ctl_json(d, "secret", "remove", k1)["schema"] == "mlxctl.secret_remove/1"
    text = d.ctl("secret", "list")
    assert text.returncode == 0 and k2 in text.stdout and "primary" in text.stdout
    assert k1 not in text.stdout
    assert sorted(p.name for p in (d.state_dir / "keys").iterdir()) == [f"{k2}.key"]
    assert stat.S_IMODE((d.state_dir / "keys").stat().st_mode) == 0o700
    assert stat.S_IMODE((d.state_dir / "keys" / f"{k2}.key").stat().st_mode) == 0o600

    assert_nowhere(d, s1)
    assert_nowhere(d, s2)


def test_install_refuses_short_files_and_warns_on_wide_ones(daemons: Daemons,
                                                           tmp_path: Path) -> None:
    d = daemons.make().start()
    short = tmp_path / "short.key"
    short.write_bytes(b"too-short\n")
    out = d.ctl("secret", "install", str(short))
    assert out.returncode == 2 and "at least 16" in out.stderr
    wide = tmp_path / "wide.key"
    wide.write_bytes(b"w" * 32 + b"\n")
    wide.chmod(0o644)
    out = d.ctl("secret", "install", str(wide))
    assert out.returncode == 0 and "readable by group or others" in out.stderr
    assert keys(d) == {key_id(b"w" * 32).hex(): "primary"}  # the first key is the primary
    missing = d.ctl("secret", "install", str(tmp_path / "missing"), "--json")
    assert missing.returncode == 2 and json.loads(missing.stdout)["error"]["code"] == "bad_file"


def test_generate_to_stdout_warns_on_stderr(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "mlxctl", "secret", "generate"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and len(out.stdout.strip()) == 64
    assert "this is a cluster secret" in out.stderr and out.stdout.strip() not in out.stderr


def test_a_secret_from_the_environment_is_adopted_and_kept_from_workers(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "env-cluster-secret-0123456789abcdef"
    d = daemons.make(ONE_ECHO)
    monkeypatch.setenv("MLXCEL_CLUSTER_SECRET", secret)
    d.start()
    monkeypatch.delenv("MLXCEL_CLUSTER_SECRET")
    kid = key_id(secret.encode()).hex()
    [key] = d.api(lambda c: c.secrets())["keys"]
    assert (key["key_id"], key["state"], key["source"]) == (kid, "primary",
                                                            "MLXCEL_CLUSTER_SECRET")
    pid = d.wait_worker("alpha", state="running")["pid"]
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert b"MLXCEL_CLUSTER_SECRET" not in environ and secret.encode() not in environ
    assert_nowhere(d, secret.encode())
    # The daemon's own initial environment keeps it, as no process can erase it: it says so.
    assert secret.encode() in Path(f"/proc/{d.pid}/environ").read_bytes()
    assert (f"MLXCEL_CLUSTER_SECRET is set: its value stays readable to root and to this "
            f"user in this daemon's initial environment (/proc/{d.pid}/environ") in d.stderr()
    assert "--cluster-secret-file" in d.stderr() and secret not in d.stderr()
    # Persisted: a restart without the variable still has it as the primary.
    d.api(lambda c: c.stop())
    assert d.proc is not None and d.proc.wait(timeout=20) == 0
    d.start()
    assert keys(d) == {kid: "primary"}


def test_the_flag_wins_and_bad_sources_stop_the_daemon(daemons: Daemons, tmp_path: Path) -> None:
    d = daemons.make()
    flag = tmp_path / "flag.key"
    flag.write_bytes(b"f" * 20 + b"\r\n")
    flag.chmod(0o600)
    env = {**os.environ, "MLXCEL_CLUSTER_SECRET": "e" * 20}
    both = subprocess.run(
        [sys.executable, "-m", "mlxceld", "--config", str(d.config), "--state-dir",
         str(d.state_dir), "--socket", str(d.socket), "--cluster-secret-file", str(flag)],
        capture_output=True, text=True, timeout=30,
        env={**env, "MLXCEL_CLUSTER_SECRET_FILE": str(flag)})
    assert both.returncode == 2
    assert "MLXCEL_CLUSTER_SECRET_FILE and MLXCEL_CLUSTER_SECRET" in both.stderr
    assert "e" * 20 not in both.stderr
    short = tmp_path / "short.key"
    short.write_bytes(b"short\n")
    bad = subprocess.run(
        [sys.executable, "-m", "mlxceld", "--config", str(d.config), "--state-dir",
         str(d.state_dir), "--socket", str(d.socket), "--cluster-secret-file", str(short)],
        capture_output=True, text=True, timeout=30, env=env)
    assert bad.returncode == 2
    for name in ("--cluster-secret-file", "MLXCEL_CLUSTER_SECRET_FILE: not set",
                 "MLXCEL_CLUSTER_SECRET: set", "[cluster] secret_file", "the keyring in"):
        assert name in bad.stderr, name
    d.start("--cluster-secret-file", str(flag))
    assert keys(d) == {key_id(b"f" * 20).hex(): "primary"}
