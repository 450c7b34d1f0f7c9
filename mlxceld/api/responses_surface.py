"""Every field of a ``POST /v1/responses`` body and of its input items, and what the
router does with each (``surface.py``'s states: honoured, opaque, refused with a note
saying what to do). ``responses.py`` reads them; a field no table knows is refused by
name (``surface.check_fields``).
"""

from __future__ import annotations

from typing import Any, Final

from mlxceld.api.reasoning import ABOVE_HIGH
from mlxceld.api.reasoning import EFFORTS as CHAT_EFFORTS
from mlxceld.api.surface import Rule

EFFORTS = (*CHAT_EFFORTS, *ABOVE_HIGH)

HONOURED = Rule("honoured")
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = frozenset({"reasoning.encrypted_content", LOGPROBS})
STATELESS = "this server is stateless and stores no responses; send the whole conversation "


def _refused(note: str, allowed: Any = None) -> Rule:
    return Rule("refused", note, allowed)


RESPONSES_FIELDS: Final[dict[str, Rule]] = {
    "model": HONOURED,
    "input": HONOURED,
    "instructions": HONOURED,
    "max_output_tokens": HONOURED,
    "temperature": HONOURED,
    "top_p": HONOURED,
    "tools": HONOURED,
    "tool_choice": HONOURED,
    "parallel_tool_calls": HONOURED,
    "text": HONOURED,
    "reasoning": HONOURED,
    "stream": HONOURED,
    "truncation": HONOURED,  # "disabled" only
    "include": HONOURED,  # logprobs; reasoning.encrypted_content: a no-op
    "metadata": Rule("opaque", shape=dict),
    "user": Rule("opaque", shape=str),
    "safety_identifier": Rule("opaque", shape=str),
    "prompt_cache_key": Rule("opaque", shape=str),
    "client_metadata": Rule("opaque", shape=dict),  # the Codex CLI's
    "store": _refused(STATELESS + "as 'input' with store false (or leave 'store' out)",
                      lambda v: v is False),
    "previous_response_id": _refused(STATELESS + "as 'input' instead of "
                                     "'previous_response_id'"),
    "conversation": _refused(STATELESS + "as 'input' instead of 'conversation'"),
    "background": _refused("background responses are not served; leave 'background' out "
                           "or false", lambda v: v is False),
    "prompt": _refused("stored prompt templates are not served; send 'instructions' and "
                       "'input' instead"),
    "max_tool_calls": _refused("the number of tool calls cannot be bounded, but "
                               "'parallel_tool_calls' false allows one; leave "
                               "'max_tool_calls' out"),
    "top_logprobs": HONOURED,  # with include message.output_text.logprobs
    "stream_options": _refused("streams are never obfuscated here; leave 'stream_options' "
                               "out or send {\"include_obfuscation\": false}",
                               lambda v: v == {"include_obfuscation": False} or v == {}),
    "service_tier": _refused('one tier is served; send "auto" or leave \'service_tier\' out',
                             lambda v: v in ("auto", "default")),
    "context_management": _refused("context compaction is not served; leave "
                                   "'context_management' out"),
    "prompt_cache_retention": _refused("this server's prompt cache is the operator's "
                                       "([serve] prompt_cache_bytes); leave "
                                       "'prompt_cache_retention' out"),
    "prompt_cache_options": _refused("this server's prompt cache is the operator's "
                                     "([serve] prompt_cache_bytes); leave "
                                     "'prompt_cache_options' out"),
}
REASONING_FIELDS: Final[dict[str, Rule]] = {
    "effort": HONOURED, "summary": HONOURED, "generate_summary": HONOURED}
TEXT_FIELDS: Final[dict[str, Rule]] = {
    "format": HONOURED,
    "verbosity": _refused("the model's verbosity cannot be set; leave 'text.verbosity' out "
                          "or \"medium\"", lambda v: v == "medium")}
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
    "encrypted_content": _refused("this server makes no encrypted reasoning and cannot read "
                                  "another's; leave 'encrypted_content' out")}
PART_FIELDS: Final[dict[str, Rule]] = {
    "type": HONOURED, "text": HONOURED, "annotations": HONOURED, "logprobs": HONOURED}
ROLES = {"user": "user", "assistant": "assistant", "system": "system",
         "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
