"""A user's load: ``clients`` threads streaming completions back to back through the real
`openai` client with retries off, as a chat UI would, until stopped or a bound passes.
Nothing is retried: a refusal (any status before the stream began, or a connection
refused) and a stream that breaks are counted, and the tests that use it assert how many
(an operation "without an outage" allows none)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import openai

from helpers.models import PROMPT
from helpers.router import client


@dataclass
class StreamingLoad:
    url: str  # http://HOST:PORT/v1
    clients: int = 4
    max_tokens: int = 24
    prompt: str = PROMPT
    model: str = "llama"
    bound_s: float = 120.0  # the load stops by then in any case
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    completed: int = 0
    refused: list[str] = field(default_factory=list)  # before the stream began
    failed: list[str] = field(default_factory=list)  # the stream broke, or no finish
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> StreamingLoad:
        until = time.monotonic() + self.bound_s
        self._threads = [threading.Thread(target=self._run, args=(until,), daemon=True)
                         for _ in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(90)

    def _run(self, until: float) -> None:
        with client(self.url) as c:
            while not self.stop.is_set() and time.monotonic() < until:
                with self.lock:
                    self.sent += 1
                kind, what = self._one(c)
                with self.lock:
                    if kind == "completed":
                        self.completed += 1
                    else:
                        (self.refused if kind == "refused" else self.failed).append(what)

    def _one(self, c: openai.OpenAI) -> tuple[str, str]:
        try:
            stream = c.completions.create(model=self.model, prompt=self.prompt, stream=True,
                                          max_tokens=self.max_tokens, temperature=0)
        except openai.APIStatusError as exc:
            return "refused", f"{exc.status_code}: {exc.message}"
        except openai.APIError as exc:
            return "refused", f"{type(exc).__name__}: {exc}"
        finish = None
        try:
            for chunk in stream:
                finish = chunk.choices[0].finish_reason or finish
        except openai.APIError as exc:
            return "failed", f"mid-stream: {exc}"
        return ("completed", "") if finish else ("failed", "no finish_reason")

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"sent": self.sent, "completed": self.completed,
                    "refused": len(self.refused), "failed": len(self.failed)}
