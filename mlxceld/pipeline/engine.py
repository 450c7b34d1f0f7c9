"""The pipeline engine: the router's ``Engine`` over stages on other hosts.

For each request: prepare a sequence on every stage (each answers ``prepared``),
send the prompt (past the prefix the stages keep: ``prefixes.py``, held by
``promptcache.py``) to the first stage in chunks (``chunks``); the first stage forwards
activations down the pipeline and the last stage samples with the request's parameters.
From then on the stages decode by themselves: the last stage sends each token id here
and to the first stage as the next step, until an end-of-sequence id or ``max_tokens``;
this engine only reads the tokens and releases the sequence when its request ends (a
stop string, a client gone), so the coordinator is never on the decode loop's critical path.
With a draft on the last stage (``speculating.py``) a pass may give several tokens: each
comes as its own ``token``, numbered on, and is read here alike.
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
- each token: ``STEP_TIMEOUT_S``, the first one plus ``PER_TOKEN_S`` for every prompt
  token prefilled (all but the prefix the stages keep); a stage that dies is noticed
  at once (its connection ends), one that goes silent within ``silence_s`` (the
  heartbeat, ``DEFAULT_SILENCE_S``: 3 s), one that stalls within this bound. Either
  way the request fails with ``EngineUnavailable`` (503 before the first token, an SSE
  error event after); a lost stage's is ``StageLost``, which a router whose switch
  holds (``replay.py``) replays on a working plan instead.

A stage that is stopping refuses new sequences (``draining``, stage.py): the
request is refused with ``StageDraining`` (503, ``Retry-After: DRAINING_RETRY_S``)
naming the stage, which a router whose switch holds replays on the engine that works
next instead (``replay.py``); requests it already holds run on. ``readiness``
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
from collections.abc import AsyncGenerator, Coroutine, Sequence
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
from mlxceld.pipeline.attaching import DIAL_BUDGET_S, StageAddress
from mlxceld.pipeline.connectivity import RETRY_INITIAL_S, RETRY_MAX_S, Connectivity
from mlxceld.pipeline.links import Inbox, StageDraining, StageLink, StageLost
from mlxceld.pipeline.messages import Forget, Prepare, Prepared, Release, Run
from mlxceld.pipeline.promptcache import PromptCache
from mlxceld.roles.options import KVQuant
from mlxceld.tasks import Background
from mlxceld.types import DEFAULT_SILENCE_S, PipelineCacheStats
from mlxceld.wire import Envelope, Keyring
from mlxceld.wire.address import parse_address
from mlxceld.wire.messages import Message, MessageError
from mlxceld.wire.transport_messages import CodedError, Token

log = logging.getLogger(__name__)

PREPARE_TIMEOUT_S: Final = 5.0
STEP_TIMEOUT_S: Final = 10.0
PER_TOKEN_S: Final = 0.05
CLOSE_S: Final = 1.0  # how long aclose waits for releases under way before it cancels them
DRAINING_RETRY_S: Final = 5  # Retry-After for a draining stage: it stops, then restarts
# A prompt whose part beyond the prefix it starts from is at least this long is kept by the
# stages once prefilled (``keep_prompt``: other chats sharing it start from it); shorter
# ones add little to the entry they started from.
KEEP_PROMPT_MIN_NEW: Final = 32
# A prompt's prefill chunks (``chunks``): about CHUNKS_PER_STAGE per stage, each of
# MIN_CHUNK to MAX_CHUNK tokens. Measured (bench/conversation.py --sections history, small
# qwen2 fixture, 2 stages, 2 CPUs; time to first token against mlx-lm in one process):
# a 2,018-token prompt cold took 37.5 s in chunks of ~505 (0.73x), 24.9 s in ~337 (0.55x),
# 21.6 s in 256 (0.52x), 19.8 s in ~253 (0.49x), 19.2-22.2 s in ~169 (0.46-0.49x); a
# 352-token turn after that history 6.0 s in 2 chunks (0.75x), 5.75 s in 4 (0.66x), 4.96 s
# in 6 of ~59 (0.64x), 4.82-5.32 s in 11 of 32 (0.60-0.62x). Smaller chunks let the stages
# overlap more (k chunks through 2 stages take (k + 1) / 2k of one process's time, at
# best), and on the CPU a chunk's attention over a long context costs more per token the
# longer the chunk; the floor keeps a chunk's compute above the reading of its stage's
# weights (on a GPU too, for a large model).
CHUNKS_PER_STAGE: Final = 6
MIN_CHUNK: Final = 32
MAX_CHUNK: Final = 256
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
                 prompt_cache_bytes: int | None = None,
                 kv_quant: KVQuant | None = None) -> None:
        """``retry_s``: the background re-dial backoff (first, most); ``dial_budget_s``: how
        long one dial may retry a refused connection (smaller in tests); ``origin``: the
        coordinator's address in the cluster TOML, whose identity the links claim;
        ``silence_s``: how long an attached stage may send nothing before it is silent;
        ``prompt_cache_bytes``: each stage's prompt cache bound (0: no prompt cache; None:
        each stage's default, ``kvstore.py``); ``kv_quant``: every sequence's caches
        quantized so on every stage (``prepare``'s ``kv``; the router checked the model for
        it)."""
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
        stages = sorted(stages, key=lambda s: s.rank)
        self._cache = PromptCache((s.rank for s in stages), prompt_cache_bytes, self._forget)
        self._links = [StageLink(s, keyring=keyring, origin=me,
                                 model_identity=model_identity, cluster=cluster,
                                 inboxes=self._inboxes.get, dial_budget_s=dial_budget_s,
                                 connectivity=Connectivity(initial_s=retry_s[0],
                                                           max_s=retry_s[1]),
                                 silence_s=silence_s,
                                 cache=self._cache.attach,
                                 on_cache=self._cache.said,
                                 on_attached=self._cache.attached)
                       for s in stages]
        self._last_rank = self._links[-1].stage.rank
        self.tokens = 0  # generated and handed to requests (end-of-sequence ones too)
        # Releases and forgets: a release outlives its request, and the engine has no
        # scope of its own (requests run without keep_linked too); aclose ends them.
        self._tasks = Background(f"the pipeline engine for {model_id}")
        self._closed = False
        self._draining: dict[int, float] = {}  # rank -> when it last refused: draining

    def active_sequences(self) -> int:
        return len(self._inboxes)

    def _keeps(self) -> bool:
        """Whether to have the stages keep a prompt: the cache is on and no stage said it
        keeps nothing (a bound of 0: a stage whose default is 0). An entry one stage
        refuses is never reused, so the others' copies would be for nothing."""
        return self._cache.on and all(link.cache_budget != 0 for link in self._links)

    def stages(self) -> list[dict[str, Any]]:
        """Each stage, where it is, and whether it is attached (else its state and error),
        and its prompt cache as it last said (bytes, entries, its bound): the router's
        stats, for the operator."""
        return [{**link.stats(),
                 "prompt_cache": self._cache.of_stage(link.stage.rank, link.cache_budget)}
                for link in self._links]

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
        prompt = list(request.prompt_tokens)
        produced: list[int] = []  # the tokens sampled so far
        kept = False  # the stages' caches are whole for prompt + produced[:-1]
        try:
            start = reused = await self._prepare(seq, request, inbox)
            step = 0
            for size in chunks(len(prompt) - start, len(self._links), self.kv_quant):
                await self._run(seq, step, prompt[start:start + size],
                                sample=start + size == len(prompt))
                start += size
                step += 1
            for link in self._links:  # a handover may move it now (links.py)
                await link.decoding(seq)
            # The first token's bound covers every token prefilled: sent at once, run in turn.
            pending = len(prompt) - reused
            while True:  # the stages run step, step + 1, ... on their own (see above)
                out = await self._token(seq, step - 1 + len(produced), inbox, pending,
                                        request.params.logprobs)
                if not produced:  # the first: what the stages' prompt cache gave
                    out = replace(out, cached=reused)
                produced.append(out.token)
                kept = True
                self.tokens += 1
                if out.token in self._eos:
                    yield replace(out, finish_reason="stop")
                    return
                if len(produced) >= request.params.max_tokens:
                    yield replace(out, finish_reason="length")
                    return
                yield out
                pending = 1
        except Exception:
            kept = False  # a stage failed, stalled or refused: its caches may be anything
            raise
        finally:
            del self._inboxes[seq]
            for link in self._links:
                link.untrack(seq)
            self._tasks.spawn(self._release(seq, prompt + produced[:-1] if kept else None))

    async def _prepare(self, seq: str, request: GenerationRequest, inbox: Inbox) -> int:
        """Prepare the sequence on every stage, from the longest prefix of its prompt the
        stages keep (``prefixes.py``); how many of its tokens they start with."""
        prompt = request.prompt_tokens
        reuse = self._cache.lookup(prompt)
        start = 0 if reuse is None else reuse.tokens
        prepare = Prepare(
            seq, request.params, tuple(sorted(self._eos)[:p.MAX_EOS]),
            # what the last stage's penalty sees
            tuple(prompt[-REPETITION_CONTEXT:]) if request.params.repetition_penalty != 1
            else None, self.kv_quant,
            # for other chats of this prefix
            self._cache.added(prompt) if self._keeps()
            and len(prompt) - start >= KEEP_PROMPT_MIN_NEW else None,
            None if reuse is None else (reuse.entry, reuse.tokens))
        reused = await self._prepared(prepare, inbox)
        if reuse is None:
            return 0
        if any(n != reuse.tokens for n in reused):  # a stage no longer holds it
            log.info("a stage no longer holds prompt-cache entry %s: prefilling all %d "
                     "tokens", reuse.entry, len(prompt))
            self._cache.lost(reuse)
            await self._prepared(replace(prepare, reuse=None), inbox)
            return 0
        self._cache.started(reuse)
        return start

    async def _prepared(self, prepare: Prepare, inbox: Inbox) -> list[int]:
        """Send ``prepare`` to every stage; each one's ``reused`` (-1: unreadable)."""
        await asyncio.gather(*(link.send(prepare) for link in self._links))
        waiting = {link.stage.rank: link.stage.node_id for link in self._links}
        reused = []
        try:
            async with asyncio.timeout(PREPARE_TIMEOUT_S):
                while waiting:
                    rank, env = self._checked(await inbox.get())
                    if env.type == "prepared" and waiting.pop(rank, None) is not None:
                        self._draining.pop(rank, None)
                        try:
                            reused.append(Prepared.from_wire(env.header).reused)
                        except MessageError:
                            reused.append(-1)
        except TimeoutError:
            raise EngineUnavailable(f"stages {sorted(waiting.values())} did not prepare the "
                                    f"sequence within {PREPARE_TIMEOUT_S:g} s") from None
        return reused

    def _forget(self, entries: list[str]) -> None:
        """Every stage drops ``entries`` of the prompt cache (no answer is waited for)."""
        for at in range(0, len(entries), p.MAX_FORGET):
            forget = Forget(tuple(entries[at:at + p.MAX_FORGET]))
            for link in self._links:
                if link.up:
                    self._tasks.spawn(self._send_quietly(link, forget))

    def prompt_cache_stats(self) -> PipelineCacheStats:
        """The prompt cache's counts (``PromptCache.stats``)."""
        return self._cache.stats()

    async def _run(self, seq: str, step: int, tokens: list[int], *, sample: bool) -> None:
        blob = ("tokens", "i32", (1, len(tokens)), struct.pack(f"<{len(tokens)}i", *tokens))
        await self._links[0].send(Run(seq, step, sample), [blob])

    async def _token(self, seq: str, step: int, inbox: Inbox, prompt_tokens: int,
                     logprobs: int | None) -> TokenOutput:
        """The last stage's token for ``step``, with its log-probabilities when asked."""
        bound = self._step_timeout + PER_TOKEN_S * prompt_tokens
        try:
            async with asyncio.timeout(bound):
                while True:
                    rank, env = self._checked(await inbox.get())
                    if env.type == "token" and rank == self._last_rank:
                        try:
                            said = Token.from_wire(env.header)
                            logprob, top = said.logprobs(logprobs) if said.step == step \
                                else (None, ())
                        except MessageError as exc:
                            raise EngineError(f"stage {self._node_of(rank)} sent a bad "
                                              f"token: {exc.reason}") from None
                        if said.step == step:
                            token = int.from_bytes(env.tensors["tokens"].data, "little",
                                                   signed=True)
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
            try:
                error = CodedError.from_wire(env.header)
            except MessageError as exc:
                raise EngineError(f"stage {self._node_of(rank)} sent a bad error: "
                                  f"{exc.reason}") from None
            message, code = error.message, error.code
            if code == p.ERR_DOWNSTREAM:  # the stage's words name an address: log them
                log.warning("stage of rank %s: %s", rank, message)
                raise StageLost(self._downstream_message(rank))
            if code == p.ERR_STAGE_FAILED:
                raise EngineUnavailable(message)
            if code == p.ERR_GROUP_BROKEN:  # its group broke: the stage's process ends,
                self._draining[rank] = time.monotonic()  # and restarts: not ready till then
                raise StageLost(message)
            if code == p.ERR_DRAINING:  # stopping: its sequences finish, no new one
                self._draining[rank] = time.monotonic()
                raise StageDraining(
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

    def _release(self, seq: str, keep: list[int] | None = None
                 ) -> Coroutine[Any, Any, None]:
        """Free the sequence on every stage, or have them keep its caches for the tokens
        ``keep`` (the prompt and the tokens run after it), as a prompt-cache entry (named
        in the index at once, so the next request knows of it)."""
        release = Release(seq, (self._cache.added(keep), len(keep)) if keep and self._keeps()
                          else None)
        return self._release_sent(release)

    async def _release_sent(self, release: Release) -> None:
        for link in self._links:
            if link.up:
                await self._send_quietly(link, release)

    @staticmethod
    async def _send_quietly(link: StageLink, message: Message) -> None:
        with contextlib.suppress(EngineError):
            await link.send(message)

    async def aclose(self) -> None:
        self._closed = True
        await self._tasks.aclose(within_s=CLOSE_S)
        for link in self._links:
            await link.aclose()
        await self._tasks.aclose()  # a forget its links' readers asked for meanwhile


def chunks(n: int, stages: int, kv_quant: KVQuant | None = None) -> list[int]:
    """The sizes of the prefill chunks of ``n`` tokens through ``stages`` stages: so that
    the stages overlap (stage 0 runs chunk 2 while stage 1 runs chunk 1), about
    ``CHUNKS_PER_STAGE`` chunks per stage, each ``MIN_CHUNK`` to ``MAX_CHUNK`` tokens (as
    measured, above); one stage: ``p.PREFILL_CHUNK`` (nothing to overlap). With a
    quantized KV cache that starts after some tokens (``kv_quant.start`` above 0):
    mlx-lm's own steps instead, chunks of ``p.PREFILL_CHUNK`` and the last token a step
    of its own, as its ``generate_step`` and ``BatchGenerator`` take them, so that
    each layer's cache is quantized at the step it would be there (``engine/kvquant.py``)."""
    if n <= 0:
        return []
    if kv_quant is not None and kv_quant.start > 0 and n > 1:
        return [min(p.PREFILL_CHUNK, n - 1 - at) for at in range(0, n - 1, p.PREFILL_CHUNK)] \
            + [1]
    if stages < 2:
        count = -(-n // p.PREFILL_CHUNK)
    else:  # as many as make chunks of the size wanted, none past the largest
        size = max(MIN_CHUNK, -(-n // (CHUNKS_PER_STAGE * stages)))
        count = max(1, n // size, -(-n // MAX_CHUNK))
    base, extra = divmod(n, count)
    return [base + 1] * extra + [base] * (count - extra)
