"""The conversation benchmark kept from rotting: its ``--quick`` run (the tiny qwen2 fixture,
3 turns of 64 tokens, 8-token answers, a 256-token history) chats with all three targets
(our 2-stage pipeline, our single host, mlx_lm.server) and times the cached history through
the pipeline and mlx-lm in this process, prints the table and the goals' ratios, and leaves
no process behind. It asserts the outcome, not the speed (bench/conversation.py prints
that)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psutil
import pytest

from helpers.benches import bench_module


@pytest.fixture(scope="module")
def conversation() -> Iterator[ModuleType]:
    with bench_module("conversation") as module:
        yield module


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_quick_run_chats_with_all_three_and_prints_the_goals(
        conversation: ModuleType, state_dir: Path) -> None:
    settings = conversation.Settings.quick_run(fixtures=state_dir / "fixtures")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    res = conversation.run(settings, state_dir / "run")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before

    assert list(res.chat) == list(conversation.TARGETS)
    assert res.chat_failed == {} and res.history_failed == {}
    assert len(res.user_tokens) == 3 and all(50 <= n <= 64 for n in res.user_tokens)
    for turns in res.chat.values():
        assert len(turns) == 3 and all(t.ttft > 0 for t in turns)
        prompts = [t.prompt_tokens for t in turns]
        assert prompts == sorted(prompts) and prompts[0] > res.user_tokens[0]  # it grows
    # mlx_lm.server says what it reused: the earlier turns, never the new one.
    server = res.chat["mlx_lm.server"]
    assert server[0].cached_tokens == 0
    assert all(0 < t.cached_tokens < t.prompt_tokens for t in server[1:])
    (cold, after), (mlx_cold, mlx_after) = res.history.values()
    assert cold.prompt_tokens == mlx_cold.prompt_tokens > res.history_tokens
    assert after.prompt_tokens > cold.prompt_tokens
    assert mlx_cold.cached_tokens == 0 and mlx_after.cached_tokens >= mlx_cold.prompt_tokens

    text = conversation.report(res, settings)
    assert "turn     prompt  cached  TTFT s" in text
    assert "growth (last turn's TTFT / the first's)  ours 2-stage " in text
    assert "ours 2-stage / mlx_lm.server TTFT at turn 3: " in text
    assert "ours 2-stage growth " in text
    assert "2-stage / mlx-lm TTFT, cold: " in text
    assert "2-stage / mlx-lm TTFT, turn after a cached history: " in text


def test_a_failed_turn_is_reported_and_its_goals_not_met(conversation: ModuleType) -> None:
    def turns(*ttfts: float) -> list[object]:
        return [conversation.Turn(t, "answer", 100 * (i + 1), None, 8)
                for i, t in enumerate(ttfts)]

    res = conversation.Result(
        "fixture", [60, 60, 60],
        {"ours 2-stage": turns(1.0, 2.0), "ours single host": turns(1.0, 1.5, 2.0),
         "mlx_lm.server": turns(1.0, 1.2, 1.4)},
        {"ours 2-stage": "turn 3: Error code: 503 - a stage is stalled (after 36.0 s)"},
        250, 60, {"ours 2-stage": [], "mlx-lm": turns(3.0, 0.5)},
        {"ours 2-stage": "cold: Error code: 503 - a stage is stalled (after 36.0 s)"})
    text = conversation.report(res, conversation.Settings.quick_run())
    assert "ours 2-stage failed at turn 3: Error code: 503" in text
    assert "ours 2-stage failed at cold: Error code: 503" in text
    assert "ours 2-stage / mlx_lm.server TTFT at turn 3: not measured (a target failed): " \
           "NOT met" in text
    assert "ours 2-stage growth: not measured (a target failed): NOT met" in text
    assert "(ours single host / mlx_lm.server TTFT at turn 3: 1.43; growth 2.00)" in text
    assert "2-stage / mlx-lm TTFT, cold: not measured (a target failed): NOT met" in text
