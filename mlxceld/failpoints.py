"""Fail points: crashes and faults at named steps, for tests only.

``MLXCELD_FAILPOINT=name[,name...]`` in a daemon's environment is read once,
when this module is first imported (the daemon imports it as it starts); an
unknown name makes the daemon refuse to start (``ConfigError``, exit 2). With
the variable unset or empty nothing here does anything. Never set it on a
daemon that serves: a crash point kills the daemon with SIGKILL, as a power
cut would (no shutdown, no cleanup; its workers live on).

Crash points (the process kills itself right there). A peer's are named after the
record they leave behind (its row in the ``assignments`` table), the coordinator's
after the decision it has written (its row in ``plans``) and not yet told anyone:

``peer-after-preparing``
    a peer, its offer recorded ``preparing`` and its stage loaded in standby,
    before it records its vote (the coordinator, still offering, loses it)
``peer-after-accepted``
    a peer, once its Accepted vote is persisted and sent, before Commit arrives
``peer-after-committed``
    a peer recorded ``committed``, as the coordinator's Activate arrives, before
    it records it (the coordinator has decided activate and loses it)
``peer-after-active``
    a peer, ``active`` recorded and its stage switched to serving, before it
    answers Active (the coordinator, still activating, loses it)
``coordinator-before-decision``
    the coordinator, every peer having accepted, before it writes ``commit``
``coordinator-after-commit-decision``
    the coordinator, as it is about to send ``commit`` to its first peer (the
    decision must be written by then: ``push.py``)
``coordinator-after-activate-decision``
    the same for ``activate``
``coordinator-after-abort-decision``
    the same for ``abort``
``coordinator-after-active-decision``
    the coordinator, ``active`` written, before it starts its router

Crash points of a secret rotation's rotator (``cluster/rotation.py``), each once every
member has done the step it names and before the next step is written (a restart
resumes at that step and asks every member again):

``rotator-after-installing``
    every member holds the new secret; none uses it
``rotator-after-using``
    every member's primary is the new key; the old one is still installed everywhere
``rotator-after-removing``
    the old key is gone everywhere; the rotation is not yet written ``done``

Fault points (the coordinator's offers lie, so that a peer's check refuses):

``offer-assignment-version``
    offers name assignment protocol version 0
``offer-package-version``
    offers name package version ``<this version>+failpoint``
``offer-layer-count``
    the offered cluster TOML splits one layer more than the checkpoint has
``offer-coordinator``
    offers name another coordinator than the one the handshake binds

Fault point of a secret rotation's member (``cluster/rotation.py``):

``member-refuses-key-use``
    a member asked ``key_use`` by a rotator answers an error (as one whose keyring
    cannot be changed would), so that the rotation fails at ``using`` naming it

Fault point of the supervisor:

``worker-kill-lost``
    a worker's SIGKILL at the end of its stop timeout is not sent, as if the
    process could not die (stuck in uninterruptible I/O): only the daemon's
    shutdown backstop (``daemon.SHUTDOWN_SLACK_S``) then ends it

``MLXCELD_TEST_PEER_WAIT_S`` (seconds, > 0; test only too) replaces
``peer_round.PEER_PHASE_S``, a peer's 60 s wait between two phases, so that a
test of "the coordinator died before deciding" ends in seconds.

``MLXCELD_TEST_ACTIVATE_FOR_S`` (seconds, > 0; test only too) replaces
``coordinator_round.ACTIVATE_FOR_S``, how long a coordinator's push keeps
re-sending ``activate`` to a peer that is not active (600 s), so that a test of
a push that ends stalled (``Phase.STALLED``) and is picked up by the peer's
``query`` ends in seconds. Either one set to anything but a positive number of
seconds makes the daemon refuse to start (``ConfigError`` naming it, exit 2).

``MLXCELD_TEST_FOLLOWER_STALL_S`` (seconds, > 0; test only too) replaces
``control.server.FOLLOWER_STALL_S``, how long a control API stream (``mlxctl events
-f``) whose reader takes nothing is kept (30 s), so that a test of a stopped follower
ends in seconds; refused at start as the two above when it is not a positive number.

``MLXCELD_TEST_ROTATION_STEP_S`` (seconds, > 0; test only too) replaces
``rotation.STEP_S``, how long a rotation's step asks a member that fails it again (30 s),
so that a test of a member failing a step ends in seconds.

``MLXCELD_TEST_HANDOVER_S`` (seconds, > 0; test only too) replaces ``rotation.HANDOVER_S``,
how long a member waits for its workers' streams under the old key to be handed over
before it removes the key (30 s), so that a test of a sequence that outlasts that wait
ends in seconds.

``MLXCELD_TEST_STAGE_LAYER_S`` (seconds, > 0; test only too) makes a stage worker
sleep this long after each layer it loads (``workers/stage.py``), as a slow disk
would, so that a test of the assignment's wait on load progress
(``cluster/assignment/stagehost.py``) has a load that goes on, or stalls, for seconds.

``MLXCELD_TEST_ROUTER_LAYER_S`` (seconds, > 0; test only too) does the same for a
single-host router worker's model (``workers/router.py``), so that a test of
``mlxctl serve``'s progress sees the load go on for seconds.

``MLXCELD_TEST_EXPECT_DELAY_S`` (seconds, > 0; test only too) makes a decode node take
each router's ``expect`` this long after it came (``replicas/handoffs.py``), so that the
prefill node's handoff comes first; ``MLXCELD_TEST_PEERS_EVERY_S`` replaces
``workers/handoff_node.PEERS_EVERY_S`` (5 s), how often a decode node asks its prefill
peers' agents, so that a prefill node's restart on a new port comes between two asks.

``MLXCELD_TEST_MEMORY_AVAILABLE`` (bytes, > 0; test only too) caps the memory this
daemon's inventory reports available (``discovery/inventory.py``), so that a test makes
the planner find a plan that does not fit (the fixtures are tiny). Anything but a
positive whole number makes the daemon refuse to start, as above.

``MLXCELD_TEST_COMPUTE_UNITS`` (a positive number; test only too) is what this daemon's
measurement of its compute units returns, without running it (``discovery/speed.py``):
plans over daemons on one loaded host do not depend on the load (tests/helpers set it
to 1 unless a test says otherwise). A declared ``[daemon] compute_units`` still wins.
Anything but a positive number makes the daemon refuse to start, as above.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
from collections.abc import Mapping
from typing import Final

from mlxceld.errors import ConfigError

log = logging.getLogger(__name__)

ENV: Final = "MLXCELD_FAILPOINT"
WAIT_ENV: Final = "MLXCELD_TEST_PEER_WAIT_S"
ACTIVATE_ENV: Final = "MLXCELD_TEST_ACTIVATE_FOR_S"
ROTATION_STEP_ENV: Final = "MLXCELD_TEST_ROTATION_STEP_S"
HANDOVER_ENV: Final = "MLXCELD_TEST_HANDOVER_S"
MEMORY_ENV: Final = "MLXCELD_TEST_MEMORY_AVAILABLE"
UNITS_ENV: Final = "MLXCELD_TEST_COMPUTE_UNITS"
STALL_ENV: Final = "MLXCELD_TEST_FOLLOWER_STALL_S"
STAGE_LAYER_ENV: Final = "MLXCELD_TEST_STAGE_LAYER_S"
ROUTER_LAYER_ENV: Final = "MLXCELD_TEST_ROUTER_LAYER_S"
EXPECT_DELAY_ENV: Final = "MLXCELD_TEST_EXPECT_DELAY_S"
PEERS_EVERY_ENV: Final = "MLXCELD_TEST_PEERS_EVERY_S"
CRASH_POINTS: Final = frozenset({
    "peer-after-preparing", "peer-after-accepted", "peer-after-committed", "peer-after-active",
    "coordinator-before-decision", "coordinator-after-commit-decision",
    "coordinator-after-activate-decision", "coordinator-after-active-decision",
    "coordinator-after-abort-decision", "rotator-after-installing", "rotator-after-using",
    "rotator-after-removing"})
FAULT_POINTS: Final = frozenset({"offer-assignment-version", "offer-package-version",
                                 "offer-layer-count", "offer-coordinator",
                                 "worker-kill-lost", "member-refuses-key-use"})
KNOWN: Final = CRASH_POINTS | FAULT_POINTS


def parse(environ: Mapping[str, str]) -> frozenset[str]:
    """The fail points ``environ`` sets; ``ConfigError`` naming an unknown one."""
    names = {n.strip() for n in environ.get(ENV, "").split(",") if n.strip()}
    unknown = sorted(names - KNOWN)
    if unknown:
        raise ConfigError(f"{ENV} names unknown fail point(s) {', '.join(unknown)}",
                          hint=f"known: {', '.join(sorted(KNOWN))} (tests only; unset it "
                          "to run normally)")
    return frozenset(names)


def parse_wait(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_PEER_WAIT_S`` as seconds, None when unset; ``ConfigError`` if bad."""
    return _seconds(environ, WAIT_ENV, "the documented 60 s wait")


def parse_activate_for(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_ACTIVATE_FOR_S`` as seconds, None when unset; ``ConfigError`` if bad."""
    return _seconds(environ, ACTIVATE_ENV, "the documented 600 s of re-sent activates")


def parse_follower_stall(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_FOLLOWER_STALL_S`` as seconds, None when unset; ``ConfigError`` if bad."""
    return _seconds(environ, STALL_ENV, "the documented 30 s")


def parse_stage_layer(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_STAGE_LAYER_S`` as seconds, None when unset; ``ConfigError`` if bad."""
    return _seconds(environ, STAGE_LAYER_ENV, "a stage that loads at its disk's pace")


def parse_router_layer(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_ROUTER_LAYER_S`` as seconds, None when unset; ``ConfigError`` if bad."""
    return _seconds(environ, ROUTER_LAYER_ENV, "a router that loads at its disk's pace")


def parse_expect_delay(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_EXPECT_DELAY_S`` as seconds, None when unset; ``ConfigError`` if bad."""
    return _seconds(environ, EXPECT_DELAY_ENV, "a decode node that takes an expect as it comes")


def parse_peers_every(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_PEERS_EVERY_S`` as seconds, None when unset; ``ConfigError`` if bad."""
    return _seconds(environ, PEERS_EVERY_ENV, "the documented 5 s")


def parse_handover(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_HANDOVER_S`` as seconds, None when unset; ``ConfigError`` if bad."""
    return _seconds(environ, HANDOVER_ENV, "the documented 30 s of a rotation's handover")


def parse_rotation_step(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_ROTATION_STEP_S`` as seconds, None when unset; ``ConfigError`` if
    bad."""
    return _seconds(environ, ROTATION_STEP_ENV, "the documented 30 s of a rotation's step")


def parse_memory(environ: Mapping[str, str]) -> int | None:
    """``MLXCELD_TEST_MEMORY_AVAILABLE`` as bytes, None when unset; ``ConfigError`` if bad."""
    raw = environ.get(MEMORY_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) <= 0:
        raise ConfigError(f"{MEMORY_ENV}={raw!r} is not a positive number of bytes",
                          hint="unset it for the memory the host has available")
    return int(raw)


def parse_units(environ: Mapping[str, str]) -> float | None:
    """``MLXCELD_TEST_COMPUTE_UNITS``, None when unset; ``ConfigError`` if bad."""
    return _positive(environ, UNITS_ENV, "compute units", "unset it to measure them")


def _seconds(environ: Mapping[str, str], name: str, default: str) -> float | None:
    return _positive(environ, name, "seconds", f"unset it for {default}")


def _positive(environ: Mapping[str, str], name: str, unit: str, hint: str) -> float | None:
    """``name``'s value as a positive finite number, None when unset."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={raw!r} is not a positive number of {unit}", hint=hint)
    return value


ACTIVE: Final = parse(os.environ)
PEER_WAIT_S: Final = parse_wait(os.environ)
ACTIVATE_FOR_S: Final = parse_activate_for(os.environ)
ROTATION_STEP_S: Final = parse_rotation_step(os.environ)
HANDOVER_S: Final = parse_handover(os.environ)
MEMORY_AVAILABLE: Final = parse_memory(os.environ)
COMPUTE_UNITS: Final = parse_units(os.environ)
FOLLOWER_STALL_S: Final = parse_follower_stall(os.environ)
STAGE_LAYER_S: Final = parse_stage_layer(os.environ)
ROUTER_LAYER_S: Final = parse_router_layer(os.environ)
EXPECT_DELAY_S: Final = parse_expect_delay(os.environ)
PEERS_EVERY_S: Final = parse_peers_every(os.environ)


def on(name: str) -> bool:
    """Whether fault point ``name`` is set."""
    assert name in FAULT_POINTS, name
    return name in ACTIVE


def crash(name: str) -> None:
    """Kill this process with SIGKILL here if crash point ``name`` is set."""
    assert name in CRASH_POINTS, name
    if name in ACTIVE:
        log.critical("fail point %s: killing this process (pid %d)", name, os.getpid())
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
