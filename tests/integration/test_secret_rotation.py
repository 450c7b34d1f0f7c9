"""`mlxctl secret rotate` over real daemons on 127.0.0.1-3 with static peers (issue 16,
cluster-wide secret rotation): refused naming a member that is down, with nothing
changed; done once it is back (every member's primary the new key, the old one removed
everywhere), and a member restarted with its old secret file stays on the new key (the
file is stale: a warning and an event tell the operator to update it); and a rotator
killed with SIGKILL after a step (fail point ``rotator-after-using``) finishes the
rotation by itself when it starts again."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest

from mlxceld.wire.secret import key_id

from helpers.cluster import POLL_WAIT_S, agent, by_address, start
from helpers.daemons import DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.ports import free_port
from helpers.waiting import wait_for

ROTATE_S = 120.0  # the CLI's own deadline is longer; a healthy rotation takes seconds


def keys(d: DaemonProc) -> dict[str, str]:
    """``d``'s keyring: key id -> state."""
    return {k["key_id"]: k["state"] for k in d.api(lambda c: c.secrets())["keys"]}


def rotation(d: DaemonProc) -> dict[str, Any] | None:
    found: dict[str, Any] | None = d.api(lambda c: c.secrets())["rotation"]
    return found


@pytest.mark.slow
def test_refused_while_a_member_is_down_then_done_everywhere(daemons: Daemons) -> None:
    old = secrets.token_hex(16).encode()
    old_id = key_id(old).hex()
    b = start(daemons, "127.0.0.2", old, name="b")
    c_addr = f"127.0.0.3:{free_port('127.0.0.3')}"
    c = daemons.make(name="c")
    c.start("--cluster-secret-file", str(secret_file(c.root, old)), "--agent-addr", c_addr)
    a = start(daemons, "127.0.0.1", old, "--cluster-peers", f"{agent(b)},{c_addr}", name="a")
    assert c.terminate() == 0

    refused = a.ctl("secret", "rotate", timeout=ROTATE_S)
    assert refused.returncode == 1, (refused.stdout, refused.stderr)
    assert f"member {c_addr} is unreachable" in refused.stderr
    assert agent(b) not in refused.stderr  # only the member at fault is named
    assert "nothing changed" in refused.stderr
    assert keys(a) == keys(b) == {old_id: "primary"} and rotation(a) is None

    c.start("--agent-addr", c_addr)  # its keyring kept the old key
    new = secrets.token_hex(16).encode()
    new_id = key_id(new).hex()
    done = a.ctl("secret", "rotate", "--new-secret-file", str(secret_file(a.root, new)),
                 "--json", timeout=ROTATE_S)
    assert done.returncode == 0, (done.stdout, done.stderr, a.stderr()[-3000:])
    body = json.loads(done.stdout)["rotation"]
    assert body["step"] == "done" and body["old_key_id"] == old_id
    assert sorted(body["members"]) == sorted([agent(a), agent(b), c_addr])
    for d in (a, b, c):
        assert keys(d) == {new_id: "primary"}, d.root
    assert [e["kind"] for e in a.events() if e["kind"].startswith("rotation.")] == [
        "rotation.started", "rotation.verifying_install", "rotation.using",
        "rotation.verifying_use", "rotation.removing", "rotation.done"]
    for d in (a, b, c):  # the secret went to no log
        assert new.decode() not in d.stderr() and new.hex() not in d.stderr()

    # c restarted with its old --cluster-secret-file: the keyring the rotation updated
    # wins over a file naming the key it retired, and c is told to update the file.
    stale = c.root / "cluster.secret"
    assert c.terminate() == 0
    c.start("--cluster-secret-file", str(stale), "--agent-addr", c_addr)
    assert keys(c) == {new_id: "primary"}
    warned = [line for line in c.stderr().splitlines() if f"{old_id} from" in line]
    assert warned and str(stale) in warned[-1] and "update the file" in warned[-1], warned
    event = [e for e in c.events() if e["kind"] == "secret.stale_file"][-1]
    assert str(stale) in event["message"] and new_id in event["message"]
    wait_for(lambda: (r := by_address(a).get(c_addr, {})).get("key_id") == new_id
             and r.get("key_stale") is False, POLL_WAIT_S, "c current on a", every=0.2)


def test_a_rotator_killed_after_a_step_finishes_the_rotation_when_restarted(
        daemons: Daemons) -> None:
    old = secrets.token_hex(16).encode()
    old_id = key_id(old).hex()
    b = start(daemons, "127.0.0.2", old, name="b")
    a_addr = f"127.0.0.1:{free_port('127.0.0.1')}"
    a = daemons.make(name="a")
    a.start("--cluster-secret-file", str(secret_file(a.root, old)), "--agent-addr", a_addr,
            "--cluster-peers", agent(b), env={"MLXCELD_FAILPOINT": "rotator-after-using"})

    cut = a.ctl("secret", "rotate", timeout=ROTATE_S)  # a generated secret
    assert cut.returncode != 0
    assert a.proc is not None and a.proc.wait(timeout=30) == -9
    row = rotation_on_disk(a)
    assert row["step"] == "using"  # every member uses the new key; the old one is left
    new_id = row["new_kid"]
    assert keys(b) == {new_id: "primary", old_id: "installed"}

    a.start("--agent-addr", a_addr, "--cluster-peers", agent(b))  # the keyring holds both
    finished = wait_for(lambda: (r := rotation(a)) and r["step"] in ("done", "failed") and r,
                        ROTATE_S, "the rotation resumed and finished", every=0.2)
    assert finished["step"] == "done", finished
    for d in (a, b):
        assert keys(d) == {new_id: "primary"}
    kinds = [e["kind"] for e in a.events() if e["kind"].startswith("rotation.")]
    assert kinds[-4:] == ["rotation.resumed", "rotation.verifying_use", "rotation.removing",
                          "rotation.done"]
    secret = (a.state_dir / "keys" / f"{new_id}.key").read_bytes()
    assert (a.state_dir / "keys" / f"{new_id}.key").stat().st_mode & 0o777 == 0o600
    for d in (a, b):
        assert secret.decode() not in d.stderr()


def rotation_on_disk(d: DaemonProc) -> dict[str, Any]:
    """The latest ``rotations`` row of a daemon that is not running (read-only)."""
    import contextlib
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{d.state_dir / 'state.db'}?mode=ro",
                                            uri=True)) as conn:
        conn.row_factory = sqlite3.Row
        return dict(conn.execute("select * from rotations order by id desc limit 1").fetchone())


def test_a_member_failing_a_step_fails_the_rotation_and_a_rerun_finishes_it(
        daemons: Daemons) -> None:
    old = secrets.token_hex(16).encode()
    old_id = key_id(old).hex()
    b_addr = f"127.0.0.2:{free_port('127.0.0.2')}"
    b = daemons.make(name="b")
    b_file = secret_file(b.root, old)
    b.start("--cluster-secret-file", str(b_file), "--agent-addr", b_addr,
            env={"MLXCELD_FAILPOINT": "member-refuses-key-use"})
    a = start(daemons, "127.0.0.1", old, "--cluster-peers", b_addr, name="a",
              env={"MLXCELD_TEST_ROTATION_STEP_S": "2"})

    failed = a.ctl("secret", "rotate", timeout=ROTATE_S)
    assert failed.returncode == 1, (failed.stdout, failed.stderr)
    assert f"member {b_addr} failed using" in failed.stderr, failed.stderr
    assert "fail point member-refuses-key-use" in failed.stderr
    assert "run `mlxctl secret rotate` again (without --new-secret-file" in failed.stderr
    row = rotation(a)
    assert row is not None and row["step"] == "failed"
    new_id = row["new_key_id"]
    assert keys(b) == {old_id: "primary", new_id: "installed"}  # installed, not used

    assert b.terminate() == 0
    b.start("--agent-addr", b_addr)  # back, without the fault
    done = a.ctl("secret", "rotate", "--json", timeout=ROTATE_S)
    assert done.returncode == 0, (done.stdout, done.stderr, a.stderr()[-3000:])
    again = json.loads(done.stdout)["rotation"]
    assert (again["id"], again["new_key_id"], again["step"]) == (row["id"], new_id, "done")
    for d in (a, b):
        assert keys(d) == {new_id: "primary"}, d.root
    kinds = [e["kind"] for e in a.events() if e["kind"].startswith("rotation.")]
    assert kinds[-5:] == ["rotation.failed", "rotation.retried", "rotation.verifying_use",
                          "rotation.removing", "rotation.done"], kinds
