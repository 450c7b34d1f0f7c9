"""A real daemon on a damaged state database: refused with the message and the way out
(exit 2, no traceback), never taken for a new node; ``--reset-state`` moves it aside."""

from __future__ import annotations

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons
from helpers.damage import scribble_pages


def refused(d: DaemonProc, *flags: str) -> str:
    """Start ``d``, which must exit 2; what it said on stderr."""
    seen = len(d.stderr())
    d.start(*flags, wait=False)
    assert d.proc is not None
    assert d.proc.wait(timeout=60) == 2, d.stderr()[seen:]
    said = d.stderr()[seen:]
    assert "Traceback" not in said, said
    assert f"mlxceld: error: state database {d.state_dir / 'state.db'} is damaged" in said
    assert "hint: restore it from a backup, or start mlxceld once with --reset-state" in said
    return said


def test_a_damaged_database_is_refused_and_reset_state_moves_it_aside(
        daemons: Daemons) -> None:
    d = daemons.make(FAST_POLICY).start()
    node = d.status()["daemon"]["node_id"]
    assert d.terminate() == 0
    db = d.state_dir / "state.db"

    scribble_pages(db)  # random bytes over two data pages
    damaged = db.read_bytes()
    refused(d)
    assert db.read_bytes() == damaged  # refused, not touched

    d.start("--reset-state")
    new_node = d.status()["daemon"]["node_id"]
    assert new_node != node
    [aside] = [p for p in d.state_dir.iterdir() if p.name.startswith("state.db.damaged-")
               and not p.name.endswith(("-wal", "-shm"))]
    assert aside.read_bytes() == damaged
    [reset] = [e for e in d.events() if e["kind"] == "state.reset"]
    assert str(aside) in reset["message"] and new_node in reset["message"]
    assert f"moved aside to {aside}" in d.stderr()  # and loudly in the log
    assert d.terminate() == 0

    db.write_bytes(b"")  # a zero-length file is damaged, not a new node
    assert "the file is empty: zero bytes" in refused(d)
    assert db.stat().st_size == 0


def test_reset_state_keeps_a_sound_database(daemons: Daemons) -> None:
    d = daemons.make(FAST_POLICY).start()
    node = d.status()["daemon"]["node_id"]
    assert d.terminate() == 0
    d.start("--reset-state")
    assert d.status()["daemon"]["node_id"] == node
    assert "is sound; it is kept" in d.stderr()
    assert not [p for p in d.state_dir.iterdir() if ".damaged-" in p.name]
