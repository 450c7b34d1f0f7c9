"""Log-probabilities through the router app as the real ``openai`` client parses them (in
process, a fake engine of one token per byte): which token goes with which text, held
back by an incomplete UTF-8 character or a stop string, whole and streamed."""

from __future__ import annotations

import asyncio

from mlxceld.api.logprobs import LogprobTracker, token_name
from mlxceld.engine import TokenOutput

from helpers.api import MODEL, make_app, openai_client
from helpers.fakes import FakeEngine

USER = [{"role": "user", "content": "hi"}]


def test_chat_logprobs_whole_and_streamed() -> None:
    reply = "Grüße one two three"

    async def main() -> None:
        async with openai_client(make_app(FakeEngine(reply=reply.encode()))) as client:
            whole = await client.chat.completions.create(
                model=MODEL, messages=USER, logprobs=True, top_logprobs=2, stop=["two"])
            stream = await client.chat.completions.create(
                model=MODEL, messages=USER, logprobs=True, stop=["two"], stream=True)
            chunks = [c async for c in stream]
            plain = await client.chat.completions.create(model=MODEL, messages=USER)
        shown = "Grüße one "
        choice = whole.choices[0]
        assert choice.message.content == shown
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        # one entry per token shown, none for the stop string's; bytes make up the text
        assert b"".join(bytes(e.bytes or []) for e in content) == shown.encode()
        assert [e.token for e in content[2:4]] == ["bytes:\\xc3", "bytes:\\xbc"]  # ü
        for e in content:
            token = (e.bytes or [])[0]
            assert e.logprob == -token / 1000
            assert [(t.bytes, t.logprob) for t in e.top_logprobs] == \
                [([token], e.logprob), ([(token + 1) % 256], e.logprob - 0.5)]
        # streamed: each chunk carries the tokens of its own text
        texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(texts) == shown
        for c in chunks[1:-1]:
            assert c.choices[0].logprobs is not None
            entries = c.choices[0].logprobs.content or []
            assert b"".join(bytes(e.bytes or []) for e in entries) == \
                (c.choices[0].delta.content or "").encode()
            assert all(e.top_logprobs == [] for e in entries)
        assert plain.choices[0].logprobs is None

    asyncio.run(main())


def test_completion_logprobs_whole_and_streamed() -> None:
    async def main() -> None:
        async with openai_client(make_app(FakeEngine(reply=b"ab cd"))) as client:
            whole = await client.completions.create(model=MODEL, prompt="p", logprobs=2)
            stream = await client.completions.create(model=MODEL, prompt="p", logprobs=0,
                                                     stream=True)
            chunks = [c async for c in stream]
        lp = whole.choices[0].logprobs
        assert lp is not None
        assert lp.tokens == ["a", "b", " ", "c", "d"]
        assert lp.token_logprobs == [-ord(t) / 1000 for t in "ab cd"]
        assert lp.text_offset == [0, 1, 2, 3, 4]
        assert lp.top_logprobs is not None
        assert lp.top_logprobs[0] == {"a": -0.097, "b": -0.597}
        streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].text]
        assert [t for s in streamed if s for t in s.tokens or []] == lp.tokens
        assert [o for s in streamed if s for o in s.text_offset or []] == lp.text_offset

    asyncio.run(main())


def test_tracker_releases_a_token_with_its_text() -> None:
    tracker = LogprobTracker(lambda t: bytes([t]))

    def out(token: int) -> TokenOutput:
        return TokenOutput(token, None, -1.0, ())

    tracker.add(out(0x61), "a")
    assert [e.token for e in tracker.shown("a")] == [0x61]
    tracker.add(out(0xC3), "")  # half a character: nothing to show yet
    assert tracker.shown("") == ()
    tracker.add(out(0xA9), "é")  # both halves go out with it
    held = tracker.shown("")  # a stop matcher holds "é" back (it may start "é!")
    assert held == ()
    assert [e.token for e in tracker.shown("é")] == [0xC3, 0xA9]
    tracker.add(out(0x21), "!")  # the stop string: never shown, never reported
    assert tracker.shown("") == () and tracker.finish() == ()
    assert token_name(b"\xc3") == "bytes:\\xc3" and token_name("é".encode()) == "é"
