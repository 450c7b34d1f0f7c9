"""A Claude Code request as it arrives at ``/v1/messages``, and Anthropic's event stream
read back."""

from __future__ import annotations

import copy
import json
from typing import Any

# The shape of a Claude Code request: its billing line and system prompt as text blocks
# with cache_control, custom tools (input_schema with $schema and additionalProperties as
# it writes them), metadata.user_id, thinking with context_management, stream true, the
# beta query (?beta=true, added by the caller) and headers. Source: Claude Code 2.x
# requests as recorded in llama.cpp pull request #20623 (the system blocks) and
# vibeproxy issue #509 (the context_management edit); the rest follows the anthropic
# SDK's MessageCreateParams (2.17).
CLAUDE_CODE: Any = {
    "model": "", "max_tokens": 32000, "stream": True, "temperature": 1,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9; "
                                 "cc_entrypoint=cli; cch=fa690;"},
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
         "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>context</system-reminder>"},
        {"type": "text", "text": "list the files", "cache_control": {"type": "ephemeral"}}]}],
    "tools": [{"name": "Bash", "description": "Runs a command",
               "input_schema": {"type": "object", "additionalProperties": False,
                                "$schema": "http://json-schema.org/draft-07/schema#",
                                "properties": {"command": {"type": "string"}},
                                "required": ["command"]}}],
    "metadata": {"user_id": "user_abc_account__session_123"},
    "thinking": {"type": "enabled", "budget_tokens": 31999},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
}
HEADERS = {"anthropic-version": "2023-06-01", "x-app": "cli",
           "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                             "context-management-2025-06-27",
           "user-agent": "claude-cli/2.1.37 (external, cli)"}


def claude_code_request(model: str, key: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The body (for ``model``) and the headers (with ``key``) of a Claude Code request."""
    body = copy.deepcopy(CLAUDE_CODE)
    body["model"] = model
    return body, {**HEADERS, "x-api-key": key}


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """Each event's name and data, checking every event has both, and no ``[DONE]``."""
    assert text.endswith("\n\n") and "[DONE]" not in text, text[-80:]
    events = []
    for block in text.split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events
