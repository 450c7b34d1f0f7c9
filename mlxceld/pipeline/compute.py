"""A stage's compute: which queued steps run together, and running them.

Steps that wait in a stage's queue at the same moment are grouped: the first
one-token step (a decode step) of each of up to ``MAX_BATCH`` sequences whose caches
are of one kind runs as one batch through the stage's layers, their KV caches merged
for the step (mlx-lm's batch caches, left-padded; quantized ones: ``engine/kvquant.py``,
whose ``one_step`` keeps each step's caches of one kind) and split again after it.
Everything else (prefill chunks, a second step of a sequence already in the batch) runs
alone, in arrival order, so each sequence's steps keep their order: one of them after
each batch (``next_groups``), then the queue is read again, so that the sequences
decoding wait for one prefill chunk at a time, not for a whole long prompt.

A sequence that starts from a prompt-cache entry (``SeqState.reuse``, ``kvstore.py``)
gets its own copy of the entry's caches at its first step, on the compute side.

Batching is what lets a stage serve several sequences for little more than the
price of one on a machine whose step time is dominated by reading the weights.
It does not change what a sequence gets: on mlx's CPU backend a batched step gives
each sequence, bit for bit, what it gets alone (its ops act row by row, and the
zeros of the left padding are masked out and summed before its own keys, exactly),
and the last stage's log-probabilities are mlx-lm's, so greedy tokens under load
are mlx-lm's for each prompt alone, in bfloat16 too (tests/pipeline/test_compute.py,
test_loopback.py). On a GPU the batched kernels are not those of one sequence and may
round otherwise, as in mlx-lm's BatchGenerator, whose batch caches and masks these are
(not measured here).

On the last stage a constrained sequence's log-probabilities are masked by its matcher
(``engine/constraints.py``) before its sampler picks, and the matcher then consumes the
token picked.

Runs one group at a time, on the stage's compute thread or (short decode
steps) its event loop's thread: a sequence's caches may be made on one and used
on the other, which mlx orders by each array's dependencies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar

from mlxceld.pipeline.kvstore import cloned, held_tokens
from mlxceld.wire import Tensor
from mlxceld.wire.mx_tensors import from_blob, to_blob

if TYPE_CHECKING:
    from mlxceld.engine.constraints import Matching
    from mlxceld.pipeline.speculating import SpecState

MAX_BATCH: Final = 16
S = TypeVar("S", bound="Step")


class StageModelLike(Protocol):
    """What the compute needs of the stage's model slice (``models.slicing.StageModel``)."""

    first: bool
    last: bool
    hidden_size: int
    vocab_size: int

    def make_cache(self) -> list[Any]: ...

    def forward(self, x: Any, cache: list[Any], *, overlap: bool = False,
                raw: bool = False, caches_only: bool = False,
                every: bool = False) -> Any: ...


@dataclass
class SeqState:
    """A sequence on this stage. On the last stage: its sampler and logits processors
    (``engine/processors.py``) with the request's parameters, the history they look back
    on (the prompt's tail from ``prepare``, then each token sampled), and how many top
    alternatives each token's log-probabilities carry (None: none asked)."""

    cache: list[Any]  # one mlx-lm cache per own layer
    sampler: Callable[[Any], Any] | None
    processors: list[Callable[[Any, Any], Any]] = field(default_factory=list)
    history: list[int] = field(default_factory=list)
    logprobs: int | None = None
    matching: Matching | None = None  # the last stage's, when the output is constrained
    # A prompt-cache entry's caches and how many of their tokens to start from: the
    # sequence's own copy of them (``kvstore.cloned``) is made at its first step.
    reuse: tuple[list[Any], int] | None = None
    spec: SpecState | None = None  # the last stage's, when it speculates (speculating.py)


@dataclass(frozen=True)
class Sampled:
    """What the last stage sampled for one step."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Drafted:
    """The last stage's output for a sampling step of a speculating sequence
    (``speculating.py``): the tokens it gives (one, or those a pass kept), the draft's
    proposals to run after the last of them, and the position that last token goes to
    (None: where the caches end)."""

    tokens: tuple[Sampled, ...]
    drafts: tuple[int, ...] = ()
    pos: int | None = None


@dataclass
class DraftClock:
    """A last stage's time in its draft (its proposals, catch-ups included: ``speculating
    .py``), for its stats: what drafting costs a pass there."""

    seconds: float = 0.0  # waited for the draft (drafting ahead runs meanwhile)
    ahead: int = 0  # passes whose proposals had been drafted ahead (speculating.py)


@dataclass
class Step:
    seq_id: str
    state: SeqState
    step: int
    sample: bool
    x: Tensor  # token ids [1, n] or hidden states [1, n, H], checked, a view of the message
    # Where the step starts: the caches are trimmed to it first (a speculative pass's
    # rejected tail); the step's token ids, passed on to the last stage (speculating.py).
    pos: int | None = field(default=None, kw_only=True)
    ids: Tensor | None = field(default=None, kw_only=True)

    @property
    def tokens(self) -> int:
        return self.x.shape[1]


def plan(steps: Sequence[S]) -> list[list[S]]:
    """Groups to run in order: one batch of first-in-line decode steps, then the rest
    one by one in arrival order."""
    batch, rest = _split(steps)
    groups = [batch] if batch else []
    return groups + [[s] for s in rest]


def next_groups(steps: Sequence[S]) -> tuple[list[list[S]], list[S]]:
    """What to run now, and what waits for the next round (with what arrives meanwhile):
    the batch of first-in-line decode steps and the first of the other steps (a prefill
    chunk, in arrival order), so that neither decoding nor a long prompt waits for the
    other for longer than one step."""
    batch, rest = _split(steps)
    groups = ([batch] if batch else []) + [[s] for s in rest[:1]]
    return groups, rest[1:]


def _split(steps: Sequence[S]) -> tuple[list[S], list[S]]:
    batch: list[S] = []
    rest: list[S] = []
    seen: set[str] = set()
    for s in steps:
        if s.tokens == 1 and s.seq_id not in seen and len(batch) < MAX_BATCH \
                and (not batch or _kinds(s) == _kinds(batch[0])):
            batch.append(s)
        else:
            rest.append(s)
        seen.add(s.seq_id)
    return batch, rest


def _kinds(step: Step) -> tuple[type, ...]:
    """Its caches' kinds: only caches of one kind merge (quantizing ones or not)."""
    return tuple(type(c) for c in step.state.cache)


def run_group(model: StageModelLike, group: Sequence[Step], *,
              overlap: bool = False) -> list[Any]:
    """Run ``group`` (one step per sequence); per step: a hidden-state blob for the next
    stage, or on the last stage what was sampled (``Sampled``; ``None`` where not sampled;
    ``Drafted`` for a speculating sequence: ``speculating.py``).
    ``overlap``: see ``StageModel.forward`` (for long steps)."""
    every = verifying(model, group)
    out = forward_group(model, group, overlap=overlap, every=every)
    if out is None:
        return [None] * len(group)
    if not model.last:
        return [to_blob("hidden", out[j:j + 1]) for j in range(len(group))]
    from mlxceld.pipeline.speculating import run_speculating

    if every:
        return [run_speculating(group[0], out, None)]
    return [run_speculating(s, None, x) if s.state.spec is not None and x is not None else x
            for s, x in zip(group, sample_group(group, out), strict=True)]


def verifying(model: StageModelLike, group: Sequence[Step]) -> bool:
    """Whether ``group`` is a speculative pass on the last stage: one step running a
    draft's proposals (with the token ids its draft reads), whose logits are wanted at
    every position. Decided before the step runs: what a tensor-parallel stage's rank 0
    tells its followers (``tensor_stage.py``), so that their forwards match its own."""
    spec = group[0].state.spec
    return (model.last and len(group) == 1 and spec is not None and bool(spec.proposed)
            and step_ids(group[0], model.first) is not None)


def step_ids(step: Step, first: bool) -> list[int] | None:
    """The step's token ids: its input on the first stage, else what the first sent on."""
    t = step.x if first else step.ids
    return None if t is None else list(t.data.cast("B").cast("i"))


def forward_group(model: StageModelLike, group: Sequence[Step], *,
                  overlap: bool = False, every: bool | None = None) -> Any:
    """``run_group``'s forward: ``group``'s steps through the stage's layers, each
    sequence's caches first trimmed to its step's ``pos`` (a speculative pass's rejected
    tail), one batch (caches merged, then extracted) or one step alone; the hidden states
    [b, n, H] (evaluated), or on the last stage the raw logits [b, vocab] (``every``: of
    every position, [1, n, vocab], a speculative pass's; None: ``verifying``), or None
    where only the caches were wanted (the last stage's steps that sample nothing).
    Everything it evaluates is decided by the steps' inputs, positions, sample flags,
    ``overlap`` and ``every`` alone: every rank of a tensor-parallel stage runs it alike,
    so that their collectives pair up and their caches hold the same tokens
    (``tensor_stage.py``)."""
    import mlx.core as mx

    from mlxceld.engine.kvquant import one_step

    if every is None:
        every = verifying(model, group)
    if model.first:
        check_token_ids(group, model.vocab_size)
    for s in group:
        if s.state.reuse is not None:  # its first step: from a prompt-cache entry
            s.state.cache = cloned(*s.state.reuse)
            s.state.reuse = None
        offset = held_tokens(s.state.cache)
        if s.pos is not None and offset > s.pos:  # a pass's rejected tail
            from mlx_lm.models.cache import trim_prompt_cache

            trimmed: Any = trim_prompt_cache(s.state.cache, offset - s.pos)  # an int
            if trimmed != offset - s.pos:
                raise ValueError(f"its KV cache cannot be trimmed back to position {s.pos} "
                                 "(a sliding window's), which speculative decoding needs")
        if model.last and s.state.spec is not None:
            ids = step_ids(s, model.first)
            if ids is None:  # no ids to draft from: a plain sequence from now on
                s.state.spec = None
            else:
                s.state.spec.read(offset, s.pos, ids)
    xs = [from_blob(s.x) for s in group]
    x = xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=0)
    # The last stage's prefill chunks that sample nothing want only their caches.
    only = model.last and not any(s.sample for s in group)
    if len(group) == 1:
        with one_step(group[0].state.cache):
            if model.last and every:
                return model.forward(x, group[0].state.cache, overlap=overlap, raw=True,
                                     every=True)
            return model.forward(x, group[0].state.cache, overlap=overlap, raw=model.last,
                                 caches_only=only)
    layers = len(group[0].state.cache)
    merged = [group[0].state.cache[i].merge([s.state.cache[i] for s in group])
              for i in range(layers)]
    with one_step(merged):
        out = model.forward(x, merged, overlap=overlap, raw=model.last, caches_only=only)
    for j, s in enumerate(group):
        s.state.cache = [c.extract(j) for c in merged]
    mx.eval([(c.keys, c.values) for s in group for c in s.state.cache])
    return out


def sample_group(group: Sequence[Step], logits: Any) -> list[Sampled | None]:
    """The last stage's sampling of ``logits`` [len(group), vocab] (raw, the model's dtype):
    each sampling step's processors over its history, the log-softmax of the batch as
    mlx-lm's ``BatchGenerator`` computes it (processed rows concatenated), its sampler."""
    import mlx.core as mx

    from mlxceld.engine.sampling import read_logprobs
    from mlxceld.models.slicing import log_softmax

    if any(s.sample and (s.state.processors or s.state.matching) for s in group):
        rows = []
        for j, s in enumerate(group):
            row = logits[j:j + 1]
            if s.sample and s.state.processors:
                history = mx.array(s.state.history, dtype=mx.int32)
                for processor in s.state.processors:
                    row = processor(history, row)
            if s.sample and s.state.matching is not None:  # the constraint's mask goes last
                row = s.state.matching.mask(row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    logprobs = log_softmax(logits)
    out: list[Sampled | None] = []
    for j, s in enumerate(group):
        if not s.sample:
            out.append(None)
            continue
        assert s.state.sampler is not None
        token = int(s.state.sampler(logprobs[j:j + 1]).item())
        if s.state.processors:
            s.state.history.append(token)
        if s.state.matching is not None:
            s.state.matching.advance([token])
        if s.state.logprobs is None:
            out.append(Sampled(token))
        else:
            out.append(Sampled(token, *read_logprobs(logprobs[j], token, s.state.logprobs)))
    return out


def check_token_ids(group: Sequence[Step], vocab_size: int) -> None:
    """Every token id of ``group`` in [0, vocab_size), checked on the wire bytes (i32, as
    the envelope's spec checked) before mlx sees them."""
    for s in group:
        ids = s.x.data.cast("B").cast("i")
        low, high = min(ids), max(ids)
        if not 0 <= low <= high < vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size}); got {low}..{high}")
