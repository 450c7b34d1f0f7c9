"""The stage protocol's own messages (``protocol.py``'s table), typed as the wire's are.

What a stage and its coordinator say beyond the words every channel-1 protocol shares
(``wire/transport_messages.py``: ``attach``, ``token``, ``error``). ``to_wire`` gives the
header as it has always gone out, key for key, an optional field left out when absent;
``from_wire`` checks every field (with ``protocol.py``'s checks, whose words it keeps) and
raises ``MessageError`` naming the first one out of bounds, which a stage answers as
``error`` code ``bad_message``. Here rather than in ``wire/``: ``prepare`` carries the
sampling parameters and the KV cache's quantization, the engine's and the roles' types.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self

from mlxceld.engine.base import SamplingParams
from mlxceld.pipeline import protocol as p
from mlxceld.roles.options import KVQuant
from mlxceld.wire.messages import MessageError, field, optional
from mlxceld.wire.transport_messages import (
    MAX_STEP,
    SEQ_ID,
    bytes_field,
    optional_seq,
    seq_field,
    step_field,
)

Span = tuple[str, int]  # a prompt-cache entry and its first tokens: ``reuse``, ``keep``


@contextmanager
def _checking(name: str) -> Iterator[None]:
    """``protocol.py``'s checks refuse with ``ProtocolViolation``: as ``MessageError``."""
    try:
        yield
    except p.ProtocolViolation as exc:
        raise MessageError(name, exc.message) from None


def params_field(header: Mapping[str, Any], vocab_size: int | None = None) -> SamplingParams:
    """``params`` (``protocol.params_from_wire``: the sampling parameters, each checked;
    every ``logit_bias`` id below ``vocab_size`` when given), as a ``prepare`` and a
    replica's ``generate`` carry them."""
    with _checking("params"):
        return p.params_from_wire(header.get("params"), vocab_size)


def _span(header: Mapping[str, Any], key: str) -> Span | None:
    """``reuse`` or ``keep``: {entry, tokens} (tokens >= 1), or None when absent."""
    value = header.get(key)
    if value is None:
        return None
    tokens = value.get("tokens") if isinstance(value, dict) else None
    if not isinstance(value, dict) or set(value) != {"entry", "tokens"} \
            or type(tokens) is not int or not 1 <= tokens < MAX_STEP:
        raise MessageError(key, f"'{key}' must be {{entry, tokens}} with tokens >= 1")
    return seq_field(value, "entry"), tokens


def _span_to_wire(span: Span) -> dict[str, Any]:
    return {"entry": span[0], "tokens": span[1]}


def _sample(header: Mapping[str, Any]) -> bool:
    sample = header.get("sample", True)
    if type(sample) is not bool:
        raise MessageError("sample", "'sample' must be true or false")
    return sample


@dataclass(frozen=True)
class Prepare:
    """Coordinator to stage: a new sequence, its sampling, its end-of-sequence ids, and
    the prompt cache's part (``reuse``, ``keep_prompt``)."""

    T: ClassVar[str] = "prepare"
    seq: str
    params: SamplingParams
    eos: tuple[int, ...] = ()
    history: tuple[int, ...] | None = None  # sent when the repetition penalty is on
    kv: KVQuant | None = None
    keep_prompt: str | None = None
    reuse: Span | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "seq": self.seq,
                                  "params": p.params_to_wire(self.params),
                                  "eos": list(self.eos)}
        if self.history is not None:
            header["history"] = list(self.history)
        if self.kv is not None:
            header["kv"] = p.kv_to_wire(self.kv)
        if self.keep_prompt is not None:
            header["keep_prompt"] = self.keep_prompt
        if self.reuse is not None:
            header["reuse"] = _span_to_wire(self.reuse)
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any], vocab_size: int | None = None) -> Self:
        """``vocab_size``: the last stage's model's, which every ``logit_bias`` id must be
        below (None: not checked)."""
        seq = seq_field(header)
        params = params_field(header, vocab_size)
        with _checking("history"):
            history = None if "history" not in header else p.history_of(header)
        keep_prompt = optional_seq(header, "keep_prompt")
        with _checking("kv"):
            kv = p.kv_of(header)
        with _checking("eos"):
            eos = p.eos_of(header)
        return cls(seq, params, tuple(sorted(eos)), history, kv, keep_prompt,
                   _span(header, "reuse"))


@dataclass(frozen=True)
class Prepared:
    """Stage to coordinator: ``seq`` is prepared, from ``reused`` tokens of the entry its
    ``reuse`` named (0: not held here)."""

    T: ClassVar[str] = "prepared"
    seq: str
    reused: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seq": self.seq, "reused": self.reused}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        reused = header.get("reused", 0)
        if type(reused) is not int or not 0 <= reused < MAX_STEP:
            raise MessageError("reused", "'reused' must be a number of tokens >= 0")
        return cls(seq_field(header), reused)


@dataclass(frozen=True)
class Run:
    """Coordinator to the first stage: run ``step`` of ``seq`` on the tensor ``tokens``
    (a chunk of the prompt; the last one samples)."""

    T: ClassVar[str] = "run"
    seq: str
    step: int
    sample: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seq": self.seq, "step": self.step, "sample": self.sample}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(seq_field(header), step_field(header), _sample(header))


@dataclass(frozen=True)
class Act:
    """A stage to the next: the step's activations (the tensor ``hidden``) and, from the
    first stage on, the step's token ids (``tokens``: what the last stage's draft reads,
    ``speculating.py``); ``pos``: the position the step starts at, each stage's caches
    trimmed to it first (after a pass some of whose proposals were rejected)."""

    T: ClassVar[str] = "act"
    seq: str
    step: int
    sample: bool = True
    pos: int | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "seq": self.seq, "step": self.step,
                                  "sample": self.sample}
        if self.pos is not None:
            header["pos"] = self.pos
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(seq_field(header), step_field(header), _sample(header), _pos(header))


@dataclass(frozen=True)
class Next:
    """The last stage to the first: run the tokens (the tensor ``tokens``: the one just
    sampled, then the draft's proposals when the sequence speculates) as the sequence's
    next step, from position ``pos`` (absent: where its caches end)."""

    T: ClassVar[str] = "next"
    seq: str
    step: int
    pos: int | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "seq": self.seq, "step": self.step}
        if self.pos is not None:
            header["pos"] = self.pos
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(seq_field(header), step_field(header), _pos(header))


def _pos(header: Mapping[str, Any]) -> int | None:
    pos = header.get("pos")
    if pos is not None and (type(pos) is not int or not 0 <= pos < MAX_STEP):
        raise MessageError("pos", "'pos' must be a position >= 0")
    return pos


@dataclass(frozen=True)
class Release:
    """Coordinator to stage: free ``seq``, or keep its caches' first tokens as a
    prompt-cache entry (``keep``; answered by ``cache``)."""

    T: ClassVar[str] = "release"
    seq: str
    keep: Span | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "seq": self.seq}
        if self.keep is not None:
            header["keep"] = _span_to_wire(self.keep)
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(seq_field(header), _span(header, "keep"))


@dataclass(frozen=True)
class Forget:
    """Coordinator to stage: drop these prompt-cache entries (answered by ``cache``)."""

    T: ClassVar[str] = "forget"
    entries: tuple[str, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "entries": list(self.entries)}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        value = header.get("entries")
        if not isinstance(value, list) or len(value) > p.MAX_FORGET or any(
                not isinstance(v, str) or not SEQ_ID.match(v) for v in value):
            raise MessageError("entries", f"'entries' must be a list of at most "
                                          f"{p.MAX_FORGET} entry ids")
        return cls(tuple(value))


@dataclass(frozen=True)
class Cache:
    """Stage to coordinator: what its prompt cache holds (``bytes``, ``entries``) and
    dropped for room (``evicted``); after a keep, the ``entry``, whether it was ``kept``
    and is ``trimmable``, and ``why`` not."""

    T: ClassVar[str] = "cache"
    bytes: int
    entries: int
    evicted: tuple[str, ...] = ()
    entry: str | None = None
    kept: bool = False
    trimmable: bool = False
    why: str | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "bytes": self.bytes, "entries": self.entries,
                                  "evicted": list(self.evicted)}
        if self.entry is not None:
            header.update(entry=self.entry, kept=self.kept, trimmable=self.trimmable)
        if self.why is not None:
            header["why"] = self.why
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        size, entries = bytes_field(header, "bytes"), bytes_field(header, "entries")
        if size is None or entries is None:
            raise MessageError("bytes" if size is None else "entries",
                               "cache needs 'bytes' and 'entries'")
        evicted = header.get("evicted")
        if not isinstance(evicted, list) or not all(isinstance(e, str) for e in evicted):
            raise MessageError("evicted", "cache field 'evicted' must be a list of entry ids")
        return cls(size, entries, tuple(evicted), optional_seq(header, "entry"),
                   optional(header, "kept", bool, cls.T) is True,
                   optional(header, "trimmable", bool, cls.T) is True,
                   optional(header, "why", str, cls.T))


@dataclass(frozen=True)
class Adopt:
    """Coordinator to stage, over another of its connections: answer ``seq`` over this
    one from now on (a handover to a new key)."""

    T: ClassVar[str] = "adopt"
    seq: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seq": self.seq}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(seq_field(header))


class Adopted(Adopt):
    """Stage to coordinator, over the connection ``seq`` used so far: its last message
    there."""

    T = "adopted"


@dataclass(frozen=True)
class Attached:
    """Stage to coordinator: the stage's node id, rank, layers, model and cluster, and
    its prompt cache's bound in force."""

    T: ClassVar[str] = "attached"
    stage: str
    rank: int
    layers: tuple[int, int]
    model: str
    cluster: str
    cache_bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "stage": self.stage, "rank": self.rank,
                "layers": list(self.layers), "model": self.model, "cluster": self.cluster,
                "cache_bytes": self.cache_bytes}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        layers = header.get("layers")
        if (not isinstance(layers, list) or len(layers) != 2
                or not all(type(n) is int for n in layers)):
            raise MessageError("layers", "attached field 'layers' must be [start, end]")
        budget = bytes_field(header, "cache_bytes")
        if budget is None:
            raise MessageError("cache_bytes", "attached needs 'cache_bytes'")
        return cls(field(header, "stage", str, cls.T), field(header, "rank", int, cls.T),
                   (layers[0], layers[1]), field(header, "model", str, cls.T),
                   field(header, "cluster", str, cls.T), budget)


__all__: Final = ["Act", "Adopt", "Adopted", "Attached", "Cache", "Forget", "Next", "Prepare",
                  "Prepared", "Release", "Run", "Span", "params_field"]
