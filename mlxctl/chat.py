"""``mlxctl chat``: a terminal chat with the router, to try a model in one command.

Each line typed is a user turn; the answer streams as it comes, token by token. The
conversation (``Conversation``) keeps every turn and sends it whole each time; the
commands are ``/reset`` (forget the turns, keep ``--system``), ``/exit`` (also EOF:
Ctrl-D, or the end of piped input) and ``/help``. A reasoning model's thinking is shown
apart from its answer (dim on a terminal, each line prefixed ``thinking:`` elsewhere)
and never sent back: only the answer's content joins the history.

Ctrl-C during an answer stops that answer (its stream is closed, so the router stops
generating it); what was shown of it stays in the history, and the chat goes on. Ctrl-C
at the prompt says how to leave (as Ollama does), or ends a chat whose input is not a
terminal (exit 130).

Input that is not a terminal is read line by line, each echoed as ``> LINE`` before its
answer, so that ``printf 'hello\\n/reset\\nagain\\n' | mlxctl chat`` prints a readable
transcript. A refusal from the router (a 400 naming a field, a 503 while it loads) is one
line and a hint on stderr, and that turn is dropped; a router that does not answer at
all ends the chat with exit 1.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

import httpx

from mlxctl.edge import call_blocking, echo
from mlxctl.routerapi import (
    Delta,
    Router,
    RouterError,
    client,
    from_status,
    key_from,
    models,
    stream_chat,
)

EXIT_FAILURE: Final = 1
EXIT_INTERRUPTED: Final = 130
DIM, RESET = "\033[2m", "\033[0m"
HELP: Final = ("/reset clears the history, /exit (or Ctrl-D) ends the chat, Ctrl-C stops "
               "an answer")


@dataclass
class Conversation:
    """The turns sent with each question: ``system`` first when given, then every user
    turn and the content of its answer."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, question: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns, {"role": "user", "content": question}]

    def answered(self, question: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": question},
                       {"role": "assistant", "content": answer}]

    def reset(self) -> None:
        self.turns.clear()


@dataclass(frozen=True)
class Sampling:
    """What ``--max-tokens`` and ``--temperature`` ask of each answer (None: the
    router's default)."""

    max_tokens: int | None = None
    temperature: float | None = None

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            out["temperature"] = self.temperature
        return out


class Printer:
    """An answer as it streams: reasoning apart from content, one line at its end."""

    def __init__(self, out: TextIO, terminal: bool) -> None:
        self.out, self.terminal = out, terminal
        self.color = terminal and not os.environ.get("NO_COLOR")
        self._mode = ""  # "reasoning", "content" or "" (nothing yet on this answer)
        self._at_line_start = True

    def piece(self, delta: Delta) -> None:
        if delta.kind == "reasoning":
            if self._mode != "reasoning":
                self._newline()
                self._write("thinking: ", dim=True)
            self._mode = "reasoning"
            text = delta.text if self.terminal else delta.text.replace("\n", "\nthinking: ")
            self._write(text, dim=True)
        elif delta.kind == "content":
            if self._mode == "reasoning":
                self._newline()
            self._mode = "content"
            self._write(delta.text)

    def end(self, note: str = "") -> None:
        if note:
            self._newline()
            self._write(note, dim=True)
        self._newline()
        self._mode = ""

    def _newline(self) -> None:
        if not self._at_line_start:
            self._write("\n")

    def _write(self, text: str, dim: bool = False) -> None:
        if not text:
            return
        self.out.write(f"{DIM}{text}{RESET}" if dim and self.color else text)
        self.out.flush()
        self._at_line_start = text.endswith("\n")


@dataclass
class Chat:
    """One chat session over ``http`` with the router at ``router``."""

    router: Router
    http: httpx.Client
    conversation: Conversation
    sampling: Sampling
    out: TextIO = sys.stdout
    err: TextIO = sys.stderr
    terminal: bool = False
    model: str = ""

    def start(self) -> None:
        """Check that the router answers (and the key), learn the model if not given."""
        listed = models(self.http, self.router.url)
        self.model = self.router.model or (listed[0] if listed else "")
        if self.model not in listed:
            raise RouterError(f"the router at {self.router.url} serves no model "
                              f"{self.model!r} (it serves: {', '.join(listed) or 'none'})",
                              "pass --model with one of those", dead=True)
        self._note(f"chat with {self.model} at {self.router.url} ({HELP})")

    def run(self, read: Callable[[], str | None]) -> int:
        """Read lines with ``read`` (None: the input ended) until /exit or EOF."""
        while True:
            try:
                line = read()
            except KeyboardInterrupt:
                if not self.terminal:
                    return EXIT_INTERRUPTED
                self.out.write("\n")
                self._note("(use /exit or Ctrl-D to leave)")
                continue
            if line is None:
                if self.terminal:
                    self.out.write("\n")
                return 0
            text = line.strip()
            if not text:
                continue
            if not self.terminal:
                self.out.write(f"> {text}\n")
            if text.startswith("/"):
                if self._command(text):
                    return 0
                continue
            self.ask(text)

    def _command(self, text: str) -> bool:
        """Run a slash command; True when it ends the chat."""
        word = text.split()[0].lower()
        if word in ("/exit", "/quit", "/bye"):
            return True
        if word == "/reset":
            self.conversation.reset()
            self._note("(history cleared)", out=True)
        elif word == "/help":
            self._note(HELP, out=True)
        else:
            self._note(f"unknown command {word}: {HELP}", out=True)
        return False

    def ask(self, question: str) -> None:
        """Stream one answer; Ctrl-C stops it. A refusal drops the turn; a dead router
        raises ``RouterError``."""
        body = {"model": self.model, "messages": self.conversation.messages(question),
                **self.sampling.fields()}
        printer = Printer(self.out, self.terminal)
        answer: list[str] = []
        pieces = stream_chat(self.http, self.router.url, body)
        finish = ""
        try:
            for delta in pieces:
                printer.piece(delta)
                if delta.kind == "content":
                    answer.append(delta.text)
                elif delta.kind == "finish":
                    finish = delta.text
        except KeyboardInterrupt:
            pieces.close()  # closes the stream: the router stops this answer
            printer.end("(stopped)")
            self.conversation.answered(question, "".join(answer))
            return
        except RouterError as exc:
            printer.end()
            if exc.dead:
                raise
            self.error(exc)
            return
        printer.end("(cut off: the token limit, see --max-tokens)" if finish == "length"
                    else "")
        self.conversation.answered(question, "".join(answer))

    def error(self, exc: RouterError) -> None:
        self.err.write(f"mlxctl: {exc.message}\n" + (f"  hint: {exc.hint}\n" if exc.hint
                                                      else ""))
        self.err.flush()

    def _note(self, text: str, out: bool = False) -> None:
        stream = self.out if out else self.err
        stream.write(f"{DIM}{text}{RESET}\n" if self.terminal and stream.isatty()
                     and not os.environ.get("NO_COLOR") else text + "\n")
        stream.flush()


def reader(stdin: TextIO, terminal: bool) -> Callable[[], str | None]:
    """The next line typed (a prompt and line editing on a terminal), None at EOF."""
    if terminal:
        with contextlib.suppress(ImportError):  # a Python built without it: plain input
            import readline  # noqa: F401  (line editing and history for input())

        def typed() -> str | None:
            try:
                return input("> ")
            except EOFError:
                return None
        return typed

    def piped() -> str | None:
        line = stdin.readline()
        return line if line else None
    return piped


def start(socket: Path, url: str | None, key_file: Path | None, model: str | None,
          conversation: Conversation, sampling: Sampling) -> int:
    """``mlxctl chat``: find the router (``--url``, else the daemon's status), then chat
    on this process's terminal or piped input; the exit code."""
    try:
        if url is not None:
            key = key_from(key_file, "--api-key-file") if key_file is not None else None
            router = Router(url.rstrip("/"), model, key)
        else:
            status = call_blocking(socket, False, lambda c: c.status())
            found = from_status(status, key_file)
            router = Router(found.url, model or found.model, found.key)
    except RouterError as exc:
        echo(f"mlxctl: {exc.message}", err=True)
        echo(f"  hint: {exc.hint}", err=True)
        return EXIT_FAILURE
    terminal = sys.stdin.isatty() and sys.stdout.isatty()
    with client(router) as http:
        session = Chat(router, http, conversation, sampling, terminal=terminal)
        try:
            session.start()
            return session.run(reader(sys.stdin, terminal))
        except RouterError as exc:
            session.error(exc)
            return EXIT_FAILURE
        except KeyboardInterrupt:  # before the first prompt, or between two turns
            return EXIT_INTERRUPTED
