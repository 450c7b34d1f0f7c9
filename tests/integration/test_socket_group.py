"""The operator group on a real daemon: file modes and groups, who gets in, and what mlxctl
tells a user who does not (run as uid 65534 against a daemon run as root).

The interpreter lives under /root, which nobody cannot read: each mlxctl run as nobody is
one Python process that runs the command once as root (loading every module it needs),
then drops to nobody (groups, gid, uid, in that order) and runs it again.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxceld.paths import SYSTEM_SOCKET

from helpers.daemons import DaemonProc, Daemons

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")


def nobody_groups() -> list[int]:
    return os.getgrouplist(pwd.getpwuid(NOBODY).pw_name, NOBODY)


def foreign_group() -> str:
    """A group nobody is not in."""
    for g in grp.getgrall():
        if g.gr_gid not in (0, NOBODY) and g.gr_gid not in nobody_groups():
            return g.gr_name
    pytest.skip("no group here that uid 65534 is not in")


def as_nobody(socket: Path | None, *argv: str, groups: list[int] | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``mlxctl [--socket S] ARGV`` through mlxctl.main as uid 65534 (with ``groups``: its
    supplementary groups, default its login's); ``env`` replaces the environment."""
    args = (["--socket", str(socket)] if socket else []) + list(argv)
    code = textwrap.dedent(f"""
        import contextlib, io, os, sys
        from mlxctl.main import main
        sys.argv = ["mlxctl", *{args!r}]
        with contextlib.redirect_stdout(io.StringIO()), \\
                contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
            main()
        os.setgroups({groups if groups is not None else nobody_groups()!r})
        os.setgid({NOBODY}); os.setuid({NOBODY})
        main()
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={"NO_COLOR": "1", **(env or {})})


def start(d: DaemonProc, group: str) -> DaemonProc:
    os.chmod(d.root, 0o711)  # nobody may pass the test's own directory, as /run is
    return d.start("--socket-group", group)


@pytest.fixture(scope="module")
def grouped() -> Iterator[tuple[DaemonProc, str]]:
    """One daemon whose socket belongs to a group nobody is not in, and that group, for
    the two tests below (the one that opens the modes wide puts them back)."""
    group = foreign_group()
    owner = Daemons()
    try:
        yield start(owner.make(), group), group
    finally:
        owner.end()


@root_only
def test_the_socket_and_its_directory_belong_to_the_group(
        grouped: tuple[DaemonProc, str]) -> None:
    d, group = grouped
    gid = grp.getgrnam(group).gr_gid
    for path, mode in ((d.socket, 0o660), (d.socket.parent, 0o750)):
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, 0, gid), path
    assert d.status()["daemon"]["socket_group"] == group


@root_only
def test_a_user_outside_the_group_is_told_which_group_to_join(
        grouped: tuple[DaemonProc, str]) -> None:
    d, group = grouped
    out = as_nobody(d.socket, "status")
    assert out.returncode == 4, out.stderr
    assert f"permission denied on the control socket {d.socket}" in out.stderr
    assert (f"ask an administrator to add you to group '{group}' (e.g. sudo usermod -aG "
            f"{group} $USER), then log in again") in out.stderr
    as_json = json.loads(as_nobody(d.socket, "workers", "--json").stdout)
    assert as_json["error"]["code"] == "permission_denied"
    assert f"group '{group}'" in as_json["error"]["hint"]
    # With the modes opened wide, the daemon's own check refuses, and says the same.
    before = stat.S_IMODE(d.socket.parent.stat().st_mode), stat.S_IMODE(d.socket.stat().st_mode)
    os.chmod(d.socket.parent, 0o755)
    os.chmod(d.socket, 0o666)
    try:
        refused = as_nobody(d.socket, "status")
    finally:  # the shared daemon's modes as they were
        os.chmod(d.socket.parent, before[0])
        os.chmod(d.socket, before[1])
    assert refused.returncode == 4, refused.stderr
    assert (f"uid {NOBODY} is not allowed to use the control socket {d.socket} (only root, "
            f"uid 0 and members of group '{group}' are)") in refused.stderr
    assert f"add you to group '{group}'" in refused.stderr


@root_only
def test_without_a_group_the_hint_is_the_old_one(daemons: Daemons) -> None:
    d = daemons.make().start()
    os.chmod(d.root, 0o711)
    out = as_nobody(d.socket, "status")  # the 0700 directory of root's stops it
    assert out.returncode == 4, out.stderr
    assert "hint: run mlxctl as the user that runs mlxceld, or as root" in out.stderr
    assert "group" not in out.stderr


@root_only
def test_a_member_by_primary_group_gets_in(daemons: Daemons) -> None:
    d = start(daemons.make(), grp.getgrgid(NOBODY).gr_name)
    out = as_nobody(d.socket, "workers")
    assert out.returncode == 0, out.stderr
    assert "no workers configured" in out.stdout


@pytest.fixture
def operators() -> Iterator[str]:
    """A new group with uid 65534 as a supplementary member, removed afterwards."""
    if os.geteuid() != 0 or not (shutil.which("groupadd") and shutil.which("gpasswd")):
        pytest.skip("needs root, groupadd and gpasswd to make a group for the test")
    name = f"mxop{uuid.uuid4().hex[:8]}"
    subprocess.run(["groupadd", name], check=True, capture_output=True, timeout=30)
    try:
        subprocess.run(["gpasswd", "-a", pwd.getpwuid(NOBODY).pw_name, name], check=True,
                       capture_output=True, timeout=30)
        yield name
    finally:
        subprocess.run(["groupdel", name], check=True, capture_output=True, timeout=30)


def test_a_supplementary_member_gets_in(daemons: Daemons, operators: str) -> None:
    d = start(daemons.make(), operators)
    assert grp.getgrnam(operators).gr_gid in nobody_groups()
    out = as_nobody(d.socket, "status")  # a fresh login's groups: the new one among them
    assert out.returncode == 0, out.stderr
    # Listed in the group, but this session started before: log in again.
    stale = as_nobody(d.socket, "status", groups=[])
    assert stale.returncode == 4
    assert (f"you are in group '{operators}', but this login session is not yet: log in "
            f"again (or run `newgrp {operators}`)") in stale.stderr


@dataclass
class DaemonAt(DaemonProc):
    """A daemon whose socket is at ``at``."""

    at: Path = Path()

    @property
    def socket(self) -> Path:
        return self.at


def make_at(daemons: Daemons, at: Callable[[Path], Path]) -> DaemonAt:
    plain = daemons.make()
    d = DaemonAt(plain.root, plain.config, at=at(plain.root))
    daemons.started[-1] = d
    return d


def ctl_status(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``mlxctl status --json`` as root with neither --socket nor MLXCELD_SOCKET."""
    return subprocess.run([sys.executable, "-m", "mlxctl", "status", "--json"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "MLXCELD_SOCKET": ""})


@root_only
@pytest.mark.skipif(SYSTEM_SOCKET.parent.exists(),
                    reason=f"{SYSTEM_SOCKET.parent} exists here: mlxctl would look there first")
def test_mlxctl_finds_a_system_socket_it_may_not_look_at(daemons: Daemons) -> None:
    """Neither --socket nor MLXCELD_SOCKET: the lookup goes on past the per-user socket to
    Homebrew's; one it cannot even stat (not in the group) is still the one it reports."""
    group = foreign_group()
    brew = make_at(daemons,
                   lambda root: root / "brew" / "var" / "run" / "mlxceld" / "mlxceld.sock")
    for sub in ("brew", "brew/var", "brew/var/run"):
        (brew.root / sub).mkdir(mode=0o755)
    start(brew, group)
    env = {"HOMEBREW_PREFIX": str(brew.root / "brew"), "HOME": str(brew.root),
           "XDG_RUNTIME_DIR": str(brew.root / "xdg")}
    out = as_nobody(None, "status", env=env)
    assert out.returncode == 4, out.stderr
    assert f"permission denied on the control socket {brew.socket}" in out.stderr
    assert f"add you to group '{group}'" in out.stderr
    found = ctl_status(env)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["daemon"]["socket"] == str(brew.socket)
    # A per-user daemon, once there, wins.
    mine = make_at(daemons, lambda root: brew.root / "xdg" / "mlxceld" / "mlxceld.sock")
    mine.start()
    found = ctl_status(env)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["daemon"]["socket"] == str(mine.socket)
