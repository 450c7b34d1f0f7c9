"""Which tokens' log-probabilities go with which text, and their OpenAI shapes (sans-IO).

Text reaches the client later than its tokens, if at all: the detokenizer holds back
an incomplete UTF-8 character (and mlx-lm's BPE one a lone space) until a later token,
and the stop matcher holds back what may start a stop string and drops a stop string
and all after it. A token's entry therefore goes out with the text it made:

- its *start* is how many characters the decoder had let out before it, its *end* how
  many it had let out once some token from it on made text (the tokens of one
  held-back character end together, with the token that completed it);
- an entry is released once the client was shown ``end`` characters;
- when the sequence ends, the tokens whose text *began* within what was shown are
  released too (a token cut by a stop string counts: part of its text was shown);
  those wholly past a stop string never are.

The end-of-sequence token makes no text and is never reported (as OpenAI's).

Tokens are named as OpenAI names them: the text of the token's bytes, or
``bytes:\\xNN...`` where they are not whole UTF-8 (``token_name``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxceld.api.shapes import ChatLogprobs, ChatTokenLogprob, TextLogprobs, TopLogprob
from mlxceld.engine import TokenOutput


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, its top alternatives (id, bytes, logprob),
    and where its text starts in the completion (characters)."""

    token: int
    data: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...]
    offset: int


class LogprobTracker:
    """Feed it each token (``add``, with the decoder's text for it), then what the client
    is shown (``shown``); it hands back the entries that text completes."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._bytes = token_bytes
        self._made = 0  # characters the decoder let out
        self._shown = 0  # characters shown to the client
        self._pending: list[tuple[int, int | None, TokenOutput]] = []  # start, end, output

    def add(self, output: TokenOutput, text: str) -> None:
        """``output`` was decoded into ``text`` (what became final with it, maybe "")."""
        self._pending.append((self._made, None, output))
        self.made(text)

    def made(self, text: str) -> None:
        """The decoder let out ``text``: the tokens still waiting for theirs end there."""
        if text:
            self._made += len(text)
            self._pending = [(start, self._made if end is None else end, out)
                             for start, end, out in self._pending]

    def shown(self, text: str) -> tuple[TokenLogprob, ...]:
        """The client is shown ``text`` now: the entries whose text it completes."""
        self._shown += len(text)
        released = 0
        for _start, end, _out in self._pending:
            if end is None or end > self._shown:
                break
            released += 1
        return self._release(released)

    def finish(self) -> tuple[TokenLogprob, ...]:
        """The sequence ended: the entries whose text began within what was shown."""
        released = 0
        for start, end, _out in self._pending:
            if start >= self._shown and (end is None or end > self._shown):
                break
            released += 1
        return self._release(released)

    def _release(self, count: int) -> tuple[TokenLogprob, ...]:
        out, self._pending = self._pending[:count], self._pending[count:]
        return tuple(self._entry(start, o) for start, _end, o in out)

    def _entry(self, start: int, output: TokenOutput) -> TokenLogprob:
        assert output.logprob is not None
        return TokenLogprob(output.token, self._bytes(output.token), output.logprob,
                            tuple((t, self._bytes(t), lp) for t, lp in output.top),
                            min(start, self._shown))


def token_name(data: bytes) -> str:
    """A token as OpenAI shows it: its text, or ``bytes:\\xe2\\x80`` when its bytes are not
    whole UTF-8 characters."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def chat_logprobs(entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """``choices[].logprobs`` of a chat completion (or of one chunk)."""
    return {"content": [_chat_token(e) for e in entries], "refusal": None}


def _chat_token(entry: TokenLogprob) -> ChatTokenLogprob:
    top: list[TopLogprob] = [{"token": token_name(data), "logprob": lp, "bytes": list(data)}
                             for _t, data, lp in entry.top]
    return {"token": token_name(entry.data), "logprob": entry.logprob,
            "bytes": list(entry.data), "top_logprobs": top}


def text_logprobs(entries: Sequence[TokenLogprob]) -> TextLogprobs:
    """``choices[].logprobs`` of a text completion (or of one chunk)."""
    return {"tokens": [token_name(e.data) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_name(data): lp for _t, data, lp in e.top}
                             for e in entries],
            "text_offset": [e.offset for e in entries]}
