"""A prompt's size against the context, and where tokenizing and detokenizing run: a
prompt that cannot fit is refused by its bytes before it is tokenized; tokenizing runs
in a thread (large prompts in their own), a non-incremental decoder too."""

from __future__ import annotations

import asyncio
import json
import threading

from mlxceld.api import StreamDecoder
from mlxceld.api.requests import PROMPT_BYTES_PER_TOKEN
from mlxceld.api.tokenizing import LARGE_PROMPT_BYTES

from helpers.api import MODEL, http_client, make_app
from helpers.fakes import ByteCodec, ByteDecoder, FakeEngine


class WatchedCodec(ByteCodec):
    """The byte codec, noting the thread of every prompt encoded (a chat's too: the byte
    codec encodes its template's text as a prompt) and of every token decoded; its
    decoders are incremental or not, as asked."""

    def __init__(self, incremental: bool = True) -> None:
        self.incremental = incremental
        self.encoded_on: list[str] = []
        self.decoded_on: list[str] = []

    def encode_prompt(self, text: str) -> list[int]:
        self.encoded_on.append(threading.current_thread().name)
        return super().encode_prompt(text)

    def decoder(self) -> StreamDecoder:
        codec = self

        class Watched(ByteDecoder):
            def add(self, token: int) -> str:
                codec.decoded_on.append(threading.current_thread().name)
                return super().add(token)

        return Watched(self.incremental)


def error_of(response: object) -> dict[str, str]:
    assert hasattr(response, "status_code") and hasattr(response, "json")
    assert response.status_code == 400, response.json()
    err: dict[str, str] = response.json()["error"]
    return err


def test_a_prompt_too_long_in_bytes_is_refused_before_it_is_tokenized() -> None:
    engine = FakeEngine(context_length=256)
    most = 256 * PROMPT_BYTES_PER_TOKEN
    codec = WatchedCodec()

    async def main() -> None:
        async with http_client(make_app(engine, codec)) as client:
            prompt = await client.post("/v1/completions", json={"prompt": "é" * (most // 2 + 1)})
            err = error_of(prompt)
            assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
            assert err["message"] == (
                f"the prompt is {most + 2} bytes long; this model's maximum context length is "
                f"256 tokens, which holds at most {most} bytes of prompt "
                f"({PROMPT_BYTES_PER_TOKEN} a token); shorten the prompt")
            halves = [{"role": "user", "content": "x" * (most // 2)}] * 2 + \
                [{"role": "user", "content": "y"}]
            chat = await client.post("/v1/chat/completions",
                                     json={"model": MODEL, "messages": halves})
            assert error_of(chat)["param"] == "messages"
            assert codec.encoded_on == []
            # Within the bytes, but not the tokens: tokenized, then refused by its tokens.
            fits = await client.post("/v1/completions", json={"prompt": "x" * most})
            err = error_of(fits)
            assert err["code"] == "context_length_exceeded"
            assert f"the prompt has {most} tokens" in err["message"]
        assert engine.requests == []

    asyncio.run(main())


def test_tokenizing_runs_in_threads_and_large_prompts_in_their_own() -> None:
    engine = FakeEngine(context_length=LARGE_PROMPT_BYTES // PROMPT_BYTES_PER_TOKEN + 1,
                        reply=b"ok")
    codec = WatchedCodec()

    async def main() -> None:
        async with http_client(make_app(engine, codec)) as client:
            small = await client.post("/v1/completions", json={"prompt": "hello"})
            assert small.status_code == 200 and small.json()["choices"][0]["text"] == "ok"
            chat = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 200
            large = await client.post("/v1/completions", content=json.dumps(
                {"prompt": "x" * LARGE_PROMPT_BYTES}))
            assert "tokens" in error_of(large)["message"]  # tokenized, then too long

    asyncio.run(main())
    main_thread = threading.main_thread().name
    assert main_thread not in codec.encoded_on
    assert len(codec.encoded_on) == 3 and codec.encoded_on[-1].startswith("large-prompt")
    assert not any(name.startswith("large-prompt") for name in codec.encoded_on[:2])


def test_a_decoder_that_is_not_incremental_runs_in_a_thread() -> None:
    async def decoded_on(incremental: bool) -> set[str]:
        codec = WatchedCodec(incremental)
        async with http_client(make_app(FakeEngine(reply=b"hey"), codec)) as client:
            response = await client.post("/v1/completions", json={"prompt": "hello"})
            assert response.json()["choices"][0]["text"] == "hey"
        return set(codec.decoded_on)

    assert asyncio.run(decoded_on(True)) == {threading.main_thread().name}
    assert threading.main_thread().name not in asyncio.run(decoded_on(False))
