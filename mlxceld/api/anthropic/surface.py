"""Every field of a ``POST /v1/messages`` body (and a ``count_tokens`` one), of its
turns, content blocks, tools and options, and what the router does with each
(``surface.py``'s states). ``messages.py`` and ``anthropic/blocks.py`` read them through
``surface.check_fields``: a refused field is a 400 naming it, and a field no table knows
is refused by name too, or, with ``[serve] unknown_fields = "warn"``, ignored and named
(``ignoring.py``), as on every endpoint. ``fielddoc.py`` publishes the tables.
"""

from __future__ import annotations

from typing import Final

from mlxceld.api.surface import CACHE_CONTROL, Rule, honoured, refused

HONOURED = honoured()
LABEL = Rule("opaque", shape=str)

_SHARED: Final[dict[str, Rule]] = {
    "model": honoured("the served model's id or an alias; required"),
    "messages": HONOURED,
    "system": honoured("a string or text blocks: the first system message (Claude Code's "
                       "billing line left out)"),
    "tools": honoured("custom tools; Anthropic's server tools are refused by type"),
    "tool_choice": HONOURED,
    "thinking": honoured("enabled or adaptive: the template's enable_thinking true; "
                         "disabled or absent: false (Anthropic's rule; chat leaves the "
                         "template's default); budget_tokens as the effort"),
    "cache_control": CACHE_CONTROL,
    "context_management": honoured("clear_thinking_20251015 edits only"),
    "output_config": honoured("effort only"),
    "speed": refused('one speed is served; send "standard" or leave \'speed\' out',
                     lambda v: v == "standard", '"standard"'),
    "mcp_servers": refused("MCP servers are not called by this server; leave "
                           "'mcp_servers' out", lambda v: v == [], "[]"),
}

MESSAGES_FIELDS: Final[dict[str, Rule]] = {
    **_SHARED,
    "max_tokens": honoured("required; a bound: what is left of the context when less"),
    "stop_sequences": honoured("up to 16 strings"),
    "temperature": honoured("0 to 1"),
    "top_p": HONOURED,
    "top_k": honoured("0: off"),
    "stream": HONOURED,
    "metadata": honoured("user_id only, a label"),
    "service_tier": refused('one tier is served; send "auto" or "standard_only"',
                            lambda v: v in ("auto", "standard_only"),
                            '"auto", "standard_only"'),
    "user_profile_id": LABEL,
    "workspace_id": LABEL,
    "container": refused("code execution containers are not served; leave 'container' out"),
    "diagnostics": refused("prompt-cache diagnostics are not served; leave 'diagnostics' "
                           "out"),
    "inference_geo": refused("inference runs where this server runs; leave 'inference_geo' "
                             "out"),
    "compaction": refused("server-side compaction is not served; leave 'compaction' out"),
    "fallbacks": refused("this server serves one model; leave 'fallbacks' out"),
    "thread": refused("threads are not stored by this server; leave 'thread' out"),
}
COUNT_FIELDS: Final[dict[str, Rule]] = dict(_SHARED)

TURN_FIELDS: Final[dict[str, Rule]] = {"role": HONOURED, "content": HONOURED}
METADATA_FIELDS: Final[dict[str, Rule]] = {"user_id": LABEL}
TOOL_CHOICE_FIELDS: Final[dict[str, Rule]] = {
    "type": honoured("auto, any (at least one call), tool (that one), none"),
    "name": HONOURED,
    "disable_parallel_tool_use": honoured("true: the answer ends after its first call")}
OUTPUT_CONFIG_FIELDS: Final[dict[str, Rule]] = {
    "effort": honoured("low, medium, high (xhigh and max as high): reasoning_effort"),
    "format": refused("structured output is not served here; for a JSON schema, use "
                      "/v1/chat/completions' response_format")}
CONTEXT_MANAGEMENT_FIELDS: Final[dict[str, Rule]] = {"edits": HONOURED}
_ONLY_ENABLED = refused("'budget_tokens' is read only with thinking type \"enabled\"")
THINKING_FIELDS: Final[dict[str, dict[str, Rule]]] = {
    "enabled": {"type": HONOURED, "budget_tokens": honoured("required"),
                "display": honoured("summarized, or omitted: thinking blocks sent empty")},
    "adaptive": {"type": HONOURED, "budget_tokens": _ONLY_ENABLED,
                 "display": honoured("summarized, or omitted: thinking blocks sent empty")},
    "disabled": {"type": HONOURED, "budget_tokens": _ONLY_ENABLED},
}
TOOL_FIELDS: Final[dict[str, Rule]] = {
    "type": honoured("custom (or left out)"), "name": HONOURED, "description": HONOURED,
    "input_schema": honoured("required"), "cache_control": CACHE_CONTROL,
    "strict": honoured("checked; a forced call's grammar follows the schema either way"),
    "eager_input_streaming": honoured("checked; a call's input is sent whole, at once")}
BLOCK_FIELDS: Final[dict[str, dict[str, Rule]]] = {
    "text": {"type": HONOURED, "text": HONOURED, "cache_control": CACHE_CONTROL,
             "citations": refused("citations are not served; leave 'citations' out",
                                  lambda v: v == [], "[]")},
    "tool_use": {"type": HONOURED, "id": HONOURED, "name": HONOURED, "input": HONOURED,
                 "cache_control": CACHE_CONTROL,
                 "caller": honoured('{"type": "direct"} only: tools are called by the '
                                    "client here")},
    "tool_result": {"type": HONOURED, "tool_use_id": HONOURED, "content": HONOURED,
                    "is_error": honoured('true: "Error: " before the content'),
                    "cache_control": CACHE_CONTROL},
    "thinking": {"type": HONOURED, "thinking": honoured("the turn's reasoning, to the "
                                                        "template"),
                 "signature": Rule("opaque", shape=str)},
    "redacted_thinking": {"type": HONOURED,
                          "data": Rule("opaque", note="dropped: Anthropic's encryption",
                                       shape=str)},
}
