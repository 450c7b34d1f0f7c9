"""The router app as the real ``openai`` package sees it (in process, ASGI transport)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from helpers.api import KEY, MODEL, http_client, make_app, openai_client
from helpers.fakes import FakeEngine

USER = [{"role": "user", "content": "hi"}]
CHAT_PROMPT = len("<user>hi<assistant>")


def test_models() -> None:
    async def main() -> None:
        async with openai_client(make_app()) as client:
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
            one = await client.models.retrieve(MODEL)
            assert one.owned_by == "mlxceld"
            # the context served (the engine's: [serve] context_length caps the model's)
            assert models.data[0].to_dict()["context_length"] == 256
            assert one.to_dict()["context_length"] == 256
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve("nope")

    asyncio.run(main())


def test_chat_whole() -> None:
    async def main() -> None:
        engine = FakeEngine(reply="Grüße!".encode())
        async with openai_client(make_app(engine)) as client:
            answer = await client.chat.completions.create(model=MODEL, messages=USER,
                                                          temperature=0, seed=3, top_p=0.5)
        assert answer.object == "chat.completion" and answer.model == MODEL
        assert answer.id.startswith("chatcmpl-") and answer.created > 0
        choice = answer.choices[0]
        assert (choice.message.role, choice.message.content) == ("assistant", "Grüße!")
        assert choice.finish_reason == "stop"
        assert answer.usage is not None
        # Every byte of the reply, and the EOS token: it was generated, so it is counted.
        reply_tokens = len("Grüße!".encode()) + 1
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens,
                answer.usage.total_tokens) == (CHAT_PROMPT, reply_tokens,
                                               CHAT_PROMPT + reply_tokens)
        [request] = engine.requests
        assert request.request_id == answer.id
        assert (request.params.temperature, request.params.seed, request.params.top_p) == \
            (0.0, 3, 0.5)
        assert request.params.max_tokens == 256 - CHAT_PROMPT  # what is left of the context

    asyncio.run(main())


def test_chat_stream_with_usage() -> None:
    async def main() -> None:
        engine = FakeEngine(reply="naïve café ☕".encode())
        async with openai_client(make_app(engine)) as client:
            stream = await client.chat.completions.create(
                model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
        assert {c.object for c in chunks} == {"chat.completion.chunk"}
        assert len({c.id for c in chunks}) == 1
        first, *middle, last, usage = chunks
        assert first.choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in middle) == "naïve café ☕"
        assert all(c.usage is None for c in chunks[:-1])
        assert last.choices[0].finish_reason == "stop"
        assert last.choices[0].delta.content is None
        assert usage.choices == [] and usage.usage is not None
        assert usage.usage.completion_tokens == len("naïve café ☕".encode()) + 1

    asyncio.run(main())


def test_completion_whole_and_streamed_to_max_tokens() -> None:
    async def main() -> None:
        engine = FakeEngine()  # echoes the prompt over and over
        async with openai_client(make_app(engine)) as client:
            answer = await client.completions.create(model=MODEL, prompt="abc", max_tokens=7)
            assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
            assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("abcabca",
                                                                                 "length")
            assert answer.usage is not None
            assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, 7)
            stream = await client.completions.create(model=MODEL, prompt="xy", max_tokens=5,
                                                     stream=True)
            chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks) == "xyxyx"
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        assert all(c.usage is None for c in chunks)
        assert engine.cancelled == []

    asyncio.run(main())


def test_stop_strings_cut_the_text_and_cancel_the_sequence() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"one two three four five")
        async with openai_client(make_app(engine)) as client:
            answer = await client.chat.completions.create(model=MODEL, messages=USER,
                                                          stop=["four", "hree"])
            stream = await client.chat.completions.create(
                model=MODEL, messages=USER, stop="two", stream=True,
                stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
        assert answer.choices[0].message.content == "one two t"
        assert answer.choices[0].finish_reason == "stop"
        assert answer.usage is not None
        assert answer.usage.completion_tokens == len("one two three")
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == "one "
        assert chunks[-2].choices[0].finish_reason == "stop"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
        assert engine.cancelled == [r.request_id for r in engine.requests]

    asyncio.run(main())


def test_an_unmarked_eos_token_still_ends_the_text() -> None:
    async def main() -> None:
        engine = FakeEngine(reply=b"done", unmarked_eos=True)
        async with openai_client(make_app(engine)) as client:
            answer = await client.completions.create(model=MODEL, prompt="p")
        assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("done", "stop")

    asyncio.run(main())


def test_client_errors_as_openai_exceptions() -> None:
    async def main() -> None:
        async with openai_client(make_app(FakeEngine(context_length=16))) as client:
            with pytest.raises(openai.NotFoundError) as not_found:
                await client.chat.completions.create(model="gpt-4o", messages=USER)
            assert not_found.value.code == "model_not_found"
            with pytest.raises(openai.BadRequestError) as too_long:
                await client.completions.create(model=MODEL, prompt="x" * 40)
            assert too_long.value.code == "context_length_exceeded"
            assert "40" in too_long.value.message and "16" in too_long.value.message
            with pytest.raises(openai.BadRequestError) as bad_n:
                await client.chat.completions.create(model=MODEL, messages=USER, n=2)
            assert bad_n.value.param == "n"

    asyncio.run(main())


@pytest.mark.parametrize("key", [KEY, "sk-wrong"])
def test_api_key(key: str) -> None:
    async def main() -> None:
        app = make_app(FakeEngine(reply=b"ok"), api_key=KEY)
        async with openai_client(app, key=key) as client:
            if key == KEY:
                answer = await client.chat.completions.create(model=MODEL, messages=USER)
                assert answer.choices[0].message.content == "ok"
                return
            with pytest.raises(openai.AuthenticationError) as refused:
                await client.chat.completions.create(model=MODEL, messages=USER)
            assert refused.value.code == "invalid_api_key"
            assert KEY not in str(refused.value.body) and key not in str(refused.value.body)

    asyncio.run(main())


def test_api_key_guards_every_path_but_health() -> None:
    async def main() -> None:
        app = make_app(api_key=KEY)
        async with http_client(app) as anonymous:
            responses: dict[str, Any] = {p: await anonymous.get(p) for p in
                                         ("/health", "/ready", "/metrics", "/v1/models", "/x")}
            basic = await anonymous.get("/v1/models", headers={"Authorization": f"Basic {KEY}"})
        assert responses.pop("/health").status_code == 200
        for response in [*responses.values(), basic]:
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == "invalid_api_key"
        async with http_client(app, key=KEY) as known:
            assert (await known.get("/metrics")).status_code == 200

    asyncio.run(main())


def test_a_replaced_key_is_asked_at_each_request() -> None:
    # The router worker's key is a function of its context, which a reload's api_key op
    # changes: the next request is checked against the new key; None lets every one in.
    held: list[str | None] = [KEY]

    async def main() -> None:
        app = make_app(FakeEngine(reply=b"ok"), api_key=lambda: held[0])
        async with http_client(app) as client:
            def models(key: str) -> Any:
                return client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert [(await models(k)).status_code for k in (KEY, "sk-next-key")] == [200, 401]
            held[0] = "sk-next-key"
            assert [(await models(k)).status_code for k in (KEY, "sk-next-key")] == [401, 200]
            held[0] = None
            assert (await client.get("/v1/models")).status_code == 200

    asyncio.run(main())


# Keys that are nearly the real one: each must be refused like any wrong key, so a comparison
# that accepts a prefix, a longer key or another case cannot pass.
NEAR_KEYS = [
    KEY + "x",            # extra characters after the real key
    KEY + " x",           # ... after a space
    KEY + KEY,            # the real key twice
    KEY[:-1],             # a prefix of the real key
    KEY[:3],
    "x" + KEY,            # the real key as a suffix
    "sk-" + KEY,
    KEY.upper(),          # case changes
    KEY.capitalize(),
    KEY[:-1] + KEY[-1].upper(),
]


def test_keys_near_the_real_one_are_refused() -> None:
    async def main() -> None:
        app = make_app(FakeEngine(reply=b"ok"), api_key=KEY)
        async with http_client(app) as client:
            chat = {"model": MODEL, "messages": USER}
            for near in NEAR_KEYS:
                headers = {"Authorization": f"Bearer {near}"}
                for response in (await client.get("/v1/models", headers=headers),
                                 await client.post("/v1/chat/completions", json=chat,
                                                   headers=headers)):
                    assert response.status_code == 401, (near, response.text)
                    error = response.json()["error"]
                    assert (error["code"], error["message"]) == ("invalid_api_key",
                                                                 "invalid API key"), near
                    assert KEY not in response.text, near  # (the message already says all)
            real = {"Authorization": f"Bearer {KEY}"}
            assert (await client.get("/v1/models", headers=real)).status_code == 200
            answer = await client.post("/v1/chat/completions", json=chat, headers=real)
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["message"]["content"] == "ok"

    asyncio.run(main())
