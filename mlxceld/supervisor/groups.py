"""Worker groups: workers that live and die together (a tensor-parallel group's ranks).

A ``WorkerSpec`` with ``group`` set is a member. Members are processes of one
computation (each rank of an ``mlx.distributed`` ring holds a slice of every
layer): one alone is useless, and one that is left while a peer comes back cannot
meet it again. So the supervisor treats them as one worker, by one rule over each
member's transitions (``group_rule``; ``Supervisor.transitioned`` carries it out):

- a member that leaves RUNNING or STARTING other than by a requested stop (it
  exited or was killed, its start timed out, it failed its health probes, the
  watchdog stopped it) restarts every other member that is RUNNING or STARTING,
  at once (stop, then start, as ``Supervisor.restart`` does), each with the reason
  ``group tp: tp-1 exited (killed by SIGKILL); its group restarts together``; the
  member itself comes back by its own rules (BACKOFF, its retry);
- a member that stops for good on its own (it exited cleanly: an outside SIGTERM;
  or went FAILED: a refused option, or too many exits) stops the others: the
  group stays down as one worker would (``mlxctl restart`` of any member starts
  them all again);
- ``Supervisor.restart`` of a member restarts the whole group (each stopped as asked:
  SIGTERM, its stop timeout);
- a reconcile that adds members to a group or removes some (a reload's new
  ``tp_size``) restarts the members it keeps, which would otherwise wait on a ring of
  the old size (other changes of a member's spec take effect at its next start, as
  for any worker; the group's next restart starts them all on the new specs).

The rule's stops are short (SIGTERM, then SIGKILL after ``GROUP_STOP_S``, not the stop
timeout): each rank's work waits on every other rank's collectives, so once one member
is gone or hung the others can finish nothing, but the router (rank 0) gets the moment
it needs to answer its requests in flight with the group's error
(``engine/tensor.py``) rather than have their connections cut; a member the health
probes or the watchdog stopped is hung and is killed at once (it would sit out its
stop timeout).

The backoff and flap rules stay per worker (``states.py``). This module is pure:
the decision from a transition, no IO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from mlxceld.types import WorkerState

UP = frozenset({WorkerState.RUNNING, WorkerState.STARTING})
GROUP_STOP_S: Final = 2.0  # a member stopped by the rule: SIGKILL this long after SIGTERM


@dataclass(frozen=True)
class GroupAction:
    """What a member's transition asks of the rest of its group."""

    kind: Literal["restart", "stop"]
    reason: str  # the others' state reason, the event's and the log line's


def group_rule(group: str, name: str, old: WorkerState, new: WorkerState, reason: str, *,
               exit_summary: str | None, failing: str) -> GroupAction | None:
    """What member ``name`` of ``group`` going ``old`` -> ``new`` (for ``reason``) asks of
    the others; None when nothing. ``exit_summary``: its last exit's summary
    (``ExitCause``), when it has exited; ``failing``: why its coming exit is a failure
    (``Lifecycle.failing``)."""
    if old not in UP:
        return None  # a stop we asked for, or a member already down: nothing new
    if new is WorkerState.STOPPING:
        if not failing:
            return None  # a requested stop
        return GroupAction("restart", f"group {group}: {name} is stopped: {failing}; "
                           "its group restarts together")
    exited = f"{name} exited ({exit_summary or 'unknown'})"
    if new is WorkerState.BACKOFF:
        return GroupAction("restart", f"group {group}: {exited}; its group restarts together")
    if new is WorkerState.FAILED:
        return GroupAction("stop", f"group {group}: {name} failed: {reason}; its group is "
                           f"stopped with it: mlxctl restart {name} starts them all")
    if new is WorkerState.EXITED:
        return GroupAction("stop", f"group {group}: {exited}; its group is stopped with it: "
                           f"mlxctl restart {name} starts them all")
    return None
