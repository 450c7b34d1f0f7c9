"""A pipeline stage whose compute is a tensor-parallel group: its layers split over the
ranks of an ``mx.distributed`` group, driven by rank 0.

Every rank loads the same slice of the model (``load_tensor_stage``: layers [start, end),
the embeddings on the first stage, norm and head on the last, as ``models/slicing.py``
prunes them) and lets mlx-lm split the layers it keeps (``model.shard(group)``: each
attention and MLP projection cut by heads or rows, their outputs summed over the group);
the embeddings and the head stay whole, as in ``engine/tensor.py``. A rank holds about
1/N of the slice's layer weights.

Rank 0 is ``StageLeader``: it runs ``compute.run_group`` as a one-process stage does, and
before each group shares with the followers, in order, what they need to take the same
step: the sequences opened since (``open``: each one's KV-cache recipe, so that the
followers make caches of the same kinds: ``sequences.stage_cache``), those dropped
(``drop``: their caches freed), and the group itself (each step's sequence, input blob,
sample flag and ``pos``, ``overlap``, and ``every``: whether it is a speculative pass
whose logits rank 0 wants at every position, ``compute.verifying``). A step's ``pos``
(a speculative pass's, ``speculating.py``) trims each rank's caches alike before it runs
(``compute.forward_group``), so that every rank's cache holds the tokens rank 0's holds;
on the last stage rank 0 alone holds the draft, whole, and accepts. A sequence's steps
are those whose ``SeqState`` is the one it was opened with: a step of a sequence dropped
(or dropped and opened again) while its group waited is left out on every rank, its
output None, so that no follower is ever asked for a sequence it freed. The followers
(``StageFollower``, ``run_stage_follower``) run ``compute.forward_group`` over the same
steps with the same merges and extracts (a group of several is one batch on every rank,
a group of one runs alone), so that every rank evaluates the same collectives in the
same order, and throw the outputs away: only rank 0 samples (the last stage) or sends
activations on. The
shares are ``engine/tensor.py``'s ``Mirror``, used as it is: the first over the ring
(``setup``: the slice, which every follower checks is its own), the others over the op
links, with its deadlines (``SHARE_DEADLINE_S`` a share, ``STEP_DEADLINE_S`` a step),
its heartbeats and its watchdog (a rank whose group broke ends its process, status
``EXIT_RING_BROKEN``, after ``on_broken`` is told). While no group runs, rank 0 shares
an empty log every ``BEAT_S`` from a thread of its own, so that a follower waiting for
its next step knows rank 0 lives (a follower hears nothing for the share deadline: it
fails, naming rank 0). A follower whose op link ends (rank 0 gone) fails at once with
``EngineError``; ``close`` on rank 0 ends every follower's loop cleanly.

The prompt cache is mirrored: rank 0's stage keeps entries under its bound like any stage
(its ``StageCache``'s bytes are its shard's), and rank 0 alone decides what is kept,
reused, evicted and forgotten. Its store tells each change to ``StageLeader`` (its
``kvstore.Journal``), which puts it in the op log in the order it was made, among the
sequences opened and dropped and the steps: an entry ``put`` from a sequence's caches
(a released one's, parked by its ``drop``; or the copy taken right after the step that
finished its prompt, parked by that step: ``snap``), entries ``forget``-ed (forgotten or
evicted), a store ``clear``-ed (another epoch's ``attach``, a router's store dropped,
the stage closing); and a sequence that starts from an entry is ``open``-ed naming it.
Each follower applies them to its ``kvmirror.MirroredCache``, so that every rank's
cache of a reused sequence holds the same tokens as rank 0's; one it cannot apply (an
entry it does not hold) parts the ranks: ``EngineError`` naming the stage, the entry and
the sequence, and the group ends as for any broken rank, never running without the cache.

A replayed sequence (``replay.py``) is a new sequence prefilled from its tokens: a tensor
stage runs it as any other. Inputs are checked before the share (token ids on the first
stage); what the wire checked on arrival (``input_spec``) is not checked again. A step
that fails on a rank after the share (a bug, never an input) parts the ranks: the
watchdog's deadlines end them.

Each step's input goes to every follower on its op link: a decode step's hidden state is
a few KiB, a prefill chunk's ``n x hidden_size`` values (across hosts, the followers
could later take it from the upstream stage themselves).

How it is wired (issue 32's 2D mesh; within one host so far: ``[serve] tp_size`` on a
stage host, ``workers/stage_tensor.py``): the stage worker is rank 0 (its
``StageSteps`` call ``StageLeader.run_group`` where they call ``compute.run_group`` and
skip a None output, its service makes a sequence's caches with ``caches`` and ``open``s
it at ``prepare``, ``drop``s it at ``release`` or ``forget``, and ``on_broken`` fails its
sequences); each other rank is a worker of its own on its host, ``stage-tp-<r>``
(``run_stage_follower``; ``Mirror``'s messages name it so: ``worker``), the ring joined with
``engine/ring.py``'s ``join_ring`` (127.0.0.1 inside one host). Across hosts
(``--tp-peers`` beside ``--pp-peer``, ``daemon/stage_peers.py``) each other rank is a
rank host's ``stage-tp-<r>`` worker, the ring on each host's agent IP. Not built yet: the
planner fitting a tensor stage's layers by dividing their weights by the group's size
(the embeddings and head whole, on every rank), and an assignment offer naming the
group (its ranks' hosts and ring ports) instead of each stage host's flags.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import mlx.core as mx

from mlxceld.engine.base import EngineError
from mlxceld.engine.tensor import SHARE_DEADLINE_S, Mirror, Op, barrier
from mlxceld.models.reading import Progress
from mlxceld.models.slicing import StageModel, load_stage
from mlxceld.pipeline.compute import (
    SeqState,
    Step,
    check_token_ids,
    forward_group,
    run_group,
    verifying,
)
from mlxceld.pipeline.kvmirror import MirroredCache
from mlxceld.pipeline.kvstore import Source, cloned, held_tokens
from mlxceld.pipeline.protocol import GroupBroken
from mlxceld.pipeline.sequences import stage_cache
from mlxceld.roles.options import KVQuant
from mlxceld.wire import Tensor

log = logging.getLogger(__name__)
__all__ = ["BEAT_S", "StageFollower", "StageLeader", "load_tensor_stage",
           "run_stage_follower"]

BEAT_S: Final = 0.5  # rank 0 idle this long: it shares an empty log (engine.local's IDLE_WAIT_S)

# The op log (rank 0 to its followers), each op a tuple: ("setup", start, end, layers,
# node_id) first, then ("open", seq_id, kv, reuse), kv (bits, group_size, start) or None,
# reuse (owner, entry, n) or None; ("drop", seq_id, park); ("step", overlap, every,
# ((seq_id, sample, pos, snap, name, dtype, shape, data), ...)); the prompt cache's
# ("put", owner, entry, n, (seq_id, prefilled), kept), ("forget", owner, entries) and
# ("clear", owner or None) (``kvmirror.py``); ("close",).


def load_tensor_stage(path: str, start: int, end: int, group: Any,
                      progress: Progress | None = None) -> StageModel:
    """Layers [start, end) of ``path`` split over ``group`` (``slicing.load_stage``'s
    ``group``), once every rank has read its slices. Every rank of the group calls it."""
    stage = load_stage(path, start, end, progress, group=group)
    mx.clear_cache()  # the whole tensors read before slicing: back to the system
    barrier(group)
    return stage


class StageLeader:
    """Rank 0 of a tensor-parallel stage: ``run_group`` as ``compute.run_group``, each group
    shared with the followers first (the module docstring). Thread-safe: a group, a beat
    and ``close`` each hold the group's lock; ``open``, ``drop`` and the prompt cache's
    changes (a stage's event loop: ``put``, ``dropped``, ``cleared``, its store's
    ``kvstore.Journal``) never wait for a step."""

    def __init__(self, model: StageModel, group: Any, *,
                 deadline_s: float = SHARE_DEADLINE_S, hosts: Sequence[str] = (),
                 beat_s: float = BEAT_S, node_id: str = "", worker: str = "tp") -> None:
        """Shares ``setup`` over the ring: each follower must be in ``StageFollower.run``
        (or come to it within mlx's own wait) for this to return. ``worker``: the prefix
        of the followers' worker names, as messages name them (``Mirror``)."""
        if group.rank() != 0:
            raise ValueError(f"a stage's leader is rank 0, not rank {group.rank()}")
        self.model = model
        self.node_id = node_id or f"[{model.start}, {model.end})"
        self._mirror = Mirror(group, deadline_s=deadline_s, hosts=hosts, worker=worker)
        self._lock = threading.Lock()  # held by a share and the step after it
        self._ops_lock = threading.Lock()  # held a moment: the ops pending, the open ones
        self._pending: list[Op] = []
        self._open: dict[str, SeqState] = {}  # by sequence: its rank 0's state
        self._closed = False
        self._failed: GroupBroken | None = None  # a beat's share that failed
        self._shared_at = time.monotonic()  # the last share's time (the beat's clock)
        with self._lock:
            self._share([("setup", model.start, model.end, model.num_layers,
                          self.node_id)])
        self._beat_s = beat_s
        self._stop = threading.Event()
        self._beater = threading.Thread(target=self._beat, daemon=True,
                                        name="mlxceld-stage-beat")
        self._beater.start()

    @property
    def size(self) -> int:
        return self._mirror.size

    @property
    def sequences(self) -> int:
        """Sequences open on every rank (after the next share)."""
        return len(self._open)

    def on_broken(self, told: Callable[[str], None] | None) -> None:
        """Tell ``told`` (on the watchdog's thread) why the group broke, before this
        process ends (``Mirror.on_broken``)."""
        self._mirror.on_broken = told

    def on_silent(self, told: Callable[[str | None], None] | None) -> None:
        """Tell ``told`` of a follower gone silent, None once all are heard again."""
        self._mirror.on_silent = told

    def caches(self, kv: KVQuant | None = None) -> list[Any]:
        """A new sequence's caches on rank 0: ``sequences.stage_cache``'s
        (``ProtocolViolation`` for a ``kv`` the model cannot keep); ``open`` it with them."""
        return stage_cache(self.model, kv, self.node_id)

    def open(self, seq_id: str, state: SeqState, kv: KVQuant | None = None,
             reuse: tuple[str, str, int] | None = None) -> None:
        """A new sequence, ``state`` its rank 0's (its caches from ``caches(kv)``, unused
        yet): the followers make theirs alike at the next share. Its steps are those whose
        ``state`` is this one, until ``drop``. ``reuse``: the prompt-cache entry it starts
        from, (owner, entry, n), whose caches and n are its ``state.reuse``."""
        if [type(c) for c in state.cache] != [type(c) for c in self.caches(kv)] \
                or any(getattr(c, "offset", 0) for c in state.cache):
            raise EngineError(f"tensor stage {self.node_id}: sequence {seq_id}'s caches "
                              f"are not new ones of kv {kv} (StageLeader.caches)")
        if (reuse is None) != (state.reuse is None) \
                or (reuse is not None and state.reuse is not None
                    and reuse[2] != state.reuse[1]):
            raise EngineError(f"tensor stage {self.node_id}: sequence {seq_id} opened "
                              f"naming prompt-cache entry {reuse} and starting from "
                              f"{None if state.reuse is None else state.reuse[1]} tokens")
        with self._ops_lock:
            self._check_open()
            if seq_id in self._open:
                raise EngineError(f"tensor stage {self.node_id}: sequence {seq_id} is "
                                  "open already (drop it first)")
            self._open[seq_id] = state
            recipe = None if kv is None else (kv.bits, kv.group_size, kv.start)
            self._pending.append(("open", seq_id, recipe, reuse))

    def drop(self, seq_id: str, *, park: bool = False) -> None:
        """A sequence released or forgotten: the followers free its caches at the next
        share (``park``: they keep them for the ``put`` this stage's prompt cache makes of
        them next, a release with ``keep``). Unknown ones are ignored (dropped twice,
        never opened here)."""
        with self._ops_lock:
            if self._open.pop(seq_id, None) is not None:
                self._pending.append(("drop", seq_id, park))

    # -- the prompt cache's journal (kvstore.Journal): its store's changes, in order --

    def put(self, owner: str, entry: str, n: int, source: Source, kept: bool) -> None:
        self._log(("put", owner, entry, n, source, kept))

    def dropped(self, owner: str, entries: list[str]) -> None:
        self._log(("forget", owner, tuple(entries)))

    def cleared(self, owner: str | None) -> None:
        self._log(("clear", owner))

    def _log(self, op: Op) -> None:
        with self._ops_lock:
            self._pending.append(op)

    def run_group(self, group: Sequence[Step], *, overlap: bool = False,
                  snap: Collection[str] = ()) -> list[Any]:
        """``compute.run_group`` on rank 0 with every follower taking the same step. A
        step of a sequence not open here (dropped while its group waited) is left out of
        the group on every rank, its output None. ``snap``: the sequences whose caches the
        caller copies after this step (``keep_prompt``): each follower copies its own
        alike, for the ``put`` of them that follows. Raises ``ValueError`` for bad token
        ids (nothing shared), ``EngineError`` when the group broke."""
        if self.model.first:
            check_token_ids(group, self.model.vocab_size)
        with self._lock:
            with self._ops_lock:
                self._check_open()
                live = [s for s in group if self._open.get(s.seq_id) is s.state]
                ops, self._pending = self._pending, []
            if not live:
                self._share(ops)
                return [None] * len(group)
            every = verifying(self.model, live)  # a speculative pass: (speculating.py)
            self._share([*ops, ("step", overlap, every, tuple(
                (s.seq_id, s.sample, s.pos, s.seq_id in snap, s.x.name, s.x.dtype,
                 tuple(s.x.shape), bytes(s.x.data)) for s in live))])
            with self._mirror.stepping():
                try:
                    outs = run_group(self.model, live, overlap=overlap)
                except RuntimeError as exc:  # mlx's: "[ring] connection to a peer was lost"
                    raise GroupBroken(f"tensor stage {self.node_id}: the group broke: "
                                      f"{self._mirror.explain(exc)}") from exc
        got = {id(s): out for s, out in zip(live, outs, strict=True)}
        if len(live) < len(group):
            log.info("tensor stage %s: steps of %s left out, their sequences dropped",
                     self.node_id, [s.seq_id for s in group if id(s) not in got])
        return [got.get(id(s)) for s in group]

    def close(self) -> None:
        """Share ``close`` (every follower's loop returns) and close the op links."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._mirror.share([*self._taken(), ("close",)])
            finally:
                self._mirror.close()
        self._beater.join()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"tensor stage {self.node_id} is closed")
        if self._failed is not None:
            raise self._failed

    def _taken(self) -> list[Op]:
        """The ops pending, taken for a share (the group's lock held)."""
        with self._ops_lock:
            ops, self._pending = self._pending, []
        return ops

    def _share(self, ops: list[Op]) -> None:
        try:
            self._mirror.share(ops)
        except GroupBroken:
            raise
        except EngineError as exc:  # a follower gone: its op link failed
            raise GroupBroken(f"tensor stage {self.node_id}: the group broke: {exc}") from exc
        self._shared_at = time.monotonic()

    def _beat(self) -> None:
        """Share an empty log (with what is pending) while no group runs (thread)."""
        while not self._stop.wait(self._beat_s / 2):
            if time.monotonic() - self._shared_at < self._beat_s \
                    or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed and self._failed is None:
                    self._share(self._taken())
            except GroupBroken as exc:  # a follower gone: the watchdog ends this process
                log.error("tensor stage %s: %s", self.node_id, exc)
                self._failed = exc
            finally:
                self._lock.release()


class StageFollower:
    """Rank 1..N-1 of a tensor-parallel stage: rank 0's steps on this rank's slices of
    the stage's layers, their outputs thrown away (the module docstring)."""

    def __init__(self, model: StageModel, mirror: Mirror, node_id: str = "") -> None:
        self._model = model
        self._mirror = mirror
        self._node_id = node_id or f"[{model.start}, {model.end})"
        self._states: dict[str, SeqState] = {}
        self.cache = MirroredCache(self._node_id)  # rank 0's prompt-cache entries
        self.steps = 0  # groups run (read from another thread: for the worker's stats)

    @property
    def sequences(self) -> int:
        """Sequences this rank holds caches of now."""
        return len(self._states)

    def run(self) -> None:
        """Follow until rank 0 shares ``close``; mlx raises ``RuntimeError`` when the ring
        breaks, ``EngineError`` where this rank cannot follow (rank 0 gone, or a bug)."""
        while True:
            for op in self._mirror.share([]):
                if op[0] == "close":
                    self._mirror.close()
                    return
                self._apply(op)

    def _apply(self, op: Op) -> None:
        if op[0] == "setup":
            _, start, end, layers, node_id = op
            own = (self._model.start, self._model.end, self._model.num_layers)
            if (start, end, layers) != own:
                raise EngineError(f"rank 0 runs stage [{start}, {end}) of {layers} layers "
                                  f"and this rank loaded [{own[0]}, {own[1]}) of {own[2]}")
            self._node_id = self.cache.node_id = node_id
        elif op[0] == "open":
            _, seq_id, recipe, reuse = op
            kv = None if recipe is None else KVQuant(*recipe)
            state = SeqState(stage_cache(self._model, kv, self._node_id), None)
            if reuse is not None:
                owner, entry, n = reuse
                state.reuse = self.cache.reuse(owner, entry, n, seq_id)
            self._states[seq_id] = state
        elif op[0] == "drop":
            _, seq_id, park = op
            dropped = self._states.pop(seq_id, None)
            if park and dropped is not None:
                self.cache.park((seq_id, False), dropped.cache)
        elif op[0] == "step":
            self._step(*op[1:])
        elif op[0] == "put":
            self.cache.put(*op[1:])
        elif op[0] == "forget":
            self.cache.dropped(op[1], list(op[2]))
        elif op[0] == "clear":
            self.cache.cleared(op[1])
        else:
            raise EngineError(f"rank 0 sent an op this rank does not know: {op[0]!r}")

    def _step(self, overlap: bool, every: bool, steps: Sequence[tuple[Any, ...]]) -> None:
        """Rank 0's group: each cache trimmed to its step's ``pos`` first (a speculative
        pass's rejected tail, as rank 0's: ``compute.forward_group``), its logits at every
        position where rank 0 verifies proposals (``every``); then the caches of those it
        ``snap``s copied, as rank 0 copies its own (``keep_prompt``)."""
        group, snaps = [], []
        for seq_id, sample, pos, snap, name, dtype, shape, data in steps:
            state = self._states.get(seq_id)
            if state is None:
                raise EngineError(f"rank 0 ran a step of sequence {seq_id}, which this "
                                  "rank never opened")
            group.append(Step(seq_id, state, 0, sample,
                              Tensor(name, dtype, tuple(shape), memoryview(data)), pos=pos))
            if snap:
                snaps.append((seq_id, state))
        with self._mirror.stepping():
            forward_group(self._model, group, overlap=overlap, every=every)
        for seq_id, state in snaps:
            self.cache.park((seq_id, True), cloned(state.cache, held_tokens(state.cache)))
        self.steps += 1


def run_stage_follower(path: str, start: int, end: int, group: Any, *,
                       progress: Progress | None = None,
                       ready: Callable[[], None] | None = None,
                       share_deadline_s: float = SHARE_DEADLINE_S,
                       made: Callable[[StageFollower], None] | None = None,
                       hosts: Sequence[str] = (), worker: str = "tp") -> None:
    """Rank ``group.rank()`` (≥ 1) of a tensor-parallel stage of layers [start, end) of
    ``path``: load this rank's slices, say ``ready()``, then take rank 0's steps until it
    closes the group. ``made``: given the ``StageFollower`` (its ``steps`` and
    ``sequences``, for the worker's stats) before ``ready``. Raises ``EngineError`` when
    the group breaks (rank 0 or another rank gone, or silent past the share deadline)."""
    model = load_tensor_stage(path, start, end, group, progress)
    follower = StageFollower(model, Mirror(group, deadline_s=share_deadline_s,
                                           hosts=hosts, worker=worker))
    if made is not None:
        made(follower)
    if ready is not None:
        ready()
    try:
        follower.run()
    except RuntimeError as exc:  # mlx's: "[ring] connection to a peer was lost"
        raise EngineError(f"tensor-parallel rank {group.rank()} of stage [{start}, {end}) "
                          f"lost the ring: {exc}") from exc
