"""The pipeline engine: the router's ``Engine`` over stages on other hosts.

For each request: prepare a sequence on every stage (each answers ``prepared``),
send the prompt to the first stage in chunks of ``PREFILL_CHUNK`` tokens; the
first stage forwards activations down the pipeline and the last stage samples
with the request's parameters. From then on the stages decode by themselves:
the last stage sends each token id here and to the first stage as the next
step, until an end-of-sequence id or ``max_tokens``; this engine only reads
the tokens and releases the sequence when its request ends (a stop string, a
client gone), so the coordinator is never on the decode loop's critical path.
Sequences of concurrent requests are in flight at once, so while one stage
works on one sequence the others work on others.

The stage links are kept up in the background (``keep_linked``, run by the
router): every stage is dialed and attached at start and re-dialed whenever its
connection ends, with a bounded backoff (links.py, connectivity.py).
``readiness`` names the stages that are not attached and why, for the router's
``GET /ready`` (a stage that failed on its host, ``failed``: in its host's words,
the reason and the next step; ``standin.py``); requests are not held back by it:
one that finds a link down dials it on demand (a failed stage's stand-in answers
at once: a 503 naming the stage and the reason), except while a stage is *silent*
(attached, then nothing heard for ``silence_s``: its host sleeps or is off the
network; links.py): then a request is refused at once with 503 and
``Retry-After``, naming the stage, until the background re-dial attaches it again.

Bounds (every wait has a deadline):

- connecting and attaching a stage: ``DIAL_BUDGET_S`` + ``ATTACH_TIMEOUT_S``
  (links.py), then HTTP 503 naming the stage; in the background, attempts are
  ``RETRY_INITIAL_S`` doubling to ``RETRY_MAX_S`` apart (connectivity.py);
- ``prepared`` from every stage: ``PREPARE_TIMEOUT_S``;
- each token: ``STEP_TIMEOUT_S`` plus ``PER_TOKEN_S`` for every prompt token in
  the step; a stage that dies is noticed at once (its connection ends), one that
  goes silent within ``silence_s`` (the heartbeat, ``DEFAULT_SILENCE_S``: 3 s),
  one that stalls within this bound. Either way the request fails with
  ``EngineUnavailable`` (503 before the first token, an SSE error event after).

A stage that is stopping refuses new sequences (``draining``, stage.py): the
request is refused with ``EngineUnavailable`` (503, ``Retry-After:
DRAINING_RETRY_S``) naming the stage; requests it already holds run on. ``readiness``
(``GET /ready``) then names it draining, until it prepares a sequence again or for
``DRAINING_RETRY_S`` after its last refusal.

What reaches the client names stages by node id, never by address.

A client that goes away closes the generator: the sequence is released on every
stage. A request after a stage came back finds it re-attached, or attaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from typing import Any, Final

from mlxceld.engine.base import (
    REPETITION_CONTEXT,
    EngineError,
    EngineUnavailable,
    GenerationRequest,
    TokenOutput,
)
from mlxceld.pipeline import protocol as p
from mlxceld.pipeline.connectivity import RETRY_INITIAL_S, RETRY_MAX_S, Connectivity
from mlxceld.pipeline.links import DIAL_BUDGET_S, Inbox, StageAddress, StageLink
from mlxceld.roles.options import KVQuant
from mlxceld.types import DEFAULT_SILENCE_S
from mlxceld.wire import Envelope, Keyring
from mlxceld.wire.address import parse_address

log = logging.getLogger(__name__)

PREPARE_TIMEOUT_S: Final = 5.0
STEP_TIMEOUT_S: Final = 10.0
PER_TOKEN_S: Final = 0.05
DRAINING_RETRY_S: Final = 5  # Retry-After for a draining stage: it stops, then restarts
# A stage's refusals whose words name no address (they name the stage, a sequence, a
# field): passed on to the client; any other's words go to the router's log.
_CLIENT_WORDS: Final = frozenset({p.ERR_TOO_MANY, p.ERR_UNKNOWN_SEQ, p.ERR_BAD_MESSAGE,
                                  p.ERR_NOT_OWNER})


class PipelineEngine:
    """Implements ``Engine`` by driving stage workers over MXCL channel 1."""

    def __init__(self, stages: Sequence[StageAddress], *, keyring: Keyring, origin: str,
                 model_identity: str, cluster: str, model_id: str,
                 context_length: int, eos_token_ids: set[int], max_batch: int = 8,
                 step_timeout_s: float = STEP_TIMEOUT_S,
                 retry_s: tuple[float, float] = (RETRY_INITIAL_S, RETRY_MAX_S),
                 dial_budget_s: float = DIAL_BUDGET_S,
                 silence_s: float = DEFAULT_SILENCE_S,
                 kv_quant: KVQuant | None = None) -> None:
        """``retry_s``: the background re-dial backoff (first, most); ``dial_budget_s``: how
        long one dial may retry a refused connection (smaller in tests); ``origin``: the
        coordinator's address in the cluster TOML, whose identity the links claim;
        ``silence_s``: how long an attached stage may send nothing before it is silent;
        ``kv_quant``: every sequence's caches quantized so on every stage (``prepare``'s
        ``kv``; the router checked the model for it)."""
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self.model_id = model_id
        self.context_length = context_length
        self.max_batch = max_batch
        self.kv_quant = kv_quant
        if kv_quant is not None:
            log.info("pipeline engine for %s: every stage's %s", model_id, kv_quant)
        self._eos = frozenset(eos_token_ids)
        self._model_identity = model_identity
        self._cluster = cluster
        self._step_timeout = step_timeout_s
        self._inboxes: dict[str, Inbox] = {}
        me = parse_address(origin, port_zero=True)
        self._links = [StageLink(s, keyring=keyring, origin=me,
                                 model_identity=model_identity, cluster=cluster,
                                 inboxes=self._inboxes.get, dial_budget_s=dial_budget_s,
                                 connectivity=Connectivity(initial_s=retry_s[0],
                                                           max_s=retry_s[1]),
                                 silence_s=silence_s)
                       for s in sorted(stages, key=lambda s: s.rank)]
        self._last_rank = self._links[-1].stage.rank
        self.tokens = 0  # generated and handed to requests (end-of-sequence ones too)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._draining: dict[int, float] = {}  # rank -> when it last refused: draining

    def active_sequences(self) -> int:
        return len(self._inboxes)

    def stages(self) -> list[dict[str, Any]]:
        """Each stage, where it is, and whether it is attached (else its state and error):
        the router's stats, for the operator."""
        return [link.stats() for link in self._links]

    def readiness(self) -> dict[str, Any] | None:
        """None when every stage is attached; else what ``GET /ready`` answers with 503
        (stages named by node id, no address)."""
        down = [link.describe() for link in self._links if not link.up]
        now = time.monotonic()
        draining = [{"stage": link.stage.node_id, "state": "draining", "error": None}
                    for link in self._links if link.up
                    and now - self._draining.get(link.stage.rank, -1e9) < DRAINING_RETRY_S]
        if not down and not draining:
            return None
        said = "; ".join(d["error"] if d["state"] == "failed" and d["error"] else
                         f"{d['stage']} is {d['state'].replace('_', ' ')}"
                         + (f" ({d['error']})" if d["error"] else "") for d in down)
        message = [f"{len(down)} of {len(self._links)} stages not attached: {said}"] \
            if down else []
        message += [f"stage {d['stage']} is draining (stopping or restarting): it takes no "
                    "new request" for d in draining]
        return {"message": "; ".join(message), "stages": down + draining}

    async def connect(self) -> None:
        """Connect and attach every stage that is not (raises ``EngineUnavailable``)."""
        await asyncio.gather(*(link.ensure() for link in self._links))

    def rekey(self) -> None:
        """The keyring's primary changed: each link hands new sequences over to a stream
        under it, in the background (links.py); running sequences finish where they are."""
        for link in self._links:
            link.rekey()

    async def keep_linked(self) -> None:
        """Keep every stage attached, re-dialing broken links, until cancelled."""
        async with asyncio.TaskGroup() as tg:
            for link in self._links:
                tg.create_task(link.keep_up())

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        if self._closed:
            raise EngineError("the engine is closed")
        for link in self._links:
            link.check_admits()
        await self.connect()
        seq = uuid.uuid4().hex[:24]
        inbox: Inbox = asyncio.Queue()
        self._inboxes[seq] = inbox
        for link in self._links:
            link.track(seq)
        try:
            await self._prepare(seq, request, inbox)
            prompt = list(request.prompt_tokens)
            step = 0
            chunks = prefill_chunks(prompt, self.kv_quant)
            for chunk in chunks:
                await self._run(seq, step, chunk, sample=step == len(chunks) - 1)
                step += 1
            for link in self._links:  # a handover may move it now (links.py)
                await link.decoding(seq)
            produced = 0
            pending = len(prompt[-p.PREFILL_CHUNK:])
            while True:  # the stages run step, step + 1, ... on their own (see above)
                out = await self._token(seq, step - 1 + produced, inbox, pending,
                                        request.params.logprobs)
                produced += 1
                self.tokens += 1
                if out.token in self._eos:
                    yield replace(out, finish_reason="stop")
                    return
                if produced >= request.params.max_tokens:
                    yield replace(out, finish_reason="length")
                    return
                yield out
                pending = 1
        finally:
            del self._inboxes[seq]
            for link in self._links:
                link.untrack(seq)
            self._spawn(self._release(seq))

    async def _prepare(self, seq: str, request: GenerationRequest, inbox: Inbox) -> None:
        header: dict[str, Any] = {"t": "prepare", "seq": seq,
                                  "params": p.params_to_wire(request.params),
                                  "eos": sorted(self._eos)[:p.MAX_EOS]}
        if request.params.repetition_penalty != 1:  # what the last stage's penalty sees
            header["history"] = list(request.prompt_tokens)[-REPETITION_CONTEXT:]
        if self.kv_quant is not None:
            header["kv"] = p.kv_to_wire(self.kv_quant)
        await asyncio.gather(*(link.send(header) for link in self._links))
        waiting = {link.stage.rank: link.stage.node_id for link in self._links}
        try:
            async with asyncio.timeout(PREPARE_TIMEOUT_S):
                while waiting:
                    rank, env = self._checked(await inbox.get())
                    if env.type == "prepared":
                        waiting.pop(rank, None)
                        self._draining.pop(rank, None)
        except TimeoutError:
            raise EngineUnavailable(f"stages {sorted(waiting.values())} did not prepare the "
                                    f"sequence within {PREPARE_TIMEOUT_S:g} s") from None

    async def _run(self, seq: str, step: int, tokens: list[int], *, sample: bool) -> None:
        blob = ("tokens", "i32", (1, len(tokens)), struct.pack(f"<{len(tokens)}i", *tokens))
        await self._links[0].send({"t": "run", "seq": seq, "step": step, "sample": sample},
                                  [blob])

    async def _token(self, seq: str, step: int, inbox: Inbox, prompt_tokens: int,
                     logprobs: int | None) -> TokenOutput:
        """The last stage's token for ``step``, with its log-probabilities when asked."""
        bound = self._step_timeout + PER_TOKEN_S * prompt_tokens
        try:
            async with asyncio.timeout(bound):
                while True:
                    rank, env = self._checked(await inbox.get())
                    if env.type == "token" and rank == self._last_rank \
                            and env.header.get("step") == step:
                        token = int.from_bytes(env.tensors["tokens"].data, "little",
                                               signed=True)
                        try:
                            logprob, top = p.logprobs_of(env.header, logprobs)
                        except p.ProtocolViolation as exc:
                            raise EngineError(f"stage {self._node_of(rank)} sent a bad "
                                              f"token: {exc.message}") from None
                        return TokenOutput(token, None, logprob, top)
                    log.debug("sequence %s: ignored %s for step %s", seq, env.type,
                              env.header.get("step"))
        except TimeoutError:
            raise EngineUnavailable(
                f"no token for step {step} within {bound:g} s: a stage is stalled "
                f"({', '.join(link.stage.node_id for link in self._links)})") from None

    def _checked(self, item: tuple[int, Envelope] | BaseException) -> tuple[int, Envelope]:
        if isinstance(item, BaseException):
            raise item
        rank, env = item
        if env.type == "error":
            message = str(env.header.get("message", "unknown error"))
            code = env.header.get("code")
            if code == p.ERR_DOWNSTREAM:  # the stage's words name an address: log them
                log.warning("stage of rank %s: %s", rank, message)
                raise EngineUnavailable(self._downstream_message(rank))
            if code == p.ERR_STAGE_FAILED:
                raise EngineUnavailable(message)
            if code == p.ERR_DRAINING:  # stopping: its sequences finish, no new one
                self._draining[rank] = time.monotonic()
                raise EngineUnavailable(
                    f"stage {self._node_of(rank)} is draining (stopping or restarting): it "
                    "takes no new request; retry shortly", retry_after_s=DRAINING_RETRY_S)
            if code == p.ERR_BAD_CONSTRAINT:  # the client's: a 400 naming response_format
                from mlxceld.engine.constraints import ConstraintError

                raise ConstraintError(message)
            if code in _CLIENT_WORDS:
                raise EngineError(f"stage {self._node_of(rank)} refused the request: "
                                  f"{message} ({code})")
            # its words may name addresses (its coordinator's, its neighbours'): logged
            log.warning("stage %s refused a request: %s (%s)", self._node_of(rank), message,
                        code)
            raise EngineError(f"stage {self._node_of(rank)} refused the request ({code}); "
                              "see the router's log")
        return item

    def _node_of(self, rank: int) -> str:
        return next((link.stage.node_id for link in self._links if link.stage.rank == rank),
                    f"of rank {rank}")

    def _downstream_message(self, rank: int) -> str:
        """A stage could not reach the stage after it (the first, from the last)."""
        ranks = [link.stage.rank for link in self._links]
        at = ranks.index(rank) if rank in ranks else 0
        here = self._links[at].stage.node_id
        after = self._links[(at + 1) % len(self._links)].stage.node_id
        return (f"stage {here} cannot reach stage {after}: is {after}'s host up and on the "
                "network? retry shortly")

    async def _release(self, seq: str) -> None:
        for link in self._links:
            if link.up:
                with contextlib.suppress(EngineError):
                    await link.send({"t": "release", "seq": seq})

    def _spawn(self, coro: Any) -> None:
        # Not a task group: a release outlives its request, and the engine has no scope of
        # its own (requests run without keep_linked too); aclose waits for these.
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 1.0)
        for link in self._links:
            await link.aclose()


def prefill_chunks(prompt: list[int], kv_quant: KVQuant | None) -> list[list[int]]:
    """The prompt's prefill steps: chunks of ``PREFILL_CHUNK`` tokens; with a quantized KV
    cache that starts after some tokens (``kv_quant.start`` above 0), the last token as a
    step of its own, as mlx-lm's ``generate_step`` and ``BatchGenerator`` take it, so that
    each layer's cache is quantized at the step it would be there (``engine/kvquant.py``)."""
    split = kv_quant is not None and kv_quant.start > 0 and len(prompt) > 1
    head = prompt[:-1] if split else prompt
    chunks = [head[i:i + p.PREFILL_CHUNK] for i in range(0, len(head), p.PREFILL_CHUNK)]
    return [*chunks, prompt[-1:]] if split else chunks
