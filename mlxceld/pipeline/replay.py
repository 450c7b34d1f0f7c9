"""A sequence whose stage is lost, held and replayed on a working plan: a heal loses nothing.

When a stage host of a healed plan goes silent or its stage dies (``StageLost``,
``links.py``), the coordinator heals around it: the detector's ``peer_dead_after_s``,
the grace ``heal_after_s``, then a plan, a push and the new stages' load; then the
router's ``PipelineSwitch`` serves the new plan's engine (``cluster/healer.py``). A
request running on the lost stage would fail meanwhile; instead the router holds it
(``replayed``): it waits on the switch (``PipelineSwitch.working``) for an engine that
works, a new plan's or the same one whose stages are all attached again (a stage worker
restarted on its host), and replays the sequence there: the prompt plus the tokens
already sent to the client prefilled as one prompt, then decoding on. The client reads
one stream, no token repeated or lost; greedy output is an unbroken run's. A request
that arrives while the engine has a stage gone is held the same way (nothing sent yet:
it is simply started on the working engine).

A stage that is stopping refuses a new sequence (``StageDraining``): held the same way,
for the engine that works next. A drain's or a heal's re-plan of a mesh stops a tensor
group's workers before the new plan's stages load (``stagehost.py``: no make before break
for a group), so from that stop until the router's switch the old engine has a stage
draining, then gone: the requests of that break are held and started on the new plan's
engine (on the split fixture on 2 shared CPUs the break took about 5 s,
tests/integration/test_mesh_drain.py prints it). A stage draining for a restart is
retried at most every ``engine.DRAINING_RETRY_S`` (``working``: its readiness names it
draining that long after its last refusal).

A sequence still running on an engine the switch replaced (a live move to a new plan)
when that engine fails it (closed at ``switch.RETIRE_S``, or a stage the new plan left
out stopped) goes on on the current engine at once, with no hold, under the same rule of
what can be replayed: a long answer outlasts any number of moves.

The bound: the router's ``replay_hold_s`` (``RouterOptions``), which the coordinator's
daemon sets to its heal's own time, ``hold_for``: ``peer_dead_after_s + heal_after_s +
HEAL_WORK_S`` (130 s with the defaults); 0 where nothing heals the plan (self-healing
off, a cluster TOML's fixed plan, replica groups), where a lost stage fails its
requests at once as before. Past the bound (counted from the loss; a replay that made
progress and lost a stage again starts a new one) the request ends with the error the
stage's loss gave: a 503 naming the stage before the first token, an SSE error event
after.

What a replayed sequence keeps of its sampling is ``engine/continuation.py``'s rule: what
depends only on the text so far is exact (greedy, ``logit_bias``, the repetition penalty,
...); a sequence with presence or frequency penalties, a constraint or a seeded sampler
that has sent tokens is not replayed and fails as before (``replayable``); before its
first token any sequence is replayed, since nothing is lost yet.

Counted for ``/metrics`` in the switch's ``Continuity`` (where there is a hold): held
now, held, replayed, lost (``mlxceld_sequences_*``, ``api/edge/metrics.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Final, Protocol

from mlxceld.engine.base import EngineUnavailable, GenerationRequest, TokenOutput
from mlxceld.engine.continuation import Continuity, remainder, replayable
from mlxceld.pipeline.engine import PipelineEngine
from mlxceld.pipeline.links import StageDraining, StageLost

log = logging.getLogger(__name__)

# A heal's work after its grace: the inventories polled (10 s at most), the plan, the push
# (the new stages load while the old plan serves) and the router's switch. On the split
# fixture on 2 shared CPUs it took 5-11 s (tests/integration/test_heal_under_load.py and
# test_self_healing.py print it); a real model's stages load for tens of seconds more. A
# heal that takes longer (a large model from a slow disk) ends its held requests at the
# bound with the stage's error, as before.
HEAL_WORK_S: Final = 60.0
# A stage link in one of these states is gone, not refused: a heal or a restart may bring
# a working engine (``connectivity.py``). A stage that failed on its host, refused the
# handshake or serves another model is not waited for.
GONE: Final = frozenset({"connecting", "disconnected", "unreachable", "silent"})


def hold_for(peer_dead_after_s: float, heal_after_s: float) -> float:
    """How long a router holds a sequence whose stage is lost: the heal's own bound (0:
    self-healing off, nothing to wait for)."""
    return peer_dead_after_s + heal_after_s + HEAL_WORK_S if heal_after_s > 0 else 0.0


class Engines(Protocol):
    """What ``replayed`` needs of the switch."""

    continuity: Continuity  # what ``replayed`` counts

    @property
    def current(self) -> PipelineEngine: ...

    async def working(self, failed: PipelineEngine, until: float) -> PipelineEngine | None: ...


def lost(exc: EngineUnavailable, engine: PipelineEngine) -> bool:
    """Whether ``exc`` says a stage of ``engine`` is gone or stopping (not refusing)."""
    if isinstance(exc, StageLost | StageDraining):
        return True
    down = (engine.readiness() or {}).get("stages", [])
    return any(stage["state"] in GONE for stage in down)


async def replayed(engines: Engines, request: GenerationRequest, hold_s: float
                   ) -> AsyncGenerator[TokenOutput, None]:
    """``request``'s tokens, held past a lost stage for ``hold_s`` and replayed on the
    engine that works then (the module's doc)."""
    sent: list[int] = []
    # counted where there is a hold (none: the plain failure, a pool's to continue)
    counts = engines.continuity if hold_s > 0 else Continuity()
    engine = engines.current
    until: float | None = None  # while held: when the hold ends
    progress = 0  # len(sent) when the hold began
    while True:
        try:
            async with contextlib.aclosing(engine.generate(remainder(request, sent))) as run:
                async for out in run:
                    sent.append(out.token)
                    yield out
            return
        except EngineUnavailable as exc:
            if engine is not engines.current and replayable(request.params, len(sent)):
                # The plan moved on while it ran here (this engine retired at
                # ``switch.RETIRE_S``, or a stage the new plan left out stopped): it goes
                # on on the current plan's engine at once, whatever the hold.
                log.info("request %s: %s; its plan was replaced: continued on the current "
                         "plan's engine after %d token(s)", request.request_id, exc,
                         len(sent))
                engines.continuity.replayed_total += 1
                engine, until = engines.current, None
                continue
            now = time.monotonic()
            holding = until is not None and len(sent) == progress
            if not holding:
                if not lost(exc, engine):
                    raise
                if not replayable(request.params, len(sent)):
                    counts.lost_total += 1
                    raise
                until, progress = now + hold_s, len(sent)
                counts.held_total += 1
                log.info("request %s: %s; held up to %g s for a working plan, %d token(s) "
                         "sent", request.request_id, exc, hold_s, len(sent))
            assert until is not None
            counts.held += 1
            try:
                working = await engines.working(engine, until)
            finally:
                counts.held -= 1
            if working is None:
                counts.lost_total += 1
                log.warning("request %s: no working plan within %g s: it fails",
                            request.request_id, hold_s)
                raise
            counts.replayed_total += 1
            log.info("request %s: replayed on %s after %d token(s)", request.request_id,
                     "the new plan's engine" if working is not engine else "its stages back",
                     len(sent))
            engine = working
