"""A cluster-wide secret rotation as a sans-IO round (`mlxctl secret rotate`).

The rotator (the daemon that was asked) takes every member through five steps, one
after the other; a step is over once every member has done it:

============== ============================================ ==================
step           each member is asked to                      done when
============== ============================================ ==================
installing     install the new secret (not the primary)     it answers
verifying_inst report its keys                              the new key id is
                                                            among them
using          make the new key its primary                 it answers
verifying_use  report its keys                              its primary is the
                                                            new key id
removing       remove the old key                           it answers, the old
                                                            key id gone
done           (terminal)
failed         (terminal: ``failures`` names each member
               that failed the step and why)
============== ============================================ ==================

Every step is idempotent on a member (installing an installed secret, using the
primary, removing a key that is gone all answer as done), so a rotator restarted
after a crash resumes at the step it had written (``RotationRound.resume``) and
asks every member again; and a failed round is taken up again at the step it failed
(``failed_step``: `mlxctl secret rotate` run again without a new secret). The shell
(``cluster/rotation.py``) writes the round's ``record()`` at each transition, before
it asks anyone anything of the next step.

This module does no IO and reads no clock: the shell reports each member's outcome
(``member_done``, ``member_failed``) and acts on ``pending()``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final


class Step(enum.StrEnum):
    INSTALLING = "installing"
    VERIFYING_INSTALL = "verifying_install"
    USING = "using"
    VERIFYING_USE = "verifying_use"
    REMOVING = "removing"
    DONE = "done"
    FAILED = "failed"


#: The one transition table: each step and the one that follows once every member did it.
#: Any step but a terminal one goes to FAILED instead when a member failed it.
NEXT: Final[dict[Step, Step]] = {
    Step.INSTALLING: Step.VERIFYING_INSTALL,
    Step.VERIFYING_INSTALL: Step.USING,
    Step.USING: Step.VERIFYING_USE,
    Step.VERIFYING_USE: Step.REMOVING,
    Step.REMOVING: Step.DONE,
}
TERMINAL: Final = frozenset({Step.DONE, Step.FAILED})
STEPS: Final = tuple(Step)


def failed_step(failures: dict[str, str]) -> Step | None:
    """The step a failed round failed at, as its ``failures`` say ("<step>: <why>" each);
    None when they name none (a round written by another version, say)."""
    steps = {why.split(":", 1)[0] for why in failures.values()}
    if len(steps) != 1:
        return None
    name = steps.pop()
    return Step(name) if name in NEXT else None


class RoundError(Exception):
    """The shell broke the round's rules (our bug): a report out of step."""


@dataclass
class RotationRound:
    """One rotation: from key ``old_kid`` to ``new_kid`` (16 hex digits each) over
    ``members`` (agent addresses, this daemon's own among them)."""

    rotation_id: int
    old_kid: str
    new_kid: str
    members: tuple[str, ...]
    step: Step = Step.INSTALLING
    done: set[str] = field(default_factory=set)  # members that did ``step``
    failures: dict[str, str] = field(default_factory=dict)  # member -> why (the failed step)

    @classmethod
    def resume(cls, rotation_id: int, old_kid: str, new_kid: str, members: tuple[str, ...],
               step: Step, failures: dict[str, str]) -> RotationRound:
        """The round as written: a step in progress is asked of every member again."""
        return cls(rotation_id, old_kid, new_kid, members, step, set(), dict(failures))

    @property
    def finished(self) -> bool:
        return self.step in TERMINAL

    def pending(self) -> list[str]:
        """The members still to ask in this step (none once it is finished)."""
        if self.finished:
            return []
        return [m for m in self.members if m not in self.done and m not in self.failures]

    def member_done(self, member: str, step: Step) -> Step | None:
        """``member`` did ``step``; the new step if that ended it (to be written)."""
        self._check(member, step)
        self.done.add(member)
        return self._maybe_advance()

    def member_failed(self, member: str, step: Step, why: str) -> Step | None:
        """``member`` failed ``step`` (its tries used up); the new step if that ended it."""
        self._check(member, step)
        self.failures[member] = f"{step.value}: {why}"
        return self._maybe_advance()

    def _check(self, member: str, step: Step) -> None:
        if self.finished or step != self.step:
            raise RoundError(f"a report for step {step.value} in step {self.step.value}")
        if member not in self.members:
            raise RoundError(f"{member} is not a member of rotation {self.rotation_id}")
        if member in self.done or member in self.failures:
            raise RoundError(f"{member} was reported twice in step {step.value}")

    def _maybe_advance(self) -> Step | None:
        if self.pending():
            return None
        self.step = Step.FAILED if self.failures else NEXT[self.step]
        self.done = set()
        return self.step
