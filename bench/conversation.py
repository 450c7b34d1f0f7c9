"""A chat that grows turn by turn: time to first token through our 2-stage pipeline, our
single host and mlx_lm.server, and a cached history against mlx-lm in one process.

What people do with a model split over their machines is chat with it, through a UI that
re-sends the whole conversation every turn; a server that keeps the KV of the history
prefills only the new turn, one that does not prefills everything again. Measured on the
``small`` fixture with the qwen2 family (8 layers, hidden 512, bfloat16, its chatml
template; written once per machine by our generator, as bench/pipeline.py does), one run:

1. The conversation (issue 28's first goal). ``--turns`` user turns of ``--turn-tokens``
   tokens each (by the fixture's tokenizer: seeded words from ``WORDS``; the counts are
   printed), each followed by the answer the target streamed (``--max-tokens`` at most,
   temperature 0) appended to the history, as a chat UI does: every turn sends the whole
   conversation again, through the ``openai`` client's ``chat.completions`` with
   ``stream=True`` and ``stream_options.include_usage``. Three targets, real processes on
   loopback, the same fixture, turn by turn in turn (so that a noisy moment falls on all):

   - ours 2-stage: a coordinator daemon on 127.0.0.1 (the router) and two stage daemons on
     127.0.0.2 and .3 from a cluster TOML, layers [0, 4) and [4, 8) (bench/loopback.py);
   - ours single host: one daemon serving the whole model (``mlxceld --model DIR``);
   - mlx_lm.server (``python -m mlx_lm.server --model DIR``, its defaults: a prompt cache
     of 10 entries).

   Each chat is new: its first turn opens with a line of its own per target ("Chat A.",
   "Chat B.", ...), so that no target holds any of another's conversation, nor of the
   warm-up (one raw /v1/completions request per target before the chat). TTFT is the time
   from sending the request to the first streamed chunk with content: our router opens a
   chat stream with an empty role chunk, mlx_lm.server does not, so the empty chunks are
   skipped for all; a token that is not yet whole text is held back by both servers alike
   (bench/chats.py times a turn, through a server or in process).
   Prompt tokens and reused ("cached") tokens are the servers' own usage (mlx_lm.server
   reports ``prompt_tokens_details.cached_tokens``; "-" where a server says nothing).
   Printed: TTFT and prompt tokens per turn per target; ours 2-stage / mlx_lm.server TTFT
   at the last turn (goal <= 1.0), and each target's growth, last turn's TTFT over the
   first's (goal: ours 2-stage's no more than mlx_lm.server's).

2. A cached history (issue 28's second goal), after the single host and mlx_lm.server are
   stopped: a ``--history-tokens`` user message sent cold, then the history, its answer
   and a ``--turn-tokens`` user turn; timed through the 2-stage pipeline and through
   mlx-lm in this process (``stream_generate`` with a prompt cache kept from the first
   request to the second and trimmed to the prefix the second shares with it, as
   mlx_lm.server's cache does; the chat template applied and the TTFT taken to the first
   non-empty text, as the servers do). Printed: 2-stage / mlx-lm TTFT for each (goals
   <= 0.6 both).

A turn a server refuses or breaks off (a 503, an error event) is a finding, not the end of
the run: that target's chat stops there, the table says "failed" and why, the others go on,
and a goal it leaves unmeasured is not met. Everything started (the daemons and their
workers, mlx_lm.server) is ended by pid at the end, on an error and on Ctrl-C. On a
machine with few CPUs the stages, the routers, the client and mlx-lm share them: read the
ratios as what this machine gives.

``--quick``: the ``tiny`` qwen2 fixture (2 layers, hidden 64, float32; split [0, 1) +
[1, 2)), 3 turns of 64 tokens, answers of 8 tokens, a 256-token history: a smoke run of
every target and both sections (what tests/bench/test_conversation_bench.py runs).

    nice .venv/bin/python bench/conversation.py [--quick] [--turns 8] [--turn-tokens 300]
        [--max-tokens 32] [--history-tokens 2000] [--sections conversation,history]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chats import Endpoint, InProcess, Messages, Turn, TurnFailed
from loopback import Cluster, in_scratch, start_cluster, start_single, stop_all
from mlxlm import Server, end_tree, start_server, wait_ready

WORDS = ("river", "mill", "harbour", "lantern", "orchard", "winter", "market", "bridge",
         "letter", "garden", "captain", "island", "morning", "silver", "forest", "village",
         "candle", "window", "thunder", "meadow", "kettle", "journey", "shadow", "valley",
         "station", "pocket", "ribbon", "compass", "bakery", "meeting", "engine", "ladder",
         "the", "a", "of", "and", "to", "in", "with", "over", "under", "near", "after",
         "before", "old", "quiet", "bright", "small", "green", "late", "early", "cold",
         "walked", "carried", "opened", "found", "kept", "watched", "asked", "told", "left",
         "brought", "heard", "wrote", "sang", "mended", "counted", "sold", "waited")
SECTIONS = ("conversation", "history")
TARGETS = ("ours 2-stage", "ours single host", "mlx_lm.server")
GOALS = {"last_turn": 1.0, "history": 0.6}
HISTORY_ROWS = ("cold", "the turn after it")


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    preset: str = "small"
    turns: int = 8
    turn_tokens: int = 300
    max_tokens: int = 32
    history_tokens: int = 2000
    sections: tuple[str, ...] = SECTIONS
    fixtures: Path | None = None  # the fixture cache's root; None: the per-machine one

    @classmethod
    def quick_run(cls, **changes: Any) -> Settings:
        """``--quick``'s: the tiny fixture and small sizes, ``changes`` over them."""
        return cls(**{"quick": True, "preset": "tiny", "turns": 3, "turn_tokens": 64,
                      "max_tokens": 8, "history_tokens": 256, **changes})


# -- the text ------------------------------------------------------------------------------


def user_text(tokenizer: Any, seed: int, tokens: int) -> str:
    """Seeded sentences of ``WORDS``, as many words as make at most ``tokens`` tokens by
    ``tokenizer`` (the closest below, a word boundary)."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < tokens:  # a word is at least one token: enough words
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        words += sentence
    lo, hi = 1, len(words)
    while lo < hi:  # the most words within ``tokens``
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode(" ".join(words[:mid]))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def opening(index: int) -> str:
    """The first line of chat ``index``: each target's chat its own from the first tokens."""
    return f"Chat {chr(ord('A') + index)}."


# -- the two sections ----------------------------------------------------------------------


def say(what: str) -> None:
    print(what, flush=True)


Target = Endpoint | InProcess


def converse(targets: list[Target], texts: list[str], max_tokens: int, first: int,
             labels: list[str]) -> tuple[dict[str, list[Turn]], dict[str, str]]:
    """Each target's own chat of ``texts``, turn by turn in turn, each answer appended; the
    first turn opens with ``opening(first + k)`` for the k-th target. A target whose turn
    fails chats no more: what it did, and why it stopped ("turn N: ...")."""
    chats: dict[str, Messages] = {t.name: [] for t in targets}
    turns: dict[str, list[Turn]] = {t.name: [] for t in targets}
    failed: dict[str, str] = {}
    for i, (text, label) in enumerate(zip(texts, labels, strict=True)):
        for k, target in enumerate(targets):
            if target.name in failed:
                continue
            chat = chats[target.name]
            chat.append({"role": "user",
                         "content": f"{opening(first + k)}\n{text}" if i == 0 else text})
            try:
                turn = target.turn(chat, max_tokens)
            except TurnFailed as exc:
                failed[target.name] = f"{label}: {exc}"
                say(f"  {target.name} failed at {failed[target.name]}")
                continue
            chat.append({"role": "assistant", "content": turn.answer})
            turns[target.name].append(turn)
        say(f"  {label}: " + ", ".join(
            f"{name} {t[i].ttft:.2f} s ({t[i].prompt_tokens} tokens)"
            for name, t in turns.items() if len(t) > i))
    return turns, failed


# -- a run ---------------------------------------------------------------------------------


@dataclass
class Result:
    fixture: str = ""
    user_tokens: list[int] = field(default_factory=list)  # each chat turn's text alone
    chat: dict[str, list[Turn]] = field(default_factory=dict)  # target -> its turns
    chat_failed: dict[str, str] = field(default_factory=dict)  # target -> why it stopped
    history_tokens: int = 0  # the history's text alone
    turn_tokens: int = 0  # the turn after it, alone
    history: dict[str, list[Turn]] = field(default_factory=dict)  # target -> cold, cached
    history_failed: dict[str, str] = field(default_factory=dict)


def describe(model: Path) -> str:
    from mlxceld.models import read_model_config

    c = read_model_config(model)
    return (f"{model.name}: {c['model_type']}, {c['num_hidden_layers']} layers, hidden "
            f"{c['hidden_size']}, {c['torch_dtype']}, vocab {c['vocab_size']}")


@dataclass
class Started:
    """What a run started: ``stop`` closes the clients and ends every process by pid."""

    clusters: list[Cluster] = field(default_factory=list)  # ours, daemons and workers
    servers: list[Server] = field(default_factory=list)
    endpoints: list[Endpoint] = field(default_factory=list)
    mlx: InProcess | None = None

    def stop_target(self, endpoint: Endpoint, process: Cluster | Server) -> None:
        endpoint.close()
        self.endpoints.remove(endpoint)
        if isinstance(process, Cluster):
            process.stop()
            self.clusters.remove(process)
        else:
            end_tree(process.proc)
            self.servers.remove(process)

    def stop(self) -> None:
        for e in self.endpoints:
            e.close()
        if self.mlx is not None:
            self.mlx.close()
        stop_all(self.clusters)
        for s in self.servers:
            end_tree(s.proc)


def run(settings: Settings, root: Path) -> Result:
    """Both sections (those of ``settings.sections``); every process started is ended by
    pid before this returns or raises (an interrupt too)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxceld.models import fixture_cache, preset, read_model_config

    root.mkdir(parents=True, exist_ok=True)
    model = fixture_cache(preset(settings.preset, family="qwen2"), settings.fixtures)
    layers = int(read_model_config(model)["num_hidden_layers"])
    tokenizer = load_tokenizer(model)
    res = Result(describe(model))
    say(f"fixture {res.fixture}")
    started = Started()
    try:
        server = None
        if "conversation" in settings.sections:  # loads while our daemons start
            started.servers.append(server := start_server(model, root / "mlx_lm.server.log"))
        say("starting our 2-stage pipeline (3 daemons on 127.0.0.1-3)")
        two = start_cluster(root / "two", model, [(0, layers // 2), (layers // 2, layers)],
                            ["127.0.0.2", "127.0.0.3"], started.clusters)
        started.endpoints.append(pipeline := Endpoint(TARGETS[0], two.url, two.model_id))
        if server is not None:
            chat_section(res, settings, tokenizer, model, root, started, server)
        if "history" in settings.sections:
            history_section(res, settings, tokenizer, model, started, pipeline)
    finally:
        started.stop()
    return res


def chat_section(res: Result, settings: Settings, tokenizer: Any, model: Path, root: Path,
                 started: Started, server: Server) -> None:
    """The conversation through the pipeline (started), our single host (started here) and
    ``server``; the single host and the server are stopped after it."""
    say("starting our single host")
    single = start_single(root / "single", model, started.clusters)
    started.endpoints.append(ours := Endpoint(TARGETS[1], single.url, single.model_id))
    wait_ready(server.url, server.proc, "mlx_lm.server")
    started.endpoints.append(base := Endpoint(TARGETS[2], server.url, server.model_id))
    texts = [user_text(tokenizer, turn, settings.turn_tokens) for turn in range(settings.turns)]
    res.user_tokens = [len(tokenizer.encode(t)) for t in texts]
    say(f"conversation: {settings.turns} turns, user turns of "
        f"{', '.join(map(str, res.user_tokens))} tokens")
    for e in started.endpoints:
        e.warm_up()
    res.chat, res.chat_failed = converse(list(started.endpoints), texts, settings.max_tokens,
                                         0, [f"turn {i + 1}" for i in range(len(texts))])
    started.stop_target(ours, single)  # the CPUs to the next section's two
    started.stop_target(base, server)


def history_section(res: Result, settings: Settings, tokenizer: Any, model: Path,
                    started: Started, pipeline: Endpoint) -> None:
    """The cached history through ``pipeline`` and mlx-lm in this process."""
    history = user_text(tokenizer, 1000, settings.history_tokens)
    turn = user_text(tokenizer, 1001, settings.turn_tokens)
    res.history_tokens, res.turn_tokens = (len(tokenizer.encode(t)) for t in (history, turn))
    say(f"cached history: {res.history_tokens} tokens, then a turn of {res.turn_tokens}; "
        "loading mlx-lm in this process")
    started.mlx = InProcess(model)
    started.mlx.warm_up()
    res.history, res.history_failed = converse(
        [pipeline, started.mlx], [history, turn], settings.max_tokens, len(TARGETS),
        list(HISTORY_ROWS))


# -- the report ----------------------------------------------------------------------------


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def cell(value: int | None, width: int) -> str:
    return f"{'-' if value is None else value:>{width}}"


def ttft(turn: Turn, width: int) -> str:
    return f"{turn.ttft:{width}.2f}" + ("*" if turn.no_content else " ")


def growth(turns: list[Turn]) -> float:
    return turns[-1].ttft / turns[0].ttft


def added(turns: list[Turn]) -> float:
    """The seconds the last turn's TTFT added to the first's: the growth itself, which a
    faster first turn does not inflate as it does the ratio."""
    return turns[-1].ttft - turns[0].ttft


def chat_table(res: Result, settings: Settings) -> list[str]:
    names, n = list(res.chat), len(res.user_tokens)
    lines = ["", f"conversation: {n} turns, each chat new; user turns of "
             f"{', '.join(map(str, res.user_tokens))} tokens; answers of at most "
             f"{settings.max_tokens} tokens, temperature 0, appended as streamed",
             "TTFT: seconds from the request to the first chunk with content; prompt and "
             "cached: the server's usage (cached: prompt tokens it reused; -: not reported)",
             "     " + "".join(f"{name:>26}" for name in names),
             "turn " + "".join(f"{'prompt':>10}{'cached':>8}{'TTFT s':>8}" for _ in names)]
    for i in range(n):
        row = f"{i + 1:>4} "
        for name in names:
            turns = res.chat[name]
            if i < len(turns):
                t = turns[i]
                row += f"{cell(t.prompt_tokens, 10)}{cell(t.cached_tokens, 8)}{ttft(t, 7)}"
            else:
                row += f"{'failed' if i == len(turns) else '':>26}"
        lines.append(row)
    lines.append("growth (last turn's TTFT / the first's)" + "".join(
        f"  {name} {growth(t):.2f}" for name, t in res.chat.items() if len(t) == n))
    lines.append("seconds added (last turn's TTFT - the first's)" + "".join(
        f"  {name} {added(t):.2f}" for name, t in res.chat.items() if len(t) == n))
    if any(t.no_content for turns in res.chat.values() for t in turns):
        lines.append("*: no content came (an EOS first): the time to the end of the stream")
    lines += [f"{name} failed at {why}" for name, why in res.chat_failed.items()]
    return lines


def history_table(res: Result) -> list[str]:
    ours, base = (res.history[name] for name in res.history)
    lines = ["", f"cached history: a {res.history_tokens}-token user message cold, then it, "
             f"its answer and a {res.turn_tokens}-token turn; TTFT s",
             f"{'':26}{'prompt':>8}{'cached':>8}{'2-stage':>9}{'mlx-lm':>8}{'ratio':>7}"]
    for i, label in enumerate(HISTORY_ROWS):
        row = f"  {label:24}"
        if i < len(ours):
            o = ours[i]
            row += f"{cell(o.prompt_tokens, 8)}{cell(o.cached_tokens, 8)}{ttft(o, 8)}"
        else:
            row += f"{'':16}{'failed' if i == len(ours) else '':>8} "
        row += ttft(base[i], 7) if i < len(base) else f"{'failed' if i == len(base) else '':>7} "
        if i < len(ours) and i < len(base):
            row += f"{ours[i].ttft / base[i].ttft:7.2f}"
        lines.append(row)
    if len(base) == len(HISTORY_ROWS):
        lines.append(f"(prompt, cached: the pipeline's usage; mlx-lm in this process reused "
                     f"{base[1].cached_tokens} of {base[1].prompt_tokens} tokens for the turn)")
    lines += [f"{name} failed at {why}" for name, why in res.history_failed.items()]
    return lines


def ratio_goal(what: str, ours: list[Turn], base: list[Turn], i: int, goal: float) -> str:
    """``what``: ours[i] / base[i] against ``goal``, or why it was not measured."""
    if len(ours) <= i or len(base) <= i:
        return f"  {what}: not measured (a target failed): NOT met"
    r = ours[i].ttft / base[i].ttft
    return f"  {what}: {r:.2f} <= {goal}: {met(r <= goal)}"


def goals(res: Result) -> list[str]:
    lines = ["", "goals (issue 28)"]
    if res.chat:
        n = len(res.user_tokens)
        ours, single, base = (res.chat[name] for name in TARGETS)
        lines.append(ratio_goal(f"ours 2-stage / mlx_lm.server TTFT at turn {n}", ours, base,
                                n - 1, GOALS["last_turn"]))
        if len(ours) == len(base) == n:
            g, gb = growth(ours), growth(base)
            lines.append(f"  ours 2-stage growth {g:.2f} <= mlx_lm.server's {gb:.2f}: "
                         f"{met(g <= gb)} (seconds added: {added(ours):.2f} against "
                         f"{added(base):.2f})")
        else:
            lines.append("  ours 2-stage growth: not measured (a target failed): NOT met")
        if len(single) == len(base) == n:
            lines.append(f"  (ours single host / mlx_lm.server TTFT at turn {n}: "
                         f"{single[-1].ttft / base[-1].ttft:.2f}; growth {growth(single):.2f})")
    if res.history:
        ours_h, base_h = (res.history[name] for name in res.history)
        for i, label in enumerate(("cold", "turn after a cached history")):
            lines.append(ratio_goal(f"2-stage / mlx-lm TTFT, {label}", ours_h, base_h, i,
                                    GOALS["history"]))
    return lines


def report(res: Result, settings: Settings) -> str:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [f"fixture {res.fixture}; {os.cpu_count()} CPUs, load average now {load}"]
    if res.chat:
        lines += chat_table(res, settings)
    if res.history:
        lines += history_table(res)
    return "\n".join(lines + goals(res))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the tiny fixture, 3 turns of 64 tokens, answers of 8, a "
                             "256-token history (sizes given as flags still win)")
    parser.add_argument("--turns", type=int)
    parser.add_argument("--turn-tokens", type=int, help="each user turn's tokens (300)")
    parser.add_argument("--max-tokens", type=int, help="each answer's most tokens (32)")
    parser.add_argument("--history-tokens", type=int,
                        help="the cached history's tokens (2000)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of: {', '.join(SECTIONS)}")
    args = parser.parse_args()
    sections = tuple(args.sections.split(","))
    if not sections or not set(sections) <= set(SECTIONS):
        parser.error(f"--sections: of {', '.join(SECTIONS)}")
    sizes = {k: v for k, v in (("turns", args.turns), ("turn_tokens", args.turn_tokens),
                               ("max_tokens", args.max_tokens),
                               ("history_tokens", args.history_tokens)) if v is not None}
    if any(v < 1 for v in sizes.values()):
        parser.error("--turns, --turn-tokens, --max-tokens, --history-tokens: at least 1")
    make: Callable[..., Settings] = Settings.quick_run if args.quick else Settings
    settings = make(sections=sections, **sizes)
    say(f"{os.cpu_count()} CPUs, load average at the start "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    started = time.monotonic()

    def work(root: Path) -> None:
        res = run(settings, root)
        print(report(res, settings))
        print(f"({time.monotonic() - started:.0f} s)")

    in_scratch("mxconv", work)


if __name__ == "__main__":
    main()
