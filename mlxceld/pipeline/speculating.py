"""Speculative decoding across a pipeline: the last stage's draft proposes, every stage
verifies the proposals in one pass.

The draft (``[serve] draft_model``, ``engine/speculative.py``'s ``Draft``) runs on the
last stage's host, in its stage worker: the last stage samples each token and sends it
to the first stage itself (``next``), so drafting there adds no hop to a pass, where
drafting at the router would add one (last → router → first instead of last → first),
and the router holds no model. Its cost is the draft's k steps a pass on the last
stage's host (bench/speculative.py prints it): measured on the small fixture's agreeing
pair (its one-layer draft carries the target's embedding and head), k = 4, 2 CPUs shared
by everything, 23 ms a pass with the stages in one process (each stage's 5-position step
26.5 and 31 ms, against 16.4 and 17.6 ms for one token), 38-43 ms with the stages in their
own daemons beside the router and the client on a loaded host. A hop is about 1-3 ms
there: drafting at the router would add one to every pass and save nothing on the last
stage's host, which is idle while the first stage runs the pass.

A pass: the last stage, having sampled (or accepted up to) token ``t``, drafts
``d_1..d_k`` and sends ``[t, d_1..d_k]`` to the first stage as the sequence's next step,
with ``pos``, the position ``t`` goes to. Every stage trims its caches to ``pos``
(mlx-lm's ``trim_prompt_cache``: the rejected tail of the pass before) and runs the k+1
positions as one step, like a prefill chunk; the first stage sends the step's token ids
on with its activations (``act``'s ``tokens``) so that the last stage's draft reads every
token of the sequence. The last stage gets the logits of all k+1 positions, accepts by
``engine/speculative.py``'s rules (greedy: exactly the target's own tokens; above
temperature 0 the rejection rule), sends each token kept to the router (one ``token``
each, numbered on from the first: the router reads them as without a draft), and drafts
the next pass from the last. The draft's own cache is trimmed alike.

Drafting ahead (``SpecState.ahead``; every last stage but a one-stage pipeline's, whose
next step runs at once): the last stage's host is idle while a pass is away at the
other stages, so as it sends a pass (while its passes keep more than ``AHEAD_WORTH`` of
their proposals, the latest pass weighing half: else the work is likely lost, and on a
shared host it slows the other stages) it starts drafting the pass after it, on the
draft's own thread (``Drafter``), as if every proposal will be kept: the draft's guess
at the target's token after them, then k proposals after that guess. When the pass
comes back with every proposal kept and the target's token equal to that guess, those
proposals go out at once, the draft's k steps off the pass's critical path; otherwise
they are dropped (the draft's cache is trimmed back to what was kept, as after any
pass) and the next proposals are drafted then. Sampling, the drafted-ahead proposals
are draws from the draft's distributions given the very context the pass then has, so
the rejection rule holds as for proposals drafted after it. Greedy output is the same
either way; on one host shared with the other stages, the drafting ahead competes with
them for its cores (bench/speculative.py measures both). The stats' ``drafted_ahead``
counts the passes whose proposals were ready. Measured (the small fixture's agreeing
pair, k = 4, 256 tokens, each stage's worker on a CPU of its own: ``--pin``): the last
stage waited 19.4 ms a pass for its draft without drafting ahead, 2.1 ms with it (47 of
56 passes drafted ahead); 2 stages gave 1.80x the no-draft decode rate without it,
2.42x with it; 2.54x (0.9 ms, 49 of 54 passes) once the draft broke bfloat16's ties as
the target does (``engine/speculative.py``'s ``propose``: acceptance 0.96 before, 1.00).

A stage that is a tensor-parallel group (``tensor_stage.py``, the 2D mesh) runs its
passes alike on every rank: its rank 0 shares each step's ``pos`` with its followers, who
trim their caches to it as rank 0 does (``compute.forward_group``), and whether the step
verifies proposals (``compute.verifying``: the logits of every position, one forward over
the k+1 positions), so that every rank's collectives pair up and its cache holds the same
tokens. The last stage's draft is its rank 0's alone, whole (as ``engine/solo.py``'s):
splitting a small draft would add a collective a draft token.

When a sequence speculates (``SpecState``, made at the last stage's ``prepare``): its
request is one the target alone would serve the same way without per-step state
(``Draft.takes``: no logits processors, no constraint, no seed above temperature 0).
Each of its passes proposes only while it is the only sequence the last stage holds
(``allowed``, set by ``steps.py``); with others, it runs plain one-token steps batched
with theirs, and proposes again once alone. While it may propose, ``engine/pacing.py``
measures its tokens per second with proposals and without (a pass timed from one
sampling to the next, on the last stage) and backs off a draft that does not pay.

Chunked prefill runs as without a draft (the draft catches up on the prompt at the first
proposal, in chunks); a prompt-cache reuse starts the draft from the tokens after the
kept prefix (the stages send no ids of it): output unchanged, proposals from a shorter
context. A kept entry never holds a rejected position: a ``keep`` trims to the tokens
the router has, all accepted.

With a quantized KV cache (``[serve] kv_bits``, the ``prepare``'s ``kv``) every stage's
caches quantize as without a draft (``engine/kvquant.py``: trimmed back, a cache holds
what one that never held the rejected tail would; ``one_step`` quantizes a step's caches
as it begins, after the trim), and a pass never runs at full precision past the position
where one-token steps would quantize (``quantized_kv_start``: ``plain_room``, as in the
local engine), so greedy tokens with a draft are those without, with the same kv_bits.
The draft's own cache stays plain.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxceld.engine.pacing import Pacing
from mlxceld.engine.sampling import read_logprobs, sampling_logits
from mlxceld.engine.speculative import Draft, accept, plain_room, propose, rewind
from mlxceld.pipeline.compute import DraftClock, Drafted, Sampled

if TYPE_CHECKING:
    from mlxceld.engine.base import SamplingParams

log = logging.getLogger(__name__)

CATCH_UP: int = 512  # tokens of the draft's catch-up on a prompt per forward
AHEAD_WORTH = 0.5  # drafting ahead while a sequence's passes keep more (SpecState.kept)
T = TypeVar("T")

class Drafter:
    """The one thread the last stage's draft runs on, on a stream of its own (the draft's
    caches are its): ``submit`` a job, wait on its future. A daemon thread that never
    ends: mlx ends the process at exit (a C++ ``terminate``) when arrays a model made on
    a thread's stream outlive that thread, as a draft's caches may."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] \
            = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="mlxceld-draft").start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        stream = mx.new_stream(mx.default_device())
        while True:
            future, fn, args = self._jobs.get()
            try:
                with mx.stream(stream):
                    future.set_result(fn(*args))
            except BaseException as exc:  # the waiter raises it (the step fails)
                future.set_exception(exc)


_drafter: Drafter | None = None
_made = threading.Lock()


def drafter() -> Drafter:
    """This process's ``Drafter``, made at its first use."""
    global _drafter
    with _made:
        if _drafter is None:
            _drafter = Drafter()
        return _drafter


# What a pass drafted ahead gives, once done: the context it assumed (the pass's tokens
# all accepted, and the draft's guess at the target's token after them), the tokens it
# drafted (that guess first) and, sampling, their draft distributions.
Ahead = tuple[list[int], list[int], list[Any]]


@dataclass
class SpecState:
    """A speculating sequence on the last stage: its draft's cache and what it read."""

    draft: Draft
    params: SamplingParams
    vocab_size: int
    eos: frozenset[int]
    cache: list[Any] = field(default_factory=list)  # the draft's
    held: list[int] = field(default_factory=list)  # the tokens the draft's cache holds
    ids: list[int] = field(default_factory=list)  # tokens at positions base, base + 1, ...
    base: int | None = None  # the target's cache offset at the sequence's first step
    allowed: bool = False  # alone on the stage: this pass may propose (steps.py)
    proposed: list[int] = field(default_factory=list)  # in the step on its way round
    q: list[Any] = field(default_factory=list)  # their draft distributions (sampling)
    generated: int = 0
    began: float | None = None  # when the pass on its way round was sent
    clock: DraftClock = field(default_factory=DraftClock)  # the stage's, shared
    ahead: bool = False  # draft the pass after next while this one is away (module doc)
    pacing: Pacing = field(init=False)
    drafting: Future[Ahead] | None = None  # the pass after next, drafted ahead
    # The share of proposals its passes kept, the latest weighing half: drafting ahead
    # is worth its work above AHEAD_WORTH.
    kept: float = 1.0

    def __post_init__(self) -> None:
        self.cache = make_prompt_cache(self.draft.model)
        self.pacing = Pacing(self.draft.k)
        self._scale = None if self.params.temperature == 0 \
            else sampling_logits(self.params, self.vocab_size)

    def read(self, offset: int, pos: int | None, ids: list[int] | None) -> None:
        """A step about to run from cache ``offset`` (trimmed to ``pos``), its ids."""
        if self.base is None:
            self.base = offset
        if pos is not None:
            del self.ids[max(0, pos - self.base):]
        self.ids.extend(ids or [])

    def verify(self, logits: Any) -> tuple[list[int], Any, int]:
        """The tokens a pass keeps from its logits [k+1, vocab] (the proposals it ran,
        ``proposed``): theirs accepted, then the target's; their log-probabilities [.., V];
        how many proposals were accepted."""
        k = len(self.proposed)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        n, last = accept(logprobs, self.proposed, self.q, self._scale)
        kept = [*self.proposed[:n], last]
        del self.ids[len(self.ids) - k + n:]  # the rejected proposals
        if k:
            self.kept = (self.kept + n / k) / 2
        self.draft.count(k, n, len(kept))
        return kept, logprobs.astype(mx.float32), n

    def propose(self, last: int, room: int) -> list[int]:
        """The next pass's proposals after ``last`` (none: a plain step): while allowed,
        as paced, short of ``max_tokens``, the end of the sequence and ``room``
        (``plain_room``: a quantized KV cache's start). Taken from what was drafted
        ahead when the pass before kept every proposal and the draft's guess after them;
        else drafted now. Then, with ``ahead``, the pass after this one is drafted on the
        draft's thread while this one is away."""
        left = self.params.max_tokens - self.generated
        k = min(self.pacing.k(), left - 1, room) \
            if self.allowed and last not in self.eos else 0
        self.proposed, self.q = [], []
        start = time.perf_counter()
        try:
            # The draft's cache is the thread's until what it drafted ahead is done.
            pending, self.drafting = self.drafting, None
            try:
                got = None if pending is None else pending.result()
            except Exception:  # drafted now instead (its cache trims to what it holds)
                log.exception("drafting ahead failed")
                got = None
            if k <= 0:
                return []
            context = [*self.ids, last]
            if got is not None and got[0] == context and len(got[1]) > k:
                self.clock.ahead += 1
                self.proposed, self.q = got[1][1:k + 1], got[2][1:k + 1]
            else:
                self.proposed, self.q = drafter().submit(self._drafted, context, k).result()
            if self.ahead and self.kept > AHEAD_WORTH and left - 1 - k > 1:  # one may follow
                self.drafting = drafter().submit(self._ahead, [*context, *self.proposed], k)
            return list(self.proposed)
        finally:
            self.clock.seconds += time.perf_counter() - start

    def _ahead(self, base: list[int], k: int) -> Ahead:
        """The draft's guess after ``base`` (a pass's context and proposals) and ``k``
        proposals after that guess (on the draft's thread)."""
        tokens, q = self._drafted(base, k + 1)
        return [*base, tokens[0]], tokens, q

    def _drafted(self, context: list[int], k: int) -> tuple[list[int], list[Any]]:
        """``k`` proposals after ``context`` and, sampling, their distributions: the
        draft's cache trimmed to what it holds of ``context`` and caught up on the rest
        first (on the draft's thread: ``drafter``)."""
        same = next((i for i, (a, b) in enumerate(zip(self.held, context, strict=False))
                     if a != b), min(len(self.held), len(context)))
        same = min(same, len(context) - 1)  # the last token is the first step's input
        rewind(self.cache, same)
        del self.held[same:]
        at = same
        while len(context) - at > 1:  # its caches only (no head): a prompt in chunks
            size = min(CATCH_UP, len(context) - 1 - at)
            self.draft.model(mx.array(context[at:at + size])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            at += size
        y = mx.array(context[at:], dtype=mx.uint32)
        drafted, q = propose(self.draft.model, y, self.cache, k, self._scale)
        tokens: list[int] = mx.concatenate(drafted).tolist()  # type: ignore[assignment]
        # Evaluated here: the pass is verified on another thread.
        mx.eval(q, [c.state for c in self.cache])
        self.held += [*context[same:], *tokens[:-1]]
        return tokens, q

    def paced(self, tokens: int) -> None:
        """A pass that gave ``tokens`` ended now: timed from when it was sent, while
        alone (a pass run among others says nothing of the draft)."""
        now = time.perf_counter()
        if self.began is not None and self.allowed:
            self.pacing.record(tokens, now - self.began)
        self.began = now


def run_speculating(step: Any, logits: Any, sampled: Sampled | None) -> Drafted:
    """A speculating sequence's sampling step on the last stage: ``logits`` [1, k+1, V]
    of a pass with proposals (``sampled`` None), or ``sampled`` the token of a plain
    step; the tokens given, and the next pass's proposals."""
    spec: SpecState = step.state.spec
    if sampled is None:
        kept, logprobs, _ = spec.verify(logits[0])
        asked = spec.params.logprobs
        out = tuple(Sampled(t) if asked is None else Sampled(t, *read_logprobs(
            logprobs[i], t, asked)) for i, t in enumerate(kept))
    else:
        out = (sampled,)
    spec.generated += len(out)
    spec.paced(len(out))
    last = out[-1].token
    assert spec.base is not None
    pos = spec.base + len(spec.ids)
    drafts = spec.propose(last, plain_room(step.state.cache, pos + 1))
    spec.ids.append(last)
    return Drafted(out, tuple(drafts), pos)
