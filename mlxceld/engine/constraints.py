"""Constrained decoding with llguidance: the output matches a JSON schema, any JSON object
or a Lark grammar, because each step's logits are masked to the tokens the grammar allows.

- ``compile_grammar(constraint)``: the constraint as llguidance's grammar, checked. One it
  cannot honour (not JSON, a schema keyword llguidance does not implement, a Lark syntax
  error, over the size or complexity limits) raises ``ConstraintError``, which the API
  answers with a 400 naming ``response_format``; a schema that compiles but that no finite
  value matches (its ``$ref``s loop with no way out: ``finiteness.py``) raises
  ``EndlessSchema``, a 400 naming the schema's own field, where llguidance would let the
  sequence end at once with nothing, or never close its JSON. It needs no tokenizer, so the router
  checks a request before admitting it, whichever engine serves it.
- ``ConstraintTokenizer``: llguidance's view of the model's vocabulary, built once per
  engine from the Hugging Face tokenizer, sized to the model's head (which may hold more
  rows than the tokenizer has tokens) and told the engine's end-of-sequence ids. Its
  ``matcher(constraint)`` is one sequence's ``Matching`` (a copy of a compiled matcher
  kept per constraint: the ``CACHED_GRAMMARS`` most recent, so a schema an application
  sends with every request is compiled once).
- ``Matching``: an mlx-lm logits processor ``(tokens, logits) -> logits``. Each call
  consumes the tokens sampled since the last call (the first call sees the prompt and
  consumes nothing), fills the mask of allowed tokens and sets every other logit to -inf.
  Once the grammar is complete only the end-of-sequence tokens are allowed, so the
  sequence ends with finish_reason "stop"; max_tokens may cut it short first ("length",
  the JSON unfinished), as OpenAI does.

JSON is generated compact (``JSON_OPTIONS``: no whitespace between tokens): a model may
otherwise pad an object with whitespace until max_tokens, and the parsed value is the same.

The mask is applied here (numpy unpacks the bits, ``mx.where`` masks) rather than by
``llguidance.mlx``, whose Metal kernel does not run on mlx's CPU backend.

Limits: a constraint's text is at most ``MAX_CONSTRAINT_BYTES``; llguidance's parser
limits (``LIMITS``: its defaults) bound a grammar's size, its lexer and each step's work
(at those limits about 15 ms a step; a schema's mask takes tens of microseconds), so no
request holds the batch's steps for long. Compiling is bounded by them too (up to about a
second), and runs off the event loop and off the step thread.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from mlxceld.engine.base import Constraint
from mlxceld.engine.finiteness import endless

log = logging.getLogger(__name__)

# A schema or grammar's text, measured as the JSON string that carries it (its quotes
# escaped): the pipeline sends it in a ``prepare`` header, at most 64 KiB in all.
MAX_CONSTRAINT_BYTES = 48 * 1024
CACHED_GRAMMARS = 32  # compiled matchers kept per engine, most recently used
JSON_OPTIONS: Any = {"whitespace_flexible": False}  # compact JSON (llguidance's TypedDict)
LIMITS = llguidance.LLParserLimits()
MAX_ERROR_CHARS = 300  # llguidance's reason, as quoted in a refusal


class ConstraintError(ValueError):
    """A constraint llguidance cannot honour; the message says what is wrong with it."""


class EndlessSchema(ConstraintError):
    """A JSON schema that compiles but that no finite value matches (``finiteness.py``):
    its references loop with no way out. The API names the schema's own field."""


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def compile_grammar(constraint: Constraint) -> str:
    """The constraint as llguidance's grammar (a JSON string), checked without a tokenizer.
    The ``CACHED_GRAMMARS`` most recent are kept (a refusal is not)."""
    size = wire_size(constraint.text)
    if size > MAX_CONSTRAINT_BYTES:
        raise ConstraintError(f"the {_name(constraint)} is {size} bytes long as JSON; at most "
                              f"{MAX_CONSTRAINT_BYTES} are allowed")
    if constraint.kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=JSON_OPTIONS)
    elif constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.text)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ConstraintError("the JSON schema must be an object")
        why = endless(schema)
        if why is not None:
            raise EndlessSchema(f"the JSON schema admits no finite value: {why}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint.text,
                                                                     defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise ConstraintError(f"the JSON schema cannot be used: {exc}") from None
    else:
        grammar = llguidance.LLMatcher.grammar_from_lark(constraint.text)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None,
                                                                            limits=LIMITS)
    if failed:
        raise ConstraintError(f"the {_name(constraint)} cannot be used: {_first_line(messages)}")
    return grammar


def wire_size(text: str) -> int:
    """``text``'s size as a JSON string, in UTF-8 bytes."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _name(constraint: Constraint) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object format",
            "lark": "Lark grammar"}[constraint.kind]


def _first_line(messages: list[str]) -> str:
    """llguidance's error on one line, cut to ``MAX_ERROR_CHARS``."""
    text = " ".join((messages[0] if messages else "").split()) or "llguidance refused it"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


class ConstraintTokenizer:
    """llguidance's tokenizer for one model, and the compiled matchers of recent constraints.
    Thread-safe: the API's threads build matchers while the engine's step thread uses them."""

    def __init__(self, hf_tokenizer: Any, *, vocab_size: int, eos_token_ids: Iterable[int]
                 ) -> None:
        import llguidance.hf  # imports transformers: only where a tokenizer is built

        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=vocab_size, eos_token=self.eos_token_ids)
        except (ValueError, TypeError) as exc:  # a slow (Python) tokenizer
            raise ConstraintError(f"this model's tokenizer cannot drive constrained "
                                  f"decoding: {exc}") from exc
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, constraint: Constraint) -> Matching:
        """A fresh matcher for one sequence; ``ConstraintError`` if the grammar is refused.
        Compiling a large grammar takes up to about a second: call it off the step thread."""
        with self._lock:
            template = self._compiled.get(constraint)
            if template is None:
                template = llguidance.LLMatcher(self._tokenizer, compile_grammar(constraint),
                                                log_level=0, limits=LIMITS)
                if template.is_error():
                    raise ConstraintError(f"the {_name(constraint)} cannot be used: "
                                          f"{_first_line([template.get_error()])}")
                self._compiled[constraint] = template
                if len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(constraint)
            return Matching(template.deep_copy(), self.vocab_size, self.eos_token_ids)


class Matching:
    """One sequence's matcher, as an mlx-lm logits processor; see the module docstring.
    ``advance`` and ``mask`` are its two halves for a caller that keeps its own tokens
    (the pipeline's last stage)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 eos_token_ids: list[int]) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)
        self._eos_only = np.zeros(vocab_size, dtype=np.bool_)
        self._eos_only[[t for t in eos_token_ids if t < vocab_size]] = True
        self._seen: int | None = None  # tokens in the context at the last call
        self._failed = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # The step's forward pass starts now, and runs while this thread waits for the last
        # token and computes the mask; mlx-lm would start it only after the processors.
        mx.async_eval(logits)  # type: ignore[no-untyped-call]
        size = int(tokens.size)
        if self._seen is not None and size > self._seen:
            new: list[int] = tokens[self._seen:].tolist()  # type: ignore[assignment]
            self.advance(new)
        self._seen = size
        return self.mask(logits)

    def advance(self, tokens: list[int]) -> None:
        """Consume tokens sampled under the last mask. Once the grammar has stopped, the
        tokens that follow (the end-of-sequence token, seen again when mlx-lm steps ahead of
        its stop check) are no part of the output and are passed over."""
        if self._matcher.is_stopped() and not self._matcher.is_error():
            return
        if not self._matcher.consume_tokens(tokens) and not self._failed:
            self._failed = True  # a token the mask did not allow: end the sequence
            # Its reason only: llguidance's error text quotes the output and the grammar.
            log.warning("constrained decoding failed (%s); ending the sequence",
                        self._matcher.stop_reason())

    def mask(self, logits: mx.array) -> mx.array:
        """``logits`` ``[..., vocab]`` with every token the grammar does not allow at -inf."""
        allowed: np.ndarray[Any, Any]
        if self._failed or self._matcher.is_error():
            allowed = self._eos_only
        else:
            self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data,
                                                  self._bitmask.nbytes)
            allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        width = logits.shape[-1]
        keep = mx.array(allowed[:width].astype(np.bool_, copy=False))
        if width > self._vocab_size:  # rows past the vocabulary are never allowed
            keep = mx.concatenate([keep, mx.zeros(width - keep.size, dtype=mx.bool_)])
        return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def is_accepting(self) -> bool:
        """Whether the output so far is complete by the grammar."""
        return bool(self._matcher.is_accepting())
