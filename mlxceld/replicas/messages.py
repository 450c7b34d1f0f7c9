"""The replica protocol's own messages (``protocol.py``'s tables), typed as the wire's are.

What a router and its serving nodes say beyond the words every channel-1 protocol shares
(``wire/transport_messages.py``: ``attach``, ``token``, ``error``). ``to_wire`` gives the
header as it has always gone out, key for key; ``from_wire`` checks every field and
raises ``MessageError`` naming the first one out of bounds, which a node answers as
``error`` code ``bad_message``. Here rather than in ``wire/``: ``generate``, ``expect`` and
``prefill`` carry the sampling parameters (the engine's type, checked as the pipeline's
``prepare`` checks them), and ``handoff`` the first token as the engine's ``TokenOutput``.
``adopt`` and ``adopted`` (a handover to a new key) are the stage protocol's own words and
types (``pipeline/messages.py``), said the same way here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Self

from mlxceld.engine.base import MAX_TOP_LOGPROBS, SamplingParams, TokenOutput
from mlxceld.engine.handoff import QUANTS, Mode
from mlxceld.pipeline.messages import Adopt, Adopted, params_field
from mlxceld.pipeline.protocol import params_to_wire
from mlxceld.replicas.protocol import MAX_PROMPT_TOKENS
from mlxceld.wire.address import parse_address
from mlxceld.wire.messages import MessageError, field
from mlxceld.wire.transport_messages import FINISH_REASONS, MAX_TOKEN_ID, seq_field

MAX_MS: Final = 1e9  # a prefill's encode_ms and send_ms, at most


@dataclass(frozen=True)
class Generate:
    """Router to node: run ``seq`` (its prompt: the tensor ``prompt``) with ``params``."""

    T: ClassVar[str] = "generate"
    seq: str
    params: SamplingParams

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seq": self.seq, "params": params_to_wire(self.params)}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(seq_field(header), params_field(header))


@dataclass(frozen=True)
class Expect:
    """Router to decode node: ``seq``'s KV cache comes from ``prefill`` (that node's serving
    address); decode on from it, as for ``generate``."""

    T: ClassVar[str] = "expect"
    seq: str
    params: SamplingParams
    prefill: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "prefill": self.prefill, "seq": self.seq,
                "params": params_to_wire(self.params)}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        prefill = header.get("prefill")
        if not isinstance(prefill, str) or not prefill:
            raise MessageError("prefill", "'prefill' must be the prefill node's serving "
                                          "host:port")
        return cls(seq_field(header), params_field(header), prefill)


@dataclass(frozen=True)
class Prefill:
    """Router to prefill node: run ``seq``'s prompt and hand its KV cache to
    ``decode_target`` (the decode node's serving address) in ``compression``."""

    T: ClassVar[str] = "prefill"
    seq: str
    params: SamplingParams
    decode_target: str
    compression: Mode

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "decode_target": self.decode_target,
                "compression": str(self.compression), "seq": self.seq,
                "params": params_to_wire(self.params)}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        target = header.get("decode_target")
        try:
            where = parse_address(target) if isinstance(target, str) else None
        except ValueError:
            where = None
        if where is None:
            raise MessageError("decode_target", "'decode_target' must be the decode node's "
                                                "serving host:port")
        assert isinstance(target, str)
        try:
            mode = parse_mode(header.get("compression"))
        except ValueError as exc:
            raise MessageError("compression", str(exc)) from None
        return cls(seq_field(header), params_field(header), target, mode)


def parse_mode(text: object) -> Mode:
    """``"int8+lz4"`` as a ``Mode``; ``ValueError`` naming what is allowed."""
    if not isinstance(text, str):
        raise ValueError("'compression' must be a string such as 'none' or 'int8+lz4'")
    quant, plus, rest = text.partition("+")
    if quant not in QUANTS or (plus and rest != "lz4"):
        raise ValueError(f"compression {text[:40]!r} is not one of none, int8, int4, each "
                         "optionally with +lz4")
    return Mode(quant, bool(plus))


Sequence = Generate | Expect | Prefill  # what starts a sequence on a node


@dataclass(frozen=True)
class Prefilled:
    """Prefill node to router: ``seq``'s cache is sent: its ``bytes``, and the
    milliseconds it took to encode and to send."""

    T: ClassVar[str] = "prefilled"
    seq: str
    bytes: int
    encode_ms: float
    send_ms: float

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seq": self.seq, "bytes": self.bytes,
                "encode_ms": self.encode_ms, "send_ms": self.send_ms}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        size = header.get("bytes")
        if type(size) is not int or size < 0:
            raise MessageError("bytes", "prefilled field 'bytes' must be an integer >= 0")
        return cls(seq_field(header), size, _ms(header, "encode_ms"), _ms(header, "send_ms"))


def _ms(header: Mapping[str, Any], name: str) -> float:
    value = header.get(name)
    if type(value) not in (int, float) or not isinstance(value, int | float) \
            or not 0 <= value < MAX_MS:
        raise MessageError(name, f"prefilled field {name!r} must be a number of "
                                 "milliseconds")
    return float(value)


@dataclass(frozen=True)
class Handoff:
    """Prefill node to decode node: part ``part`` of ``parts`` of ``seq``'s KV cache (its
    blobs: the tensors); part 0 also the first token (``first``) and the cache's header
    (``cache``, ``engine/handoff.py``'s ``encode_cache``: checked by ``decode_cache``)."""

    T: ClassVar[str] = "handoff"
    seq: str
    part: int
    parts: int
    first: TokenOutput | None = None
    cache: Mapping[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        header: dict[str, Any] = {"t": self.T, "seq": self.seq, "part": self.part,
                                  "parts": self.parts}
        if self.first is not None:
            first = self.first
            header["first"] = {"token": first.token, "logprob": first.logprob,
                               "top": [list(t) for t in first.top],
                               "finish_reason": first.finish_reason}
            if first.cached is not None:  # the prefill node's prompt cache gave these
                header["first"]["cached"] = first.cached
        if self.cache is not None:
            header["cache"] = self.cache
        return header

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        """``part`` and ``parts`` against the cache's layers, ``first.token`` against the
        vocabulary: the decode node checks those, which knows them."""
        part, parts = header.get("part"), header.get("parts")
        if type(part) is not int or type(parts) is not int or not 0 <= part < parts:
            raise MessageError("part", "'part' and 'parts' must be 0 <= part < parts")
        first, cache = header.get("first"), header.get("cache")
        if part == 0 and (not isinstance(cache, dict) or not isinstance(first, dict)):
            raise MessageError("cache", "handoff part 0 carries no 'cache' header or 'first'")
        return cls(seq_field(header), part, parts,
                   None if first is None else first_field(first), cache)


def first_field(first: object, max_prompt: int = MAX_PROMPT_TOKENS) -> TokenOutput:
    """A ``handoff``'s ``first`` as a ``TokenOutput``, each field checked (the token id
    below 2**31: the decode node checks it against its vocabulary; ``cached``: at most
    ``max_prompt``, the most prompt tokens a sequence may have)."""
    if not isinstance(first, dict):
        raise MessageError("first", "'first' must be an object")
    token, logprob, top = first.get("token"), first.get("logprob"), first.get("top", [])
    reason, cached = first.get("finish_reason"), first.get("cached")
    if type(token) is not int or not 0 <= token < MAX_TOKEN_ID:
        raise MessageError("first.token", "'first.token' must be a token id")
    if logprob is not None and type(logprob) not in (int, float):
        raise MessageError("first.logprob", "'first.logprob' must be a number")
    if reason is not None and reason not in FINISH_REASONS:
        raise MessageError("first.finish_reason",
                           "'first.finish_reason' must be stop, length or null")
    if cached is not None and (type(cached) is not int or not 0 <= cached <= max_prompt):
        raise MessageError("first.cached", f"'first.cached' must be an integer from 0 to "
                                           f"{max_prompt}")
    if not isinstance(top, list) or len(top) > MAX_TOP_LOGPROBS or not all(
            isinstance(t, list) and len(t) == 2 and type(t[0]) is int
            and type(t[1]) in (int, float) for t in top):
        raise MessageError("first.top", f"'first.top' must be at most {MAX_TOP_LOGPROBS} "
                                        "[id, logprob] pairs")
    return TokenOutput(token, reason, None if logprob is None else float(logprob),
                       tuple((int(t), float(lp)) for t, lp in top), cached=cached)


@dataclass(frozen=True)
class Cancel:
    """Router to node: stop ``seq`` and free it (no answer)."""

    T: ClassVar[str] = "cancel"
    seq: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "seq": self.seq}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        return cls(seq_field(header))


@dataclass(frozen=True)
class Load:
    """Node to router: the sequences its engine runs (every client's), and its batch."""

    T: ClassVar[str] = "load"
    sequences: int
    max_batch: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "sequences": self.sequences, "max_batch": self.max_batch}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        sequences = header.get("sequences")
        if type(sequences) is not int or not 0 <= sequences < 2**31:
            raise MessageError("sequences", "load field 'sequences' must be an integer in "
                                            "[0, 2**31)")
        return cls(sequences, field(header, "max_batch", int, cls.T))


@dataclass(frozen=True)
class Attached:
    """Node to router: the node's id, role, model, context length and batch."""

    T: ClassVar[str] = "attached"
    node: str
    role: str
    model: str
    context_length: int
    max_batch: int

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.T, "node": self.node, "role": self.role, "model": self.model,
                "context_length": self.context_length, "max_batch": self.max_batch}

    @classmethod
    def from_wire(cls, header: Mapping[str, Any]) -> Self:
        context, batch = header.get("context_length"), header.get("max_batch")
        if type(context) is not int or type(batch) is not int or context < 1 or batch < 1:
            raise MessageError("context_length" if type(context) is not int or context < 1
                               else "max_batch", "'attached' without its context_length and "
                               "max_batch")
        return cls(field(header, "node", str, cls.T), field(header, "role", str, cls.T),
                   field(header, "model", str, cls.T), context, batch)


__all__: Final = ["Adopt", "Adopted", "Attached", "Cancel", "Expect", "Generate", "Handoff",
                  "Load", "Prefill", "Prefilled", "Sequence", "first_field", "parse_mode"]
