"""Cluster-wide secret rotation (`mlxctl secret rotate`): the asyncio shell of
``rotation_round.py``, and each member's side of it.

Members: this daemon and every candidate peer of discovery (``--cluster-peers`` and
mDNS records; ``mlxctl cluster nodes``) when the rotation starts; the list is written
with the rotation and kept for its whole life, a restart included.

Messages (``wire/agent_messages.py``: ``KeyInstall``, ``KeyUse``, ``KeyRemove``,
``KeyReport``, ``KeyState``), on MXCL channel 3 (agent), over the same authenticated and
encrypted agent connections as the inventory; the new secret travels nowhere else (never
in argv, a log line, an error, an event or the database):

=========== ============== ===========================================================
type        direction      fields
=========== ============== ===========================================================
key_install rotator → peer ``secret_hex``: the new secret (installed, not the primary)
key_use     rotator → peer ``kid``: make it the primary (16 hex digits)
key_remove  rotator → peer ``kid``: remove it (a key already gone is no error)
key_report  rotator → peer none
key_state   peer → rotator ``primary`` (key id or null), ``ids`` (every installed key id)
error       peer → rotator ``reason`` (e.g. the primary cannot be removed)
=========== ============== ===========================================================

A member applies each change as `mlxctl secret install|use|remove` would on it (its
keyring, its event, its workers told at once: ``KeyWindow.push_keyring``). Whoever holds
the cluster secret may ask: the key ops are what the secret already grants.

Deadlines: an ask is ``CONNECT_BUDGET_S`` (5 s) to connect and authenticate, then
``ANSWER_TIMEOUT_S`` (15 s: the member tells its workers first; plus ``HANDOVER_S`` for
``key_remove``, below) for the answer. Before
starting, every member is asked ``key_report`` once: one that does not answer refuses
the rotation (``RotationRefused`` naming every such member; nothing changed anywhere).
Within a step a member that fails is asked again every ``RETRY_S`` (1 s) until
``STEP_S`` (30 s) after the step began; then it has failed the step. A step ends when
every member has done or failed it; a failed member makes the rotation ``failed``
(``RotationFailed`` naming every member that failed and why; the steps before stay
done, so the old key stays installed where it was not removed).

The rotator writes each step (``state/rotations.py``) before it asks anything of it,
and resumes an unfinished rotation when its daemon starts (``Rotator.resume``). A
failed rotation is taken up again, at the step it failed and over the same members,
by `mlxctl secret rotate` without ``--new-secret-file`` (``Rotator.retry``; the event
``rotation.retried``); with one, or when the latest rotation did not fail, a new one
starts (to a generated secret when none is given).

Nothing in flight is lost (issue 16: rotation under load): at ``use`` every worker
hands its outgoing streams over to the new primary (``pipeline/links.py``: the router's
links send new sequences over a new stream, move the running ones there as soon as
their prompt is sent, and finish the old stream once none is left on it;
``net/redialer.py``: stage-to-stage streams, at once, in order; ``replicas/remote.py``:
a router's links to replicas, prefill and decode nodes, their running sequences moved
at once; ``replicas/targets.py``: a prefill node's links to decode nodes), however long
the sequences run. Before a member removes the old key (``key_remove``, and the rotator's
own removal) it waits until none of its workers has a stream left under it
(``KeyOps.streams_under``, polled every ``HANDOVER_POLL_S``), at most ``HANDOVER_S``
(30 s: a prompt being sent at ``use``, a handover that has to dial again); what is
still under the old key then is cut (the streams end, their owners re-dial under the
new key, and a sequence on them fails with an error naming its stage), with a warning
naming each worker. The removal's answer may take ``ANSWER_TIMEOUT_S + HANDOVER_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Final, Protocol

from mlxceld import failpoints
from mlxceld.cluster.rotation_round import RotationRound, Step, failed_step
from mlxceld.control.answers import KeyChange
from mlxceld.errors import MlxceldError, RotationFailed, RotationRefused, UnknownKey
from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService, ask
from mlxceld.net.errors import AskFailed
from mlxceld.state.events import EventLog
from mlxceld.state.rotations import RotationRow, RotationsTable
from mlxceld.types import JSON
from mlxceld.wire import Envelope, MessageSpec, encode_envelope
from mlxceld.wire.agent_messages import (
    KeyInstall,
    KeyOp,
    KeyRemove,
    KeyReport,
    KeyState,
    KeyUse,
)
from mlxceld.wire.messages import Error, Message, MessageError, decode, vocabulary
from mlxceld.wire.secret import Keyring, key_id

log = logging.getLogger(__name__)

AGENT_CHANNEL: Final = 3
CONNECT_BUDGET_S: Final = 5.0
ANSWER_TIMEOUT_S: Final = 15.0
RETRY_S: Final = 1.0
STEP_S: Final = 30.0
HANDOVER_S: Final = 30.0  # a key's streams may take this long to hand over (see above)
HANDOVER_POLL_S: Final = 0.2
ANSWERS: Final = {KeyState.T: MessageSpec(), Error.T: MessageSpec()}
KEY_OPS: Final = vocabulary(KeyInstall, KeyUse, KeyRemove, KeyReport)
GENERATED_SECRET_BYTES: Final = 32  # as `mlxctl secret generate`: the secret is their hex
#: The crash point after each step with an action (``failpoints.py``): every member did
#: it, the next step is not written yet.
CRASH_AFTER: Final = {Step.INSTALLING: "rotator-after-installing",
                      Step.USING: "rotator-after-using",
                      Step.REMOVING: "rotator-after-removing"}


class KeyOps(Protocol):
    """The daemon's keyring changes, each pushed to its workers (``daemon/keys.py``)."""

    async def install_secret(self, secret: bytes, primary: bool, source: str) -> KeyChange: ...
    async def use_secret(self, kid: str) -> KeyChange: ...
    async def remove_secret(self, kid: str) -> KeyChange: ...
    async def streams_under(self, kid: str) -> dict[str, int]: ...


class MemberFailed(Exception):
    """A member did not do what it was asked; the message says why (no secret in it)."""


# -- a member's side ----------------------------------------------------------------------


def serve_key_ops(agent: AgentService, ops: KeyOps, keyring: Keyring) -> None:
    """Answer ``key_install``, ``key_use``, ``key_remove`` and ``key_report``."""

    async def answer(stream: MxclStream, message: Envelope) -> None:
        try:
            await _apply(ops, decode(message.header, KEY_OPS))
        except MessageError as exc:  # the reason names a field, never a secret
            await stream.send(encode_envelope(Error(exc.reason[:500]).to_wire()))
            return
        except MlxceldError as exc:  # the message names a key id at most, never a secret
            await stream.send(encode_envelope(Error(exc.message[:500]).to_wire()))
            return
        await stream.send(encode_envelope(key_state(keyring).to_wire()))

    for kind in KEY_OPS:
        agent.add_handler(AGENT_CHANNEL, kind, answer)


async def _apply(ops: KeyOps, op: Message) -> None:
    if isinstance(op, KeyInstall):
        await ops.install_secret(op.secret(), False, "mlxctl secret rotate (from a peer)")
    elif isinstance(op, KeyUse):
        if failpoints.on("member-refuses-key-use"):
            raise RotationRefused("fail point member-refuses-key-use: key_use refused")
        await ops.use_secret(op.kid)
    elif isinstance(op, KeyRemove):
        await handed_over(ops, op.kid)
        with contextlib.suppress(UnknownKey):  # removed already: what was asked is true
            await ops.remove_secret(op.kid)


async def handed_over(ops: KeyOps, kid: str) -> dict[str, int]:
    """Wait until no worker has a stream under ``kid``, at most ``HANDOVER_S``; what is
    left then (by worker, logged: removing the key cuts those streams)."""
    loop = asyncio.get_running_loop()
    within = failpoints.HANDOVER_S or HANDOVER_S  # tests only: a shorter wait
    deadline = loop.time() + within
    while (left := await ops.streams_under(kid)) and loop.time() < deadline:
        await asyncio.sleep(HANDOVER_POLL_S)
    if left:
        log.warning("key %s is removed while %s still use it after %g s: those streams "
                    "end, and the sequences on them fail", kid,
                    ", ".join(f"worker {w} ({n} stream(s))" for w, n in sorted(left.items())),
                    within)
    return left


def key_state(keyring: Keyring) -> KeyState:
    primary = keyring.primary_id
    return KeyState(primary.hex() if primary else None,
                    tuple(sorted(k.hex() for k in keyring.ids())))


# -- the rotator's side -------------------------------------------------------------------


async def ask_member(identity: str, keyring: Keyring, address: str,
                     message: KeyOp) -> KeyState:
    """Send ``message`` to the member at ``address``; its ``key_state``. ``MemberFailed``
    saying why otherwise, within ``CONNECT_BUDGET_S + ANSWER_TIMEOUT_S`` (plus
    ``HANDOVER_S`` for ``key_remove``)."""
    timeout = ANSWER_TIMEOUT_S + (HANDOVER_S if isinstance(message, KeyRemove) else 0.0)
    try:
        got = await ask(identity, address, message, keyring=keyring, channel=AGENT_CHANNEL,
                        answers=ANSWERS, connect_s=CONNECT_BUDGET_S, answer_s=timeout)
    except AskFailed as exc:
        raise MemberFailed(_why(exc)) from exc
    try:
        return KeyState.from_wire(got.header)
    except MessageError as exc:
        raise MemberFailed(f"bad answer: {exc.reason}") from None


def _why(exc: AskFailed) -> str:
    if exc.kind == "connect":
        return f"{exc.detail}: {exc.message}"
    if exc.kind == "closed":
        return f"closed: {exc.message}"
    if exc.kind == "bad_answer":
        return f"bad answer: {exc.message}"
    return exc.message  # address, timeout ("no answer within ..."), error (its reason)


class Rotator:
    """Runs this daemon's rotations, one at a time, in the member's task group."""

    def __init__(self, table: RotationsTable, keyring: Keyring, ops: KeyOps,
                 events: EventLog, *, identity: str, peers: Callable[[], list[str]],
                 tg: asyncio.TaskGroup) -> None:
        self._table = table
        self._keyring = keyring
        self._ops = ops
        self._events = events
        self._identity = identity  # our agent address: the member that is us
        self._peers = peers
        self._tg = tg
        self._running: asyncio.Future[RotationRound] | None = None

    def describe(self) -> JSON | None:
        """The latest rotation (``state/rotations.py``'s row), None before the first."""
        row = self._table.latest()
        return row.to_json() if row else None

    def resume(self) -> None:
        """At start: carry on the latest rotation if it did not finish."""
        row = self._table.latest()
        if row is None or row.finished:
            return
        log.info("rotation %d to key %s: resumed at step %s", row.id, row.new_kid, row.step)
        self._events.append("rotation.resumed", "keyring",
                            f"rotation {row.id} to key {row.new_kid} resumed at {row.step}",
                            rotation=row.id)
        self._start(row)

    async def rotate(self, secret: bytes | None) -> RotationRow:
        """A new rotation to ``secret`` over this daemon and its candidates; its row once
        done. Without ``secret``, the latest rotation if it failed (``retry``), else one
        to a generated secret. ``RotationRefused`` (nothing changed) or
        ``RotationFailed`` (names each member that failed a step)."""
        if self._running is not None and not self._running.done():
            raise RotationRefused("a secret rotation runs already on this daemon",
                                  hint="wait for it: mlxctl secret list --json shows its step")
        if secret is None:
            row = self._table.latest()
            step = failed_step(row.failures) if row and row.step == Step.FAILED else None
            if row is not None and step is not None \
                    and bytes.fromhex(row.new_kid) in self._keyring:
                return await self.retry(row, step)
            secret = secrets.token_bytes(GENERATED_SECRET_BYTES).hex().encode()
        old = self._keyring.primary_id
        new = key_id(secret)
        if old is None:
            raise RotationRefused("this daemon has no cluster secret to rotate from",
                                  hint="install one: mlxctl secret install FILE --primary")
        if old == new:
            raise RotationRefused(f"the new secret is the primary already (key {new.hex()})",
                                  hint="give another secret, or none to have one generated")
        members = (self._identity, *sorted(set(self._peers()) - {self._identity}))
        await self._probe(members[1:])
        await self._ops.install_secret(secret, False, "mlxctl secret rotate")
        row = self._table.begin(old.hex(), new.hex(), members)
        self._events.append("rotation.started", "keyring",
                            f"rotation {row.id} from key {row.old_kid} to {row.new_kid} over "
                            f"{len(members)} member(s)", rotation=row.id)
        log.info("rotation %d from key %s to %s over %s", row.id, row.old_kid, row.new_kid,
                 ", ".join(members))
        done = await asyncio.shield(self._start(row))
        return self._outcome(done)

    async def retry(self, row: RotationRow, step: Step) -> RotationRow:
        """Take the failed rotation ``row`` up again at ``step``, the one it failed, over
        the same members, once every one of them answers (else ``RotationRefused``)."""
        await self._probe(tuple(m for m in row.members if m != self._identity))
        self._table.set_step(row.id, step.value, {})
        log.info("rotation %d to key %s: taken up again at step %s", row.id, row.new_kid,
                 step.value)
        self._events.append("rotation.retried", "keyring",
                            f"rotation {row.id} to key {row.new_kid} taken up again at "
                            f"{step.value}", rotation=row.id)
        again = self._table.get(row.id)
        assert again is not None
        done = await asyncio.shield(self._start(again))
        return self._outcome(done)

    async def _probe(self, peers: tuple[str, ...]) -> None:
        async def one(address: str) -> str | None:
            try:
                await ask_member(self._identity, self._keyring, address, KeyReport())
            except MemberFailed as exc:
                return str(exc)
            return None

        answers = await asyncio.gather(*(one(a) for a in peers))
        failed = {a: why for a, why in zip(peers, answers, strict=True) if why is not None}
        if failed:
            raise RotationRefused(
                "secret rotation refused, nothing changed: "
                + "; ".join(f"member {a} is unreachable ({why})" for a, why in failed.items()),
                hint="bring every member back (mlxctl cluster nodes), or remove the ones gone "
                "for good from --cluster-peers, then rotate again")

    def _start(self, row: RotationRow) -> asyncio.Future[RotationRound]:
        rnd = RotationRound.resume(row.id, row.old_kid, row.new_kid, row.members,
                                   Step(row.step), row.failures)
        self._running = self._tg.create_task(self._run(rnd))
        return self._running

    def _outcome(self, rnd: RotationRound) -> RotationRow:
        row = self._table.get(rnd.rotation_id)
        assert row is not None
        if rnd.step == Step.FAILED:
            raise RotationFailed(
                f"secret rotation {rnd.rotation_id} to key {rnd.new_kid} failed: "
                + "; ".join(f"member {m} failed {why}" for m, why in rnd.failures.items()),
                hint="bring those members back and run `mlxctl secret rotate` again (without "
                "--new-secret-file: it takes this rotation up again at the step that failed); "
                "mlxctl cluster nodes names a member left on another key")
        return row

    async def _run(self, rnd: RotationRound) -> RotationRound:
        while not rnd.finished:
            step = rnd.step
            deadline = asyncio.get_running_loop().time() + (failpoints.ROTATION_STEP_S
                                                            or STEP_S)
            members = rnd.pending()
            results = await asyncio.gather(*(self._member(rnd, m, deadline) for m in members))
            for member, why in zip(members, results, strict=True):
                advanced = (rnd.member_done(member, step) if why is None
                            else rnd.member_failed(member, step, why))
                if advanced is not None:
                    if step in CRASH_AFTER:
                        failpoints.crash(CRASH_AFTER[step])
                    self._written(rnd)
        return rnd

    def _written(self, rnd: RotationRound) -> None:
        self._table.set_step(rnd.rotation_id, rnd.step.value, rnd.failures)
        what = f"rotation {rnd.rotation_id} to key {rnd.new_kid}: {rnd.step.value}"
        if rnd.step == Step.FAILED:
            what += " (" + "; ".join(f"{m}: {w}" for m, w in rnd.failures.items()) + ")"
            log.error("%s", what)
        else:
            log.info("%s", what)
        self._events.append(f"rotation.{rnd.step.value}", "keyring", what,
                            rotation=rnd.rotation_id)

    async def _member(self, rnd: RotationRound, member: str, deadline: float) -> str | None:
        """Have ``member`` do the round's step, again every ``RETRY_S`` until ``deadline``;
        None once done, else why it failed the last try."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self._once(member, rnd.step, rnd.new_kid, rnd.old_kid)
                return None
            except (MemberFailed, MlxceldError) as exc:
                why = str(exc)
            if loop.time() + RETRY_S >= deadline:
                return why
            await asyncio.sleep(RETRY_S)

    async def _once(self, member: str, step: Step, new: str, old: str) -> None:
        if member == self._identity:
            state = await self._local(step, new, old)
        else:
            state = await ask_member(self._identity, self._keyring, member,
                                     self._message(step, new, old))
        _verify(step, state, new, old)

    def _message(self, step: Step, new: str, old: str) -> KeyOp:
        if step == Step.INSTALLING:
            secret = self._keyring.get(bytes.fromhex(new))
            if secret is None:
                raise MemberFailed(f"key {new} is no longer in this daemon's keyring")
            return KeyInstall(secret.hex())
        if step == Step.USING:
            return KeyUse(new)
        if step == Step.REMOVING:
            return KeyRemove(old)
        return KeyReport()

    async def _local(self, step: Step, new: str, old: str) -> KeyState:
        if step == Step.INSTALLING and bytes.fromhex(new) not in self._keyring:
            raise MemberFailed(f"key {new} is no longer in this daemon's keyring")
        if step == Step.USING:
            await self._ops.use_secret(new)
        elif step == Step.REMOVING and bytes.fromhex(old) in self._keyring:
            await handed_over(self._ops, old)
            await self._ops.remove_secret(old)
        return key_state(self._keyring)


def _verify(step: Step, state: KeyState, new: str, old: str) -> None:
    """``MemberFailed`` if a member's key state does not show ``step`` done."""
    ids = state.ids
    if step in (Step.INSTALLING, Step.VERIFYING_INSTALL) and new not in ids:
        raise MemberFailed(f"key {new} is not installed there (it has {', '.join(ids)})")
    if step in (Step.USING, Step.VERIFYING_USE) and state.primary != new:
        raise MemberFailed(f"its primary is {state.primary}, not {new}")
    if step == Step.REMOVING and old in ids:
        raise MemberFailed(f"key {old} is still installed there")
