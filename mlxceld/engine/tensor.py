"""Tensor parallelism inside one host: the model's layers split over the ranks of an
``mlx.distributed`` group, driven by rank 0's engine.

Every rank loads the model lazily, lets mlx-lm split it (``model.shard(group)``: each
attention and MLP projection sharded by heads or rows, their outputs summed over the
group), and then reads only its own slices. A rank holds about 1/N of the layers'
weights, plus the embedding and the head, which stay whole.

Rank 0 is a ``LocalEngine`` with a ``Mirror``; ranks 1..N-1 run ``run_tensor_follower``.
Every rank has its own mlx-lm ``BatchGenerator`` and prompt cache, and all of them must
take the same batch steps in the same order, since each step's collectives pair up
across the ranks. So, on rank 0's step thread, before each step:

- rank 0 shares its *op log* since the last step with the followers: each sequence
  inserted (its prompt tokens, ``max_tokens``, how many prompt tokens its prompt cache
  spared, whether it samples greedily) and each removed (cancelled). The first log goes
  over the ring (two ``all_sum``s: its size, then its pickled bytes, as mlx-lm's own
  server does) and says where rank 0 takes the *op links*, a TCP connection from each
  follower to rank 0 on its ring host (127.0.0.1 inside one host; the follower proves
  itself with a token from that first log); later logs are length-prefixed pickles there. mlx's ring
  busy-polls a core while a rank waits in a collective: a follower waiting on its link
  for rank 0's next step waits in the kernel instead, so an idle group costs no CPU.
  The followers apply the same ops to their generators, so that the ranks' batches,
  uids and prompt caches stay equal; a follower whose prompt cache would spare another
  count than rank 0's, or whose generator hands out another uid, stops with an
  ``EngineError`` (a bug, never an input: the group restarts).
- every rank then runs ``BatchGenerator.next()``. The model's collectives make the
  logits the same on every rank. Rank 0 alone applies the requests' logits processors,
  constraints and samplers; its sampled tokens go to the followers with one ``all_sum``
  per sampler call (followers add zeros), so every rank feeds the same tokens into the
  next step and ends each sequence on the same step. The sampler calls are made in the
  same pattern on every rank: one call for a batch whose sequences all sample greedily,
  else one per row (see ``Mirror.sampler``), and each call's ``all_sum`` is chained to
  the previous one, so the ranks' collectives are queued in one order.

While rank 0 has no sequence it shares an empty op log every ``engine.local.IDLE_WAIT_S``
(0.5 s): a heartbeat, through which a rank that died is seen (its link fails) and the
engine fails, so its worker exits and the daemon restarts the group; a follower whose
link ends (rank 0 gone) fails at once. When rank 0 closes, it shares ``close`` and every
follower returns.

A peer lost in the middle of a step is not always raised: mlx then fails the step's
pending work on its stream's thread and the next wait on that stream never ends. So a
watchdog thread ends the rank's process at once (``EXIT_RING_BROKEN``, why written to
stderr: its worker's log; nothing in it can go on) when rank 0 sees a follower's op link
close (looked at every ``LINK_POLL_S``), when a share but the first takes longer than
``SHARE_DEADLINE_S``, or a step longer than ``STEP_DEADLINE_S``; rank 0's requests are
failed first, naming why (``EngineUnavailable``: 503 naming the rank), and get
``BROKEN_GRACE_S`` to be answered (a group's restart gives each member a moment after
SIGTERM for it: ``supervisor/groups.py``). The daemon restarts the whole group as soon
as any rank exits, so the deadlines are only the bound for a rank whose peers all
still run.

A follower stopped (SIGSTOP) or hung neither exits nor closes its link, so each one
beats on it and rank 0's watchdog names one silent after ``heartbeats.SILENCE_S`` (3 s,
a pipeline's bound): ``on_silent`` (rank 0's requests fail, 503 naming the rank, while
it is silent); its worker's failed health probes then restart the group.

Not under tensor parallelism: the KV handoff of prefill/decode disaggregation
(``LocalEngine.prefill`` and ``generate_from`` refuse).

Ring: ``engine/ring.py``'s ``join_ring`` (re-exported here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import secrets
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import mlx.core as mx
import numpy as np

from mlxceld.engine.base import EngineError, EngineUnavailable
from mlxceld.engine.heartbeats import RankSilence, beat
from mlxceld.engine.ring import BACKEND, RING_DEADLINE_S, join_ring
from mlxceld.engine.sampling import Sampler, greedy
from mlxceld.models.reading import Progress, model_layers, read_weights
from mlxceld.roles.options import DEFAULT_DRAFT_TOKENS, KVQuant

log = logging.getLogger(__name__)
__all__ = ["BACKEND", "RING_DEADLINE_S", "Mirror", "join_ring", "load_shard",
           "load_tensor_engine", "run_tensor_follower"]

# A share waits for the slowest rank to finish the step they all take: this long at most.
SHARE_DEADLINE_S: Final = 60.0
# One batch step (a prefill chunk of every new prompt, one decode step): this long at most.
STEP_DEADLINE_S: Final = 600.0
LINK_POLL_S: Final = 0.1  # how often rank 0 reads its followers' op links (beats, or an end)
CLOSE_DRAIN_S: Final = 5.0  # rank 0 closing: for each follower to close its op link first
BROKEN_GRACE_S: Final = 1.0  # for rank 0's requests to hear why, before its process ends
GROUP_RETRY_S: Final = 5  # Retry-After of a request a broken or stalled group refuses
EXIT_RING_BROKEN: Final = 1  # the status a rank ends with when its share is past its deadline

# An op of the log: ("setup", eos, max_batch, prefill_step, kv_quant) first, then
# ("insert", uid, tokens, max_tokens, spared, greedy), ("remove", uid), ("close",), and a
# speculating sequence's ("spec", ...), ("spec_run", ...), ("spec_join", ...) and
# ("spec_end", ...) (``engine/solo.py``).
Op = tuple[Any, ...]


def load_shard(path: str, group: Any, progress: Progress | None = None
               ) -> tuple[Any, dict[str, Any]]:
    """The model at ``path`` split over ``group`` (mlx-lm's ``shard``), with only this
    rank's slices read; and its config. Every rank of the group must call it."""
    from mlx_lm.utils import load_model

    model, config = load_model(Path(path), lazy=True)
    if not hasattr(model, "shard"):
        raise EngineError(f"mlx-lm has no tensor-parallel split for model type "
                          f"{config.get('model_type')!r} ({path}); serve it with tp_size 1")
    model.shard(group)
    read_weights(model_layers(model), model, progress)
    mx.clear_cache()  # the whole tensors read before slicing: back to the system
    barrier(group)
    return model, config


def barrier(group: Any) -> None:
    """Return once every rank of ``group`` has come here."""
    mx.eval(mx.distributed.all_sum(mx.array([1], dtype=mx.int32), group=group,
                                   stream=mx.cpu))


class Mirror:
    """One rank's side of the op log and of the sampled tokens (the module docstring)."""

    def __init__(self, group: Any, *, deadline_s: float = SHARE_DEADLINE_S,
                 hosts: Sequence[str] = (), worker: str = "tp") -> None:
        """``worker``: the prefix of the follower workers' names (``tp-<rank>``, a tensor
        stage's ``stage-tp-<rank>``), as messages name a rank."""
        self.group = group
        self.hosts = tuple(hosts)  # the ring's host:port per rank: rank 0's host links
        self.worker = worker
        self.rank: int = group.rank()
        self.size: int = group.size()
        self._deadline_s = deadline_s
        self._since: float | None = None  # when the share or step under way began
        self._limit = deadline_s  # how long that one may take
        self._armed = False  # whether shares have a deadline yet (from the second on)
        self._watchdog: threading.Thread | None = None
        self._links: dict[int, socket.socket] | None = None  # the op links, by peer rank
        # Told (on the watchdog's thread) why the group broke, before this process ends.
        self.on_broken: Callable[[str], None] | None = None
        # Rank 0: told (on the watchdog's thread) that a rank went silent, and why; None
        # once every rank is heard again (``heartbeats.py``).
        self.on_silent: Callable[[str | None], None] | None = None
        self._silence: RankSilence | None = None  # rank 0's, once the op links are up
        self._closing = False  # rank 0 shared "close": the followers' links end now
        # The last token share (the chain); made on the step thread, where its stream is.
        self._last: mx.array | None = None
        self._greedy: Sampler = self._lead(greedy) if self.leader else self._follow()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def who(self, rank: int) -> str:
        """A rank as messages name it: its worker, and its host when not rank 0's."""
        host = self.hosts[rank].rpartition(":")[0] if len(self.hosts) > rank else ""
        away = host and host != self.hosts[0].rpartition(":")[0]
        return f"rank {rank} (worker {self.worker}-{rank}{f' on {host}' if away else ''})"

    def share(self, ops: list[Op]) -> list[Op]:
        """Rank 0: send ``ops``; a follower: receive rank 0's (its own ``ops`` unused).
        The first share goes over the ring: call it on the generator's stream (``with
        mx.stream(gen.stream)``), so that its collective queues in the same order on every
        rank; the later ones go over the op links, outside mlx."""
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name="mlxceld-ring-watchdog")
            self._watchdog.start()
        # The first share has no deadline: rank 0 builds its engine (tokenizer, constraint
        # tables) after the load's barrier while the followers wait in it.
        outer = self._limit, self._since  # a step's (a share inside a speculative one)
        self._limit = self._deadline_s
        self._since = time.monotonic() if self._armed else None
        try:
            shared = self._share(ops)
        finally:
            self._limit, self._since = outer if outer[1] is not None \
                else (self._limit, None)
        self._armed = True
        return shared

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around a batch step: the watchdog gives it ``STEP_DEADLINE_S``."""
        self._limit, self._since = STEP_DEADLINE_S, time.monotonic()
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while not self._closing:
            time.sleep(min(LINK_POLL_S, self._deadline_s / 4))
            since, limit = self._since, self._limit
            if since is not None and time.monotonic() - since > limit:
                self._broken(f"it waited {limit:g} s for the other ranks to take a step "
                             "with it: a rank is gone or stopped")
            gone = self._gone_follower()
            if gone is not None and not self._closing:
                self._broken(f"tensor-parallel {self.who(gone)} is gone: its op link closed")
            self._judge()

    def _gone_follower(self) -> int | None:
        """Rank 0: a follower whose op link ended, None while all are there; the beats
        its followers sent meanwhile are read (a follower writes nothing else after its
        hello) and counted heard."""
        links, silence = self._links, self._silence
        if not self.leader or not links or silence is None or self._closing:
            return None
        try:
            readable, _, _ = select.select(list(links.values()), [], [], 0)
        except (ValueError, OSError):  # a link closed under us: ``close`` ran meanwhile
            if self._closing:
                return None
            raise
        now = time.monotonic()
        for rank, link in links.items():
            if link in readable:
                try:
                    if not link.recv(4096, socket.MSG_DONTWAIT):
                        return rank
                except BlockingIOError:
                    continue
                except OSError:
                    return rank
                silence.heard(rank, now)
        return None

    def _judge(self) -> None:
        """Rank 0: tell ``on_silent`` of a follower gone silent, or of all heard again."""
        silence, told = self._silence, self.on_silent
        if silence is None or told is None:
            return
        went, back = silence.check(time.monotonic())
        for rank in went:
            told(f"tensor-parallel {self.who(rank)} is silent: nothing heard "
                 f"from it for {silence.silence_s:g} s (stopped or hung); the daemon "
                 "restarts the group if it stays so")
        if back and not silence.any_silent:
            told(None)

    def _broken(self, why: str) -> None:
        """End this process: a rank whose group broke cannot go on (the module docstring).
        ``on_broken`` (rank 0's engine: its requests fail, naming ``why``) is told first,
        and gets ``BROKEN_GRACE_S`` to answer them."""
        print(f"tensor-parallel rank {self.rank} of {self.size}: {why}; this rank exits "
              f"(status {EXIT_RING_BROKEN}) and the daemon restarts the group",
              file=sys.stderr, flush=True)
        if self.on_broken is not None:
            try:
                self.on_broken(why)
                time.sleep(BROKEN_GRACE_S)
            except Exception as exc:  # nothing may keep this process from ending
                print(f"telling the engine failed: {exc!r}", file=sys.stderr, flush=True)
        os._exit(EXIT_RING_BROKEN)

    def _share(self, ops: list[Op]) -> list[Op]:
        if self._links is None:
            return self._first(ops)
        if self.leader:
            self._closing = self._closing or ("close",) in ops  # their links end next
            data = pickle.dumps(ops)
            frame = struct.pack(">I", len(data)) + data
            for rank, link in self._links.items():
                try:
                    link.sendall(frame)
                except OSError as exc:
                    raise EngineError(f"tensor-parallel {self.who(rank)} is gone: its op "
                                      f"link failed ({exc})") from exc
            return ops
        [link] = self._links.values()
        try:
            (size,) = struct.unpack(">I", _read(link, 4))
            shared: list[Op] = pickle.loads(_read(link, size))  # rank 0's, a checked peer
        except (OSError, EOFError) as exc:
            raise EngineError(f"tensor-parallel rank {self.rank} lost rank 0: its op link "
                              f"ended ({exc or 'closed'})") from exc
        return shared

    def _first(self, ops: list[Op]) -> list[Op]:
        """The first share, over the ring: ``ops`` and where rank 0 takes the op links
        (a port on rank 0's ring host and a token each follower proves itself with); every share
        after it goes over those links, which wait in the kernel (mlx's ring busy-polls
        a core while it waits for a peer: an idle group would keep a core per follower
        busy)."""
        if self.leader:
            server = socket.create_server((self._link_host(), 0))
            server.settimeout(self._deadline_s)
            token = secrets.token_hex(16)
            self._ring_share([*ops, ("link", server.getsockname()[1], token)])
            links: dict[int, socket.socket] = {}
            with server:
                while len(links) < self.size - 1:
                    try:
                        link, _ = server.accept()
                    except TimeoutError as exc:
                        raise EngineError(f"the tensor-parallel ranks did not all link to "
                                          f"rank 0 within {self._deadline_s:g} s") from exc
                    link.settimeout(self._deadline_s)
                    try:
                        hello = _read(link, 36).decode("ascii", "replace")
                    except (OSError, EOFError):
                        link.close()
                        continue
                    rank = int(hello[32:]) if hello[32:].isdigit() else 0
                    if not secrets.compare_digest(hello[:32], token) \
                            or not 0 < rank < self.size or rank in links:
                        link.close()  # not one of ours
                        continue
                    links[rank] = link
            self._silence = RankSilence(links, time.monotonic())
            self._links = links
            return ops
        got = self._ring_share([])
        link_op = next(op for op in got if op[0] == "link")
        link = socket.create_connection((self._link_host(), link_op[1]),
                                        timeout=self._deadline_s)
        link.sendall(link_op[2].encode("ascii") + b"%04d" % self.rank)
        link.settimeout(self._deadline_s)
        self._links = {0: link}
        threading.Thread(target=beat, args=(link,), daemon=True,
                         name="mlxceld-rank-beat").start()
        return [op for op in got if op[0] != "link"]

    def explain(self, exc: BaseException) -> str:
        """Why rank 0's step failed, naming the rank when mlx's ring error does not: the
        follower whose op link ended, or the only one of a group of 2."""
        why = str(exc)
        if not self.leader or "[ring]" not in why:
            return why
        gone = self._gone_follower() or (1 if self.size == 2 else None)
        return why if gone is None else f"tensor-parallel {self.who(gone)} is gone: {why}"

    def _link_host(self) -> str:
        """Where rank 0 takes the op links: its ring host (127.0.0.1 inside one host)."""
        return self.hosts[0].rpartition(":")[0].strip("[]") if self.hosts else "127.0.0.1"

    def close(self) -> None:
        """Close the op links (after the last share). Rank 0 first reads each follower's
        last beats until it closes its end (at most ``CLOSE_DRAIN_S``): a link closed
        with bytes unread is reset, and the reset could cost the follower the ``close``
        op still on its way."""
        self._closing = True
        for link in (self._links or {}).values():
            if self.leader:
                with contextlib.suppress(OSError):
                    link.shutdown(socket.SHUT_WR)
                    link.settimeout(CLOSE_DRAIN_S)
                    while link.recv(4096):
                        pass
            link.close()

    def _ring_share(self, ops: list[Op]) -> list[Op]:
        g = self.group
        if self.leader:
            data = pickle.dumps(ops) if ops else b""
            mx.eval(mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32), group=g))
            if data:
                mx.eval(mx.distributed.all_sum(mx.array(np.frombuffer(data, dtype=np.uint8)),
                                               group=g))
            return ops
        size = np.array(mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int32), group=g))
        if int(size[0]) == 0:
            return []
        got = mx.distributed.all_sum(mx.zeros((int(size[0]),), dtype=mx.uint8), group=g)
        shared: list[Op] = pickle.loads(np.array(got).tobytes())  # rank 0's, in the ring
        return shared

    def sampler(self, own: Sampler | None) -> tuple[Sampler, bool]:
        """A sequence's sampler on this rank, and whether it is the shared greedy one.
        Rank 0: ``own`` (the request's), its tokens shared; the shared ``greedy`` becomes
        one shared sampler, so a batch of greedy sequences samples in one call as on one
        process. A follower (``own`` None): takes rank 0's tokens; pass ``follower_greedy``
        (the op's flag) to ``follower`` instead."""
        if own is greedy:
            return self._greedy, True
        assert own is not None and self.leader
        return self._lead(own), False

    def follower(self, shared_greedy: bool) -> Sampler:
        """A follower's sampler for a sequence rank 0 samples with ``sampler``: the one
        shared receiver for greedy ones, else a receiver of its own (so that the
        follower's generator calls samplers in rank 0's pattern)."""
        return self._greedy if shared_greedy else self._follow()

    def _lead(self, own: Sampler) -> Sampler:
        def lead(logprobs: mx.array) -> mx.array:
            return self._chained(own(logprobs).astype(mx.int32))
        return lead

    def _follow(self) -> Sampler:
        def follow(logprobs: mx.array) -> mx.array:
            # Zeros that depend on the logits: queued after this step's model collectives.
            return self._chained((mx.argmax(logprobs, axis=-1) * 0).astype(mx.int32))
        return follow

    def _chained(self, tokens: mx.array) -> mx.array:
        """``tokens`` summed over the group (rank 0's, plus the followers' zeros), after
        the previous share (a data dependency: the collectives stay in one order)."""
        after = tokens if self._last is None \
            else tokens + (self._last.sum() * 0).astype(mx.int32)
        self._last = mx.distributed.all_sum(after, group=self.group)
        return self._last


def broke(why: str) -> EngineUnavailable:
    """What rank 0's requests are told of a broken group: 503 naming why."""
    return EngineUnavailable(f"the tensor-parallel group broke: {why}; the daemon restarts "
                             "it", retry_after_s=GROUP_RETRY_S)


def _read(link: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``link``; ``EOFError`` when it ends first."""
    out = bytearray()
    while len(out) < n:
        chunk = link.recv(n - len(out))
        if not chunk:
            raise EOFError("the peer closed the link")
        out += chunk
    return bytes(out)


def run_tensor_follower(path: str, group: Any, *, max_batch: int = 8,
                        progress: Progress | None = None,
                        ready: Callable[[], None] | None = None,
                        share_deadline_s: float = SHARE_DEADLINE_S,
                        made: Callable[[Any], None] | None = None,
                        hosts: Sequence[str] = ()) -> None:
    """Rank ``group.rank()`` (≥ 1) of a tensor-parallel engine: load this rank's slices
    of ``path``, say ``ready()``, then take rank 0's steps until it closes the group.
    ``made``: given the ``Follower`` (its ``steps`` and ``sequences``, for the worker's
    stats) before ``ready``. Raises ``EngineError`` when the ring breaks (rank 0 or
    another rank gone)."""
    from mlxceld.engine.follower import Follower

    model, _ = load_shard(path, group, progress)
    follower = Follower(model, Mirror(group, deadline_s=share_deadline_s, hosts=hosts),
                        max_batch=max_batch)
    if made is not None:
        made(follower)
    if ready is not None:
        ready()
    try:
        follower.run()
    except RuntimeError as exc:  # mlx's: "[ring] connection to a peer was lost"
        raise EngineError(f"tensor-parallel rank {group.rank()} lost the ring: {exc}") from exc


def load_tensor_engine(path: str, group: Any, *, model_id: str | None = None,
                       max_batch: int = 8,
                       on_failure: Callable[[BaseException], None] | None = None,
                       progress: Progress | None = None,
                       share_deadline_s: float = SHARE_DEADLINE_S,
                       context_length: int | None = None,
                       prompt_cache_bytes: int | None = None,
                       kv_quant: KVQuant | None = None,
                       hosts: Sequence[str] = (), draft_model: str | None = None,
                       num_draft_tokens: int = DEFAULT_DRAFT_TOKENS) -> tuple[Any, Any]:
    """Rank 0 of a tensor-parallel engine: ``engine.loading.load_local_engine``'s engine and
    tokenizer (``context_length``, ``prompt_cache_bytes`` and the draft as there), with
    the model split over ``group``; the engine drives the followers, its ``setup`` op
    carrying ``kv_quant`` (refused, ``ConfigError``, for a model that cannot keep one:
    ``engine.local.check_kv``), so every rank quantizes alike. The draft is loaded whole
    on this rank alone (``engine/solo.py``)."""
    from mlx_lm.utils import load_tokenizer

    from mlxceld.engine.loading import check_kv, engine_for, load_draft

    model, config = load_shard(path, group, progress)
    check_kv(model, config, kv_quant, str(Path(path) / "config.json"))
    draft = None if draft_model is None \
        else load_draft(path, model, config, draft_model, num_draft_tokens)
    tokenizer = load_tokenizer(Path(path),  # type: ignore[no-untyped-call]
                               eos_token_ids=config.get("eos_token_id", None))
    engine = engine_for(model, tokenizer, config, model_id=model_id or Path(path).name,
                        max_batch=max_batch, on_failure=on_failure, kv_quant=kv_quant,
                        mirror=Mirror(group, deadline_s=share_deadline_s, hosts=hosts),
                        context_length=context_length, prompt_cache_bytes=prompt_cache_bytes,
                        draft=draft)
    return engine, tokenizer

