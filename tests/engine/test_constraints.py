"""Constrained decoding in the local engine (engine/constraints.py) on our tiny fixtures:
what comes out matches the schema or grammar, whatever shares the batch."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import mlx.core as mx
import pytest
from mlx_lm import load
from pydantic import BaseModel, ConfigDict, Field

from mlxceld.engine import Constraint, GenerationRequest, SamplingParams
from mlxceld.engine.constraints import MAX_CONSTRAINT_BYTES, ConstraintError, compile_grammar
from mlxceld.engine.loading import constraint_tokenizer, load_local_engine
from mlxceld.engine.local import LocalEngine


class Colour(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no other keys: a free key never ends

    colour: Literal["red", "green", "blue"]
    n: int = Field(ge=3, le=17)


class Listing(BaseModel):
    model_config = ConfigDict(extra="forbid")

    xs: list[Annotated[int, Field(ge=-5, le=999)]] = Field(max_length=3)  # numbers bounded
    name: str = Field(max_length=8)


class Nested(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[Colour] = Field(max_length=2)
    ok: bool


MODELS: list[type[BaseModel]] = [Colour, Listing, Nested]


def schema(model: type[BaseModel]) -> Constraint:
    return Constraint("json_schema", json.dumps(model.model_json_schema()))


async def text_of(engine: LocalEngine, tokenizer: Any, constraint: Constraint | None, *,
                  n: int = 160, **params: Any) -> tuple[str, str | None]:
    req = GenerationRequest("t", tokenizer.encode("Answer in JSON:"),
                            SamplingParams(max_tokens=n, constraint=constraint, **params))
    outs = [o async for o in engine.generate(req)]
    tokens = [o.token for o in outs if o.token not in tokenizer.eos_token_ids]
    return tokenizer.decode(tokens), outs[-1].finish_reason


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_json_schema_output_validates_batched_with_free_text(fixture_dir: Path,
                                                             family: str) -> None:
    async def run() -> None:
        engine, tokenizer = load_local_engine(str(fixture_dir / family), max_batch=8)
        try:
            free_alone = await text_of(engine, tokenizer, None, n=30, temperature=0)
            jobs = [text_of(engine, tokenizer, schema(m), temperature=t, seed=s)
                    for m in MODELS for t, s in ((0, None), (1.0, 5))]
            *got, free_batched = await asyncio.gather(
                *jobs, text_of(engine, tokenizer, None, n=30, temperature=0))
            assert free_batched == free_alone  # a constrained neighbour changes nothing
            for (text, reason), model in zip(got, [m for m in MODELS for _ in (0, 1)],
                                             strict=True):
                assert reason == "stop", text  # the grammar completed, then only EOS
                model.model_validate_json(text)
        finally:
            await engine.aclose()

    asyncio.run(run())


class Leaning:
    """A fixture model with a bias on its logits, so that it ends what it opens: random
    weights never close a free JSON string by themselves."""

    def __init__(self, model: Any, bias: mx.array) -> None:
        self._model = model
        self._bias = bias
        self.layers = model.layers

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        out: mx.array = self._model(inputs, cache=cache, **kwargs) + self._bias
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_json_object_and_lark(fixture_dir: Path) -> None:
    path = str(fixture_dir / "qwen3")
    model, tokenizer = load(path)
    vocab = model.args.vocab_size
    eos = set(tokenizer.eos_token_ids)
    closers = [t for s in ('"', "}") for t in tokenizer.encode(s)]
    bias = mx.zeros(vocab).at[mx.array(closers)].add(6.0)
    mx.eval(bias)  # here: the engine's thread has no stream to evaluate it on

    async def run() -> None:
        engine = LocalEngine(Leaning(model, bias), model_id="q", context_length=2048,
                             eos_token_ids=eos, vocab_size=vocab, max_batch=4,
                             constraints=constraint_tokenizer(tokenizer, vocab, eos))
        try:
            for seed in (1, 2, 3):
                text, reason = await text_of(engine, tokenizer, Constraint("json_object"),
                                             temperature=1.0, seed=seed)
                assert reason == "stop", text
                assert isinstance(json.loads(text), dict)
            lark = Constraint("lark", 'start: ("yes" | "no") " " /[0-9]{2}/')
            text, reason = await text_of(engine, tokenizer, lark, temperature=1.0, seed=4)
            assert reason == "stop"
            word, number = text.split(" ")
            assert word in ("yes", "no") and len(number) == 2 and number.isdigit()
        finally:
            await engine.aclose()

    asyncio.run(run())


@pytest.mark.parametrize(("constraint", "says"), [
    (Constraint("json_schema", "{not json"), "not valid JSON"),
    (Constraint("json_schema", "[1, 2]"), "must be an object"),
    (Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "nope"}}}'),
     "nope"),
    (Constraint("json_schema", '{"type": "string", "format": "no-such-format"}'),
     "no-such-format"),
    (Constraint("json_schema", '{"type": "array", "uniqueItems": true}'),  # not ignored
     "Unimplemented keys"),
    (Constraint("lark", "start: missing_rule"), "missing_rule"),
    (Constraint("json_schema", " " * (MAX_CONSTRAINT_BYTES + 1)), "at most"),
])
def test_a_constraint_llguidance_cannot_honour_is_refused(constraint: Constraint,
                                                          says: str) -> None:
    with pytest.raises(ConstraintError, match=says):
        compile_grammar(constraint)


def test_the_engine_refuses_a_bad_constraint_and_keeps_serving(fixture_dir: Path) -> None:
    async def run() -> None:
        engine, tokenizer = load_local_engine(str(fixture_dir / "llama"), max_batch=2)
        try:
            with pytest.raises(ConstraintError):
                await text_of(engine, tokenizer, Constraint("lark", "start: nope"))
            assert engine.active_sequences() == 0
            text, reason = await text_of(engine, tokenizer, schema(Colour), temperature=0)
            assert reason == "stop"
            Colour.model_validate_json(text)
        finally:
            await engine.aclose()

    asyncio.run(run())


def test_a_token_the_grammar_refused_leaves_only_eos(fixture_dir: Path) -> None:
    """A matcher fed a token its mask did not allow (a bug) ends the sequence rather than
    letting anything through; its vocabulary's rows past the tokenizer's stay masked."""
    model, tokenizer = load(str(fixture_dir / "llama"))
    vocab = model.args.vocab_size
    eos = set(tokenizer.eos_token_ids)
    tokens = constraint_tokenizer(tokenizer, vocab, eos)
    assert not isinstance(tokens, ConstraintError)
    matching = tokens.matcher(Constraint("lark", 'start: "yes"'))
    allowed = mx.isfinite(matching.mask(mx.zeros((1, vocab + 7))))[0].tolist()
    assert 0 < sum(allowed) < vocab and not any(allowed[vocab:])
    matching.advance(tokenizer.encode("no"))
    allowed = mx.isfinite(matching.mask(mx.zeros((1, vocab))))[0].tolist()
    assert {i for i, ok in enumerate(allowed) if ok} == eos
