"""The ``plans`` and ``assignments`` tables: the two-phase assignment's durable memory.

``plans`` is the coordinator's side: one row per plan epoch with the cluster
TOML it pushes, its peers, the ``--mesh`` it was planned with, and its decision
(NULL while undecided, which a restarted coordinator reads as aborted;
``deactivated`` once `mlxctl cluster deactivate` ended it, which a restarted
coordinator does not resume).
``assignments`` is a peer's side: one row per epoch it was offered, with its
state (preparing, accepted, refused, committed, active, aborted, deactivated),
the coordinator identity that offered it, and the cluster TOML it runs once
active. Each write is one committed transaction
(``cluster.assignment.rounds`` requires a decision or a vote to be durable before it is sent).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import sqlite_utils
from sqlite_utils.db import NotFoundError

# Schema v5's values; v6 added "deactivated" to both (`mlxctl cluster deactivate`).
_V5_DECISIONS = ("commit", "activate", "active", "abort")
_V5_STATES = ("preparing", "accepted", "refused", "committed", "active", "aborted")
PLAN_DECISIONS = (*_V5_DECISIONS, "deactivated")
PEER_STATES = (*_V5_STATES, "deactivated")
RESUMABLE = ("commit", "activate", "active")  # a plan decided so is resumed at start


@dataclass(frozen=True)
class PlanRow:
    epoch: int
    cluster: str
    model_identity: str
    peers: tuple[str, ...]
    toml: str
    decision: str | None
    summary: str
    # The --mesh it was planned with (a heal's or a drain's re-plan: its plan's); None: not
    # known (a plan adopted by a standby, or recorded before v10)
    mesh: str | None = None


@dataclass(frozen=True)
class AssignmentRow:
    epoch: int
    coordinator: str
    stage: int
    state: str
    reason: str
    toml: str


def _one_of(values: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"'{v}'" for v in values) + ")"


def _create(db: sqlite_utils.Database, decisions: tuple[str, ...],
            states: tuple[str, ...]) -> None:
    db.execute(
        "CREATE TABLE plans ("
        " epoch INTEGER PRIMARY KEY,"
        " cluster TEXT NOT NULL, model_identity TEXT NOT NULL, peers TEXT NOT NULL,"
        " toml TEXT NOT NULL,"
        f" decision TEXT CHECK (decision IS NULL OR decision IN {_one_of(decisions)}),"
        " summary TEXT NOT NULL DEFAULT '', created_at REAL NOT NULL, updated_at REAL NOT NULL)")
    db.execute(
        "CREATE TABLE assignments ("
        " epoch INTEGER PRIMARY KEY,"
        " coordinator TEXT NOT NULL, stage INTEGER NOT NULL,"
        f" state TEXT NOT NULL CHECK (state IN {_one_of(states)}),"
        " reason TEXT NOT NULL DEFAULT '', toml TEXT NOT NULL, updated_at REAL NOT NULL)")


def create_tables(db: sqlite_utils.Database) -> None:
    """Migration v5 (see db.py)."""
    _create(db, _V5_DECISIONS, _V5_STATES)


def allow_deactivated(db: sqlite_utils.Database) -> None:
    """Migration v6: both tables again with "deactivated" allowed, rows kept (SQLite cannot
    change a CHECK in place)."""
    for table in ("plans", "assignments"):
        db.execute(f"ALTER TABLE {table} RENAME TO {table}_v5")
    _create(db, PLAN_DECISIONS, PEER_STATES)
    for table in ("plans", "assignments"):
        db.execute(f"INSERT INTO {table} SELECT * FROM {table}_v5")
        db.execute(f"DROP TABLE {table}_v5")


def add_mesh(db: sqlite_utils.Database) -> None:
    """Migration v10: the --mesh a plan was planned with (NULL for the plans before)."""
    db.execute("ALTER TABLE plans ADD COLUMN mesh TEXT")


def superseded(epoch: int, why: str) -> str:
    """The summary of a plan deactivated because plan ``epoch`` replaced it (a heal, a
    drain's re-plan): ``Plans.superseded_by`` finds it again."""
    return f"superseded by plan {epoch}: {why}"


class Plans:
    """The coordinator's plans by epoch."""

    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db
        self._table = db.table("plans")

    def next_epoch(self, now: float | None = None) -> int:
        """Above every earlier epoch, and at least the time in milliseconds: a coordinator
        whose state dir was wiped still outnumbers the plans its peers remember."""
        row = self._db.execute("SELECT max(epoch) FROM plans").fetchone()
        clock = int((time.time() if now is None else now) * 1000)
        return max(int(row[0] or 0) + 1, clock)

    def create(self, epoch: int, cluster: str, model_identity: str, peers: tuple[str, ...],
               toml: str, mesh: str | None = None) -> None:
        now = time.time()
        self._table.insert({"epoch": epoch, "cluster": cluster,
                            "model_identity": model_identity, "peers": json.dumps(peers),
                            "toml": toml, "decision": None, "summary": "",
                            "created_at": now, "updated_at": now}
                           | ({"mesh": mesh} if mesh is not None else {}))

    def decide(self, epoch: int, decision: str, summary: str = "") -> None:
        if decision not in PLAN_DECISIONS:
            raise ValueError(f"unknown plan decision {decision!r}")
        self._table.update(epoch, {"decision": decision, "summary": summary,
                                   "updated_at": time.time()})

    def get(self, epoch: int) -> PlanRow | None:
        try:
            r = self._table.get(epoch)
        except NotFoundError:
            return None
        return PlanRow(r["epoch"], r["cluster"], r["model_identity"],
                       tuple(json.loads(r["peers"])), r["toml"], r["decision"], r["summary"],
                       r.get("mesh"))

    def latest(self) -> PlanRow | None:
        row = self._db.execute("SELECT max(epoch) FROM plans").fetchone()
        return None if row[0] is None else self.get(int(row[0]))

    def standing(self) -> PlanRow | None:
        """The newest plan that took over: decided commit, activate or active, or
        deactivated since. Plans after it that were aborted or never decided (a heal's push
        that failed, an activate refused by a peer) never replaced it, so they are passed
        over."""
        row = self._db.execute(
            "SELECT epoch FROM plans WHERE decision IN (?, ?, ?, ?) ORDER BY epoch DESC "
            "LIMIT 1", (*RESUMABLE, "deactivated")).fetchone()
        return None if row is None else self.get(int(row[0]))

    def resumable(self) -> PlanRow | None:
        """The plan to resume at start: the standing plan (``standing``) unless it was
        deactivated (by the operator, or superseded by a heal): None then."""
        plan = self.standing()
        return plan if plan is not None and plan.decision in RESUMABLE else None

    def superseded_by(self, epoch: int) -> list[PlanRow]:
        """The plans deactivated as plan ``epoch`` replaced them (``superseded``)."""
        rows = self._db.execute(
            "SELECT epoch FROM plans WHERE decision = 'deactivated' AND summary LIKE ?",
            [superseded(epoch, "%")]).fetchall()
        return [p for (e,) in rows if (p := self.get(int(e))) is not None]


class Assignments:
    """A peer's votes and states by epoch."""

    def __init__(self, db: sqlite_utils.Database) -> None:
        self._db = db
        self._table = db.table("assignments")

    def record(self, epoch: int, coordinator: str, stage: int, state: str, toml: str,
               reason: str = "") -> None:
        if state not in PEER_STATES:
            raise ValueError(f"unknown assignment state {state!r}")
        self._table.upsert({"epoch": epoch, "coordinator": coordinator, "stage": stage,
                            "state": state, "reason": reason, "toml": toml,
                            "updated_at": time.time()}, pk="epoch")

    def newest_epoch(self) -> int:
        row = self._db.execute("SELECT max(epoch) FROM assignments").fetchone()
        return int(row[0] or 0)

    def latest(self) -> AssignmentRow | None:
        epoch = self.newest_epoch()
        return self.get(epoch) if epoch else None

    def holding(self, states: Sequence[str]) -> AssignmentRow | None:
        """The newest assignment in one of ``states`` (those that hold a stage), if any."""
        marks = ", ".join("?" for _ in states)
        row = self._db.execute(f"SELECT max(epoch) FROM assignments WHERE state IN ({marks})",
                               list(states)).fetchone()
        return self.get(int(row[0])) if row and row[0] else None

    def get(self, epoch: int) -> AssignmentRow | None:
        try:
            r = self._table.get(epoch)
        except NotFoundError:
            return None
        return AssignmentRow(r["epoch"], r["coordinator"], r["stage"], r["state"],
                             r["reason"], r["toml"])
