"""Every field of a ``POST /v1/responses`` body and of its input items, and what the
router does with each (``surface.py``'s states: honoured, opaque, refused with a note
saying what to do). ``responses.py`` and ``responses/items.py`` read them; a field no
table knows is refused by name (``surface.check_fields``), or, with ``[serve]
unknown_fields = "warn"``, ignored and named (``ignoring.py``). ``fielddoc.py`` publishes
the tables.
"""

from __future__ import annotations

from typing import Final

from mlxceld.api.reasoning import ABOVE_HIGH
from mlxceld.api.reasoning import EFFORTS as CHAT_EFFORTS
from mlxceld.api.surface import Rule, honoured, refused

EFFORTS = (*CHAT_EFFORTS, *ABOVE_HIGH)

HONOURED = honoured()
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = frozenset({"reasoning.encrypted_content", LOGPROBS})
STATELESS = "this server is stateless and stores no responses; send the whole conversation "


RESPONSES_FIELDS: Final[dict[str, Rule]] = {
    "model": HONOURED,
    "input": honoured("a string, or message, function_call, function_call_output and "
                      "reasoning items"),
    "instructions": honoured("a system message before the input"),
    "max_output_tokens": HONOURED,
    "temperature": HONOURED,
    "top_p": HONOURED,
    "tools": honoured("function tools only; other types are refused by type"),
    "tool_choice": HONOURED,
    "parallel_tool_calls": HONOURED,
    "text": honoured("format: text, json_object or json_schema, as chat's response_format"),
    "reasoning": honoured("effort as chat's reasoning_effort (xhigh and max as high)"),
    "stream": HONOURED,
    "truncation": honoured('"disabled" only: a prompt too long is refused, never cut'),
    "include": honoured(f"{LOGPROBS}; reasoning.encrypted_content a no-op (reasoning "
                        "comes back in the clear)"),
    "metadata": Rule("opaque", shape=dict),
    "user": Rule("opaque", shape=str),
    "safety_identifier": Rule("opaque", shape=str),
    "prompt_cache_key": Rule("opaque", shape=str),
    "client_metadata": Rule("opaque", "the Codex CLI's", shape=dict),
    "store": refused(STATELESS + "as 'input' with store false (or leave 'store' out)",
                      lambda v: v is False, "false"),
    "previous_response_id": refused(STATELESS + "as 'input' instead of "
                                     "'previous_response_id'"),
    "conversation": refused(STATELESS + "as 'input' instead of 'conversation'"),
    "background": refused("background responses are not served; leave 'background' out "
                           "or false", lambda v: v is False, "false"),
    "prompt": refused("stored prompt templates are not served; send 'instructions' and "
                       "'input' instead"),
    "max_tool_calls": refused("the number of tool calls cannot be bounded, but "
                               "'parallel_tool_calls' false allows one; leave "
                               "'max_tool_calls' out"),
    "top_logprobs": honoured(f"with include {LOGPROBS}"),
    "stream_options": refused("streams are never obfuscated here; leave 'stream_options' "
                               "out or send {\"include_obfuscation\": false}",
                               lambda v: v == {"include_obfuscation": False} or v == {},
                               '{"include_obfuscation": false}, {}'),
    "service_tier": refused('one tier is served; send "auto" or leave \'service_tier\' out',
                             lambda v: v in ("auto", "default"), '"auto", "default"'),
    "context_management": refused("context compaction is not served; leave "
                                   "'context_management' out"),
    "prompt_cache_retention": refused("this server's prompt cache is the operator's "
                                       "([serve] prompt_cache_bytes); leave "
                                       "'prompt_cache_retention' out"),
    "prompt_cache_options": refused("this server's prompt cache is the operator's "
                                     "([serve] prompt_cache_bytes); leave "
                                     "'prompt_cache_options' out"),
}
REASONING_FIELDS: Final[dict[str, Rule]] = {
    "effort": honoured(f"{', '.join(EFFORTS)}: as chat's reasoning_effort (none and "
                       "minimal also enable_thinking false; xhigh and max as high)"),
    "summary": honoured("accepted: the whole reasoning comes back, no summary is made"),
    "generate_summary": honoured("summary's older name")}
TEXT_FIELDS: Final[dict[str, Rule]] = {
    "format": HONOURED,
    "verbosity": refused("the model's verbosity cannot be set; leave 'text.verbosity' out "
                          "or \"medium\"", lambda v: v == "medium", '"medium"')}
FORMAT_FIELDS: Final[dict[str, Rule]] = {
    "type": HONOURED, "name": HONOURED, "description": HONOURED, "schema": HONOURED,
    "strict": HONOURED}
FUNCTION_TOOL_FIELDS: Final[dict[str, Rule]] = {
    "type": HONOURED, "name": HONOURED, "description": HONOURED, "parameters": HONOURED,
    "strict": HONOURED}
MESSAGE_ITEM_FIELDS: Final[dict[str, Rule]] = {
    "type": HONOURED, "role": HONOURED, "content": HONOURED,
    "id": Rule("opaque", shape=str), "status": Rule("opaque", shape=str),
    "phase": Rule("opaque", shape=str)}
CALL_ITEM_FIELDS: Final[dict[str, Rule]] = {
    "type": HONOURED, "call_id": HONOURED, "name": HONOURED, "arguments": HONOURED,
    "id": Rule("opaque", shape=str), "status": Rule("opaque", shape=str)}
OUTPUT_ITEM_FIELDS: Final[dict[str, Rule]] = {
    "type": HONOURED, "call_id": HONOURED, "output": HONOURED,
    "id": Rule("opaque", shape=str), "status": Rule("opaque", shape=str)}
REASONING_ITEM_FIELDS: Final[dict[str, Rule]] = {
    "type": HONOURED, "summary": HONOURED, "content": HONOURED,
    "id": Rule("opaque", shape=str), "status": Rule("opaque", shape=str),
    "encrypted_content": refused("this server makes no encrypted reasoning and cannot read "
                                  "another's; leave 'encrypted_content' out")}
PART_FIELDS: Final[dict[str, Rule]] = {
    "type": HONOURED, "text": HONOURED, "annotations": HONOURED, "logprobs": HONOURED}
MESSAGE_ITEM_ROLES = {"user": "user", "assistant": "assistant", "system": "system",
         "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
