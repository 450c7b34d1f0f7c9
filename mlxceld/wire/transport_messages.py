"""MXCL channel 1 (transport): the words a pipeline's stages and a router's replicas share.

Channel 1 carries two protocols: the stages' (``pipeline/protocol.py``: coordinator,
stages, the ring between them) and the replicas' (``replicas/protocol.py``: a router and
the nodes it sends sequences to). They name a sequence the same way (``seq``: 1 to 64
characters of ``[A-Za-z0-9_.-]``, ``SEQ_ID``), stream its tokens as the same ``token``
message, refuse with the same ``error`` (``CodedError``: ``code``, ``message``; channels 2
and 3's ``error`` carries a ``reason`` instead) and begin a connection with the same
``attach`` (``model``, ``cluster``). Those four are here; each protocol's own messages
are beside it (``pipeline/messages.py``, ``replicas/messages.py``).

``to_wire`` gives the header as it has always gone out, key for key, an optional field
left out when it is absent; ``from_wire`` checks every field and raises ``MessageError``
naming the first one out of bounds (the stage and the node answer it as ``error`` code
``bad_message``, its reason as the message).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Self

from mlxceld.wire.envelope import Envelope
from mlxceld.wire.messages import MessageError, field, optional

SEQ_ID: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_ERROR_MESSAGE: Final = 1000  # characters of an error's message that go out
MAX_STEP: Final = 2**31  # a step is an integer in [0, MAX_STEP)
MAX_TOKEN_ID: Final = 2**31
MAX_BYTES: Final = 2**63
FinishReason = Literal["stop", "length"]
FINISH_REASONS: Final = ("stop", "length")  # a replica's token's finish_reason
LOGPROB_FLOOR: Final = -9999.0  # what a token the processors ruled out (-inf) reads as,
# as OpenAI's: every logprob on the wire is in [LOGPROB_FLOOR, 0]


def seq_field(header: Mapping[str, Any], name: str = "seq") -> str:
    """A sequence id (or a prompt-cache entry id: the same alphabet) ``header[name]``."""
    value = header.get(name)
    if not isinstance(value, str) or not SEQ_ID.match(value):
        raise MessageError(name, f"'{name}' must be 1-64 characters of [A-Za-z0-9_.-]")
    return value


def optional_seq(header: Mapping[str, Any], name: str) -> str | None:
    """``seq_field``, or None when ``name`` is absent (or null)."""
    return None if header.get(name) is None else seq_field(header, name)


def step_field(header: Mapping[str, Any]) -> int:
    step = header.get("step")
    if type(step) is not int or not 0 <= step < MAX_STEP:
        raise MessageError("step", "'step' must be an integer in [0, 2**31)")
    return step


def bytes_field(header: Mapping[str, Any], name: str) -> int | None:
    """A number of bytes, or None when ``name`` is absent (or null)."""
    value = header.get(name)
    if value is not None and (type(value) is not int or not 0 <= value < MAX_BYTES):
        raise MessageError(name, f"'{name}' must be a number of bytes >= 0")
    return value


def is_logprob(value: Any) -> bool:
    return type(value) in (int, float) and LOGPROB_FLOOR <= value <= 0


Top = tuple[tuple[int, float], ...]


def logprobs_field(header: Mapping[str, Any], most: int | None = None
                   ) -> tuple[float, Top] | None:
    """A token's ``logprob`` and ``top`` [[id, logprob], ...] (at most ``most`` of them),
    each checked; None when neither is there."""
    logprob, top = header.get("logprob"), header.get("top")
    if "logprob" not in header and "top" not in header:
        return None
    if not is_logprob(logprob) or not isinstance(top, list) \
            or (most is not None and len(top) > most) or any(
            not isinstance(p, list) or len(p) != 2 or type(p[0]) is not int
            or not 0 <= p[0] < MAX_TOKEN_ID or not is_logprob(p[1]) for p in top):
        at_most = "" if most is None else f" (at most {most} alternatives)"
        raise MessageError("logprob", f"a token's 'logprob' and 'top'{at_most} are missing "
                                      "or malformed")
    assert isinstance(logprob, int | float)
    return float(logprob), tuple((p[0], float(p[1])) for p in top)


@dataclass(frozen=True)
class Attach:
    """The first message on a connection to a stage or a serving node: the model it is
    asked to serve (its identity, hex) and the cluster; to a stage also its prompt
    cache's epoch (``cache``, an id: the stage drops entries of another) and bound
    (``cache_bytes``; absent: the stage's default)."""

    T: ClassVar[str] = "attach"
    model: str
    cluster: str
    cache: str | None = None
    cache_bytes: int | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "model": self.model, "cluster": self.cluster}
        if self.cache is not None:
            header["cache"] = self.cache
        if self.cache_bytes is not None:
            header["cache_bytes"] = self.cache_bytes
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(field(header, "model", str, cls.T), field(header, "cluster", str, cls.T),
                   optional_seq(header, "cache"), bytes_field(header, "cache_bytes"))


@dataclass(frozen=True)
class Token:
    """A sampled token of ``seq`` (its id is the tensor ``tokens``, i32 ``[1]``): from a
    pipeline's last stage with its ``step``, from a replica with ``finish_reason`` on the
    sequence's last and ``cached`` (prompt tokens its prompt cache gave) on its first.
    ``top`` None: no log-probabilities asked (``logprob`` and ``top`` not sent)."""

    T: ClassVar[str] = "token"
    seq: str
    step: int | None = None
    logprob: float | None = None
    top: Top | None = None
    finish_reason: FinishReason | None = None
    cached: int | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "seq": self.seq}
        if self.step is not None:
            header["step"] = self.step
        if self.top is not None:
            header["logprob"] = self.logprob
            header["top"] = [[t, lp] for t, lp in self.top]
        if self.finish_reason is not None:
            header["finish_reason"] = self.finish_reason
        if self.cached is not None:
            header["cached"] = self.cached
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        seq = seq_field(header)
        step = None if header.get("step") is None else step_field(header)
        logprobs = logprobs_field(header)
        logprob, top = (None, None) if logprobs is None else logprobs
        reason = header.get("finish_reason")
        if reason is not None and reason not in FINISH_REASONS:
            raise MessageError("finish_reason", "'finish_reason' must be stop or length")
        cached = header.get("cached")
        if cached is not None and (type(cached) is not int or not 0 <= cached < MAX_TOKEN_ID):
            raise MessageError("cached", "'cached' must be an integer >= 0")
        return cls(seq, step, logprob, top, reason, cached)

    def logprobs(self, wanted: int | None) -> tuple[float | None, Top]:
        """None and () when ``wanted`` is None (none asked), else the token's logprob and
        its alternatives, at most ``wanted`` of them; ``MessageError`` if they are not so."""
        if wanted is None:
            return None, ()
        if self.logprob is None or self.top is None or len(self.top) > wanted:
            raise MessageError("logprob", f"a token's 'logprob' and 'top' (at most {wanted} "
                                          "alternatives) are missing or malformed")
        return self.logprob, self.top


@dataclass(frozen=True)
class CodedError:
    """A refusal, or a sequence's failure: ``code`` (each protocol's ``ERR_*``), ``message``
    (at most ``MAX_ERROR_MESSAGE`` characters go out), ``seq`` and ``step`` when it
    concerns one, ``retry_after_s`` (a replica's ``unavailable``)."""

    T: ClassVar[str] = "error"
    code: str
    message: str
    seq: str | None = None
    step: int | None = None
    retry_after_s: float | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "code": self.code,
                                  "message": self.message[:MAX_ERROR_MESSAGE]}
        if self.seq is not None:
            header["seq"] = self.seq
        if self.step is not None:
            header["step"] = self.step
        if self.retry_after_s is not None:
            header["retry_after_s"] = self.retry_after_s
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        """``seq`` is whatever string the refused message named (it may be no sequence id:
        the refusal may be of a bad one)."""
        after = header.get("retry_after_s")
        if after is not None and type(after) not in (int, float):
            raise MessageError("retry_after_s", "error field 'retry_after_s' is not a number")
        return cls(field(header, "code", str, cls.T), field(header, "message", str, cls.T),
                   optional(header, "seq", str, cls.T), optional(header, "step", int, cls.T),
                   after)


def error_in(env: Envelope) -> CodedError:
    """What a peer refused with, read leniently (the reader only says it): its ``error``,
    or for another message in its place that message's type, code "" (none); an ``error``
    that does not read says so, code "" too."""
    if env.type != CodedError.T:
        return CodedError("", env.type)
    try:
        return CodedError.from_wire(env.header)
    except MessageError as exc:
        return CodedError("", f"a bad error ({exc.reason})")
