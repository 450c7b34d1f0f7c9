"""The stage protocol: MXCL messages on channel 1 (transport) of a pipeline.

Connections, each an authenticated MXCL stream whose handshake bound the
dialer's identity (``host:port``, its IP checked against the TCP source):

- the coordinator (the router's pipeline engine) dials every stage and sends
  commands; the stage answers on that same connection; every other router of the
  pipeline (``coord`` below is any router) does the same with its own sequences;
- stage *i* dials stage *i + 1* and sends activations; nothing but pongs comes
  back on it;
- the last stage dials the first (when they differ) and sends it each sampled
  token that continues a sequence (``next``): decoding goes round the ring of
  stages without waiting for the coordinator, which only prefills, watches the
  tokens go by, and releases.

Messages (the envelope of PROTOCOL.md section 4; ``seq`` is 1 to 64 characters
of ``[A-Za-z0-9_.-]``, ``step`` an integer in ``[0, 2**31)``):

========== ================ ===================================================
type       direction        fields, tensors, answer
========== ================ ===================================================
attach     coord → stage    ``model`` (identity hex), ``cluster``, and for the
                            prompt cache (``kvstore.py``) ``cache`` (the
                            router's epoch, an id: the stage drops entries
                            of another epoch) and ``cache_bytes`` (its bound
                            in bytes; absent: the stage's default); answered
                            by ``attached`` {``stage``, ``rank``, ``layers``,
                            ``model``, ``cache_bytes``} or ``error`` code
                            ``model_mismatch``
                            (then the stage closes the connection), or
                            ``standby`` while its assignment is not active,
                            or ``stage_failed`` from a failed stage's
                            stand-in (``standin.py``: its host's daemon,
                            which answers any first message so, then
                            closes)
prepare    coord → stage    ``seq``, ``params`` {max_tokens, temperature,
                            top_p, top_k, seed, min_p, presence_penalty,
                            frequency_penalty, repetition_penalty,
                            logit_bias: [[id, bias], ...] (at most
                            ``MAX_LOGIT_BIAS``, ids below the model's
                            vocabulary on the last stage), logprobs: null or
                            0 to ``MAX_TOP_LOGPROBS``, and ``constraint``
                            {kind, text} when the output must match one
                            (``engine/constraints.py``; its text at most
                            ``MAX_CONSTRAINT_BYTES`` as a JSON string),
                            ``min_tokens`` (1 to max_tokens) and
                            ``ignore_eos`` (true) when set (absent: 0,
                            false)},
                            ``eos`` (at most ``MAX_EOS`` token ids),
                            ``history`` (the prompt's last
                            ``REPETITION_CONTEXT`` token ids, when the
                            repetition penalty is on: the last stage's
                            processors look back that far; else absent or
                            empty), ``kv`` (optional: a quantized KV cache,
                            {bits: 4 or 8, group_size: 32, 64 or 128,
                            start: tokens, 0 to 2**31 - 1}, as
                            ``roles.options.KVQuant`` and
                            ``engine/kvquant.py``; absent or null: full
                            precision); ``reuse`` {``entry``, ``tokens``}:
                            start from that prompt-cache entry's first
                            ``tokens`` tokens instead of an empty KV cache;
                            ``keep_prompt`` (an entry id): keep a copy of
                            the cache once the prompt is prefilled (after
                            the sequence's first step that samples); owned
                            by the sender's identity; answered by
                            ``prepared`` {seq, ``reused``: the tokens taken
                            from the entry, 0 when it is not held here (the
                            router then prepares afresh without it)},
                            or ``error`` code ``draining`` while the stage is
                            stopping (it finishes its sequences, takes no new
                            one), or code ``bad_constraint`` from the last
                            stage when it cannot decode under the constraint
                            (the router answers 400 naming response_format)
run        coord → stage 0  ``seq``, ``step``, ``sample`` (bool); tensor
                            ``tokens`` i32 ``[1, n]``, 1 ≤ n ≤ ``MAX_STEP_TOKENS``
                            (the prompt, in chunks; the last one samples)
act        stage → next     ``seq``, ``step``, ``sample``, ``pos`` (as
                            ``next``'s, passed on); tensor ``hidden``
                            ``[1, n, hidden_size]`` in the model's dtype and,
                            from the first stage on, ``tokens`` i32 ``[1, n]``
                            (the step's ids, for the last stage's draft)
token      last → owner     ``seq``, ``step`` (the token's ordinal: the first
                            sampling step's number, plus one per token before
                            it); tensor ``tokens`` i32 ``[1]``;
                            sent only for steps with ``sample`` true (one per
                            token a speculative pass keeps); with
                            ``params.logprobs``: ``logprob`` (the token's)
                            and ``top`` [[id, logprob], ...] (``logprobs``
                            of them, most likely first), each logprob a
                            number in [``LOGPROB_FLOOR``, 0]
next       last → stage 0   ``seq``, ``step``, ``pos`` (optional: the position
                            the step starts at; every stage trims its caches
                            to it first); tensor ``tokens`` i32 ``[1, 1 + k]``:
                            the token just sampled and the last stage's
                            draft's k proposals (``speculating.py``; k <=
                            ``MAX_DRAFT_TOKENS``), run as the sequence's next
                            step unless it is an ``eos`` id or the sequence
                            has produced ``max_tokens`` (one stage: no message,
                            the stage continues itself)
release    coord → stage    ``seq``; frees its cache, or with ``keep``
                            {``entry``, ``tokens``} keeps it (trimmed to
                            ``tokens``) as that prompt-cache entry, answered
                            by ``cache``; no answer otherwise
forget     coord → stage    ``entries`` (at most ``MAX_FORGET`` ids): drop
                            those prompt-cache entries; answered by ``cache``
cache      stage → coord    what the stage's prompt cache did and holds:
                            ``entry`` and ``kept`` (bool) and ``trimmable``
                            after a keep (``why`` when not kept), ``evicted``
                            (ids dropped for room), ``bytes``, ``entries``
adopt      coord → stage    ``seq``, sent over another connection of the
                            sequence's owner (a handover to a new key): the
                            stage answers ``adopted`` {seq} over the
                            connection the sequence used so far (after all
                            it sent there) and sends it everything from then
                            on over this one; an unknown ``seq`` is ignored
error      stage → source   ``code``, ``message``, and ``seq``/``step`` when
                            the error concerns one; ``group_broken``: a tensor
                            stage's group broke (its process ends: a router
                            that holds replays the sequence, ``replay.py``)
========== ================ ===================================================

The messages are typed: ``attach``, ``token`` and ``error`` are the words this protocol
shares with the replicas' (``wire/transport_messages.py``), the others are
``messages.py``'s; the checks of ``prepare``'s fields are here.

Authorization on a stage (the identity is the handshake's, never a field):
commands (``attach`` ... ``adopt``, the rows "coord → stage" above) from every
router of the pipeline: any identity whose handshake passed under the cluster's
keyring, the stage's own neighbours excepted (its upstream and its last stage send
only ``act`` and ``next``; a command from one is refused ``not_coordinator``). The
routers are the plan's coordinator and any daemon with ``--node-role router`` that
follows its plan (``cluster/front.py``); the cluster secret is what authorises
them, as it authorises a plan's offer on channel 2, so a list of routers on the
stage would protect nothing the secret does not. ``run`` only on the first stage;
``act`` only from the upstream stage; ``next`` only from the last stage; a
sequence belongs to the identity that prepared it, and a command on it from
another identity is refused (``not_owner``) and changes nothing. Each router's
prompt-cache entries are its own (``attach``'s epoch, ``keep``'s and ``reuse``'s
entry ids, ``forget``: all of the sender's store only, ``kvstore.StageCache``),
so two routers' ids never collide and one's ``attach`` clears nothing of the
other's. Replies
go over the connection they answer, or,
for ``token`` and errors from the activation path, over the owner's own
connection; an activation for a sequence nobody prepared is dropped (nothing
can correlate it). Every tensor's dtype and shape is checked against these
specs before any blob is copied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mlxceld.engine.base import (
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    REPETITION_CONTEXT,
    Constraint,
    EngineError,
    SamplingParams,
)
from mlxceld.roles.options import MAX_DRAFT_TOKENS, KVQuant
from mlxceld.roles.parsing import InvalidOption
from mlxceld.wire import MessageSpec, TensorSpec

MAX_STEP_TOKENS: Final = 2048  # tokens in one run/act (the engine's chunks: engine.chunks)
PREFILL_CHUNK: Final = 512  # a one-stage pipeline's chunk, and mlx-lm's own (kv start > 0)
MAX_SEQUENCES: Final = 256  # prepared sequences one stage keeps at once
MAX_EOS: Final = 64  # end-of-sequence token ids in one ``prepare``
MAX_FORGET: Final = 256  # prompt-cache entries one ``forget`` names
MAX_TEMPERATURE: Final = 100.0
MAX_PENALTY: Final = 100.0  # |presence|, |frequency|, repetition (the API allows less)
MAX_BIAS: Final = 100.0  # |logit_bias| values

ERR_NOT_COORDINATOR: Final = "not_coordinator"
ERR_NOT_UPSTREAM: Final = "not_upstream"
ERR_NOT_LAST: Final = "not_last_stage"
ERR_NOT_OWNER: Final = "not_owner"
ERR_UNKNOWN_SEQ: Final = "unknown_sequence"
ERR_MODEL_MISMATCH: Final = "model_mismatch"
ERR_BAD_MESSAGE: Final = "bad_message"
ERR_TOO_MANY: Final = "too_many_sequences"
ERR_STAGE_FAILED: Final = "stage_failed"
ERR_GROUP_BROKEN: Final = "group_broken"  # a tensor stage's group broke: its process ends
ERR_DOWNSTREAM: Final = "downstream_unreachable"
ERR_STANDBY: Final = "standby"
ERR_DRAINING: Final = "draining"  # the stage is stopping: no new sequence (stage.py, drain)
ERR_BAD_CONSTRAINT: Final = "bad_constraint"  # the last stage cannot use the constraint
CONSTRAINT_KINDS: Final = ("json_schema", "json_object", "lark")


class GroupBroken(EngineError):
    """A tensor stage's group broke (a rank gone, the ring lost: ``tensor_stage.py``): the
    stage tells each owner ``ERR_GROUP_BROKEN``, and its process ends; a router whose
    switch holds replays the sequence as a lost stage's (``replay.py``). Defined here,
    with its code, so that the stage service need not import mlx to name it."""


class ProtocolViolation(Exception):
    """A message that is well-formed MXCL but breaks the stage protocol; ``code`` is sent."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def stage_specs(hidden_size: int, wire_dtype: str, *, first: bool) -> dict[str, MessageSpec]:
    """What a stage accepts: tokens on the first stage, hidden states elsewhere."""
    specs = {"attach": MessageSpec(), "prepare": MessageSpec(), "release": MessageSpec(),
             "adopt": MessageSpec(), "forget": MessageSpec()}
    if first:
        specs["run"] = MessageSpec({"tokens": TensorSpec(
            frozenset({"i32"}), ((1, 1), (1, MAX_STEP_TOKENS)))})
        # The token sampled, then the last stage's draft's proposals (speculating.py).
        specs["next"] = MessageSpec({"tokens": TensorSpec(
            frozenset({"i32"}), ((1, 1), (1, 1 + MAX_DRAFT_TOKENS)))})
    if not first:
        specs["act"] = MessageSpec({
            "hidden": TensorSpec(frozenset({wire_dtype}), ((1, 1), (1, MAX_STEP_TOKENS),
                                                           (hidden_size, hidden_size))),
            # the step's token ids, passed on to the last stage (its draft reads them)
            "tokens": TensorSpec(frozenset({"i32"}), ((1, 1), (1, MAX_STEP_TOKENS)),
                                 required=False)})
    return specs


# What the coordinator accepts from a stage.
ENGINE_SPECS: Final = {
    "attached": MessageSpec(),
    "prepared": MessageSpec(),
    "adopted": MessageSpec(),
    "error": MessageSpec(),
    "cache": MessageSpec(),
    "token": MessageSpec({"tokens": TensorSpec(frozenset({"i32"}), ((1, 1),))}),
}


PARAM_KEYS: Final = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "min_p",
                               "presence_penalty", "frequency_penalty",
                               "repetition_penalty", "logit_bias", "logprobs"})


OPTIONAL_PARAM_KEYS: Final = frozenset({"constraint", "min_tokens", "ignore_eos"})


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """``constraint``, ``min_tokens`` and ``ignore_eos`` only when set (a stage of an
    older version refuses them rather than ignore them)."""
    wire: dict[str, Any] = {
        "max_tokens": params.max_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
        "min_p": params.min_p, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": [[t, b] for t, b in params.logit_bias],
        "logprobs": params.logprobs}
    if params.constraint is not None:
        wire["constraint"] = {"kind": params.constraint.kind, "text": params.constraint.text}
    if params.min_tokens:
        wire["min_tokens"] = params.min_tokens
    if params.ignore_eos:
        wire["ignore_eos"] = True
    return wire


def _number(value: Any, name: str, low: float, high: float, *, low_open: bool = False) -> float:
    if type(value) not in (int, float) or not (low < value if low_open else low <= value) \
            or not value <= high:
        raise ProtocolViolation(ERR_BAD_MESSAGE, f"'params.{name}' out of range")
    return float(value)


def params_from_wire(value: object, vocab_size: int | None = None) -> SamplingParams:
    """The request's sampling parameters, each checked (the last stage samples with them;
    ``vocab_size``: its model's, which every ``logit_bias`` id must be below)."""
    if not isinstance(value, dict) or set(value) - OPTIONAL_PARAM_KEYS != PARAM_KEYS:
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params' must hold exactly "
                                f"{', '.join(sorted(PARAM_KEYS))}, and may hold "
                                f"{', '.join(sorted(OPTIONAL_PARAM_KEYS))}")
    max_tokens, top_k, seed = value["max_tokens"], value["top_k"], value["seed"]
    if type(max_tokens) is not int or not 1 <= max_tokens < 2**31:
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.max_tokens' out of range")
    if type(top_k) is not int or top_k < 0:
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.top_k' out of range")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**64):
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.seed' out of range")
    logprobs = value["logprobs"]
    if logprobs is not None and (type(logprobs) is not int
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.logprobs' out of range")
    min_tokens, ignore_eos = value.get("min_tokens", 0), value.get("ignore_eos", False)
    if type(min_tokens) is not int or not 0 <= min_tokens <= max_tokens:
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.min_tokens' out of range")
    if type(ignore_eos) is not bool:
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.ignore_eos' must be true or false")
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
        temperature=_number(value["temperature"], "temperature", 0, MAX_TEMPERATURE),
        top_p=_number(value["top_p"], "top_p", 0, 1, low_open=True),
        top_k=top_k, seed=seed,
        min_p=_number(value["min_p"], "min_p", 0, 1),
        presence_penalty=_number(value["presence_penalty"], "presence_penalty",
                                 -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(value["frequency_penalty"], "frequency_penalty",
                                  -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=_number(value["repetition_penalty"], "repetition_penalty", 0,
                                   MAX_PENALTY, low_open=True),
        logit_bias=_logit_bias(value["logit_bias"], vocab_size),
        logprobs=logprobs, constraint=constraint_of(value.get("constraint")))


def _logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, list) or len(value) > MAX_LOGIT_BIAS:
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.logit_bias' must be a list of at "
                                f"most {MAX_LOGIT_BIAS} [token id, bias] pairs")
    pairs: dict[int, float] = {}
    for item in value:
        if not isinstance(item, list) or len(item) != 2 or type(item[0]) is not int \
                or not 0 <= item[0] < (vocab_size or 2**31) or item[0] in pairs:
            raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.logit_bias' holds a pair that "
                                    "is not [token id in the vocabulary, bias] (or an id twice)")
        pairs[item[0]] = _number(item[1], "logit_bias", -MAX_BIAS, MAX_BIAS)
    return tuple(sorted(pairs.items()))


def history_of(header: Mapping[str, Any]) -> tuple[int, ...]:
    """The ``prepare``'s prompt tail (token ids the last stage's processors look back on)."""
    history = header.get("history", [])
    if not isinstance(history, list) or len(history) > REPETITION_CONTEXT or any(
            type(t) is not int or not 0 <= t < 2**31 for t in history):
        raise ProtocolViolation(ERR_BAD_MESSAGE, f"'history' must be a list of at most "
                                f"{REPETITION_CONTEXT} token ids")
    return tuple(history)


KV_KEYS: Final = frozenset({"bits", "group_size", "start"})


def kv_to_wire(kv: KVQuant) -> dict[str, int]:
    """A ``prepare``'s ``kv``."""
    return {"bits": kv.bits, "group_size": kv.group_size, "start": kv.start}


def kv_of(header: Mapping[str, Any]) -> KVQuant | None:
    """The ``prepare``'s quantized KV cache (None: full precision), each field checked."""
    value = header.get("kv")
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != KV_KEYS or any(
            type(v) is not int or not 0 <= v < 2**31 for v in value.values()):
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'kv' must hold exactly bits, group_size "
                                "and start, each an integer in [0, 2**31)")
    try:
        return KVQuant(value["bits"], value["group_size"], value["start"])
    except InvalidOption as exc:
        raise ProtocolViolation(ERR_BAD_MESSAGE, f"'kv.{exc.key}' must {exc.rule}, not "
                                f"{exc.value!r}") from None


def constraint_of(value: object) -> Constraint | None:
    """``params.constraint``: its kind and its text, bounded (compiled on the last stage)."""
    from mlxceld.engine.constraints import MAX_CONSTRAINT_BYTES, wire_size

    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"kind", "text"}:
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.constraint' must hold exactly kind "
                                "and text")
    kind, text = value["kind"], value["text"]
    if kind not in CONSTRAINT_KINDS:
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.constraint.kind' must be one of "
                                f"{', '.join(CONSTRAINT_KINDS)}")
    if not isinstance(text, str) or wire_size(text) > MAX_CONSTRAINT_BYTES:
        raise ProtocolViolation(ERR_BAD_MESSAGE, "'params.constraint.text' must be a string "
                                f"of at most {MAX_CONSTRAINT_BYTES} bytes as JSON")
    return Constraint(kind, text)


def eos_of(header: Mapping[str, Any]) -> frozenset[int]:
    """The ``prepare``'s end-of-sequence token ids (the last stage stops at one)."""
    eos = header.get("eos", [])
    if not isinstance(eos, list) or len(eos) > MAX_EOS or any(
            type(t) is not int or not 0 <= t < 2**31 for t in eos):
        raise ProtocolViolation(ERR_BAD_MESSAGE, f"'eos' must be a list of at most {MAX_EOS} "
                                "token ids")
    return frozenset(eos)
