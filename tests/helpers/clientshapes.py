"""Request bodies shaped as the clients of issue 29 send them, for tests through the app
and through a real daemon.

Reproduced from what issue 29 reports each client sending (no recording of the clients'
own traffic was available offline): Continue's 6 stops (a chat template's whole stop
list), Open WebUI's ``reasoning`` object and ``cache_control`` on messages and content
parts, LiteLLM's ``reasoning_effort`` (which aider and LangChain send through it), an
assistant turn carrying vLLM's ``reasoning``, and vLLM's ``top_k: -1``. ``max_tokens``
is small; ``model`` is left to the caller.
"""

from __future__ import annotations

from typing import Any

USER: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
CONTINUE_STOPS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>",
                  "\n\nUser:"]
CLIENT_SHAPES: dict[str, dict[str, Any]] = {
    "continue": {"messages": USER, "stop": CONTINUE_STOPS, "max_tokens": 16, "stream": False},
    "open-webui": {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}],
        "reasoning": {"effort": "low"}, "max_tokens": 16},
    "litellm": {"messages": USER, "reasoning_effort": "low", "max_tokens": 16},
    "assistant-reasoning": {"messages": [
        *USER, {"role": "assistant", "content": "hello", "reasoning": "greet back"},
        {"role": "user", "content": "again"}], "max_tokens": 16},
    "vllm-top-k": {"messages": USER, "top_k": -1, "temperature": 0.7, "max_tokens": 16},
}
