"""Every field a chat or completion request may hold, and what the router does with it.

One table per endpoint, each field in one of four states:

- ``honoured``: it does what OpenAI documents (``requests.py`` reads it; ``n`` only as 1).
- ``opaque``: an identifier or a label for the caller's own books (``user``,
  ``safety_identifier``, ``prompt_cache_key``: strings; ``metadata``: an object):
  accepted once its type is checked, and by its nature nothing for a server that
  stores nothing to do.
- ``pending``: another part of issue 18 honours it; until it lands it behaves as it
  always did (checked where ``requests.py`` checks it, else accepted unread). The
  comment on each line names the part; that part turns it ``honoured`` in one line.
- ``refused``: a 400 (code ``unsupported_parameter``) naming the field and what to do,
  unless its value asks nothing this server does not do (``ALLOWED``: ``n`` 1,
  ``modalities`` ``["text"]``, ``store`` false, ``echo`` false, ``best_of`` 1, ...).

Each chat message has its own table by role (``ROLE_FIELDS``), read the same way.
A field in neither table is refused (400, code ``unknown_parameter``) naming every
such field. ``null`` counts as absent, here as in ``fields.py``: some clients send
every optional field, unset ones as null.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from mlxceld.api.errors import invalid
from mlxceld.api.fields import kind, show

State = Literal["honoured", "opaque", "pending", "refused"]
MAX_NAMED = 5  # unknown fields named in one error; the rest are counted


@dataclass(frozen=True)
class Rule:
    state: State
    note: str = ""  # refused: why, and what to do; pending: the part that will honour it
    allowed: Callable[[Any], bool] | None = None  # refused: values that ask for nothing
    shape: type | None = None  # opaque: the JSON type its value must have (str or dict)


def _honoured() -> Rule:
    return Rule("honoured")


def _pending(part: str) -> Rule:
    return Rule("pending", f"issue 18 part '{part}'")


def _refused(note: str, allowed: Callable[[Any], bool] | None = None) -> Rule:
    return Rule("refused", note, allowed)


SHARED: Final[dict[str, Rule]] = {
    "model": _honoured(),
    "max_tokens": _honoured(),
    "max_completion_tokens": _honoured(),
    "temperature": _honoured(),
    "top_p": _honoured(),
    "top_k": _honoured(),  # an extension (vLLM, mlx_lm.server)
    "seed": _honoured(),
    "stop": _honoured(),
    "stream": _honoured(),
    "stream_options": _honoured(),
    "n": _honoured(),  # 1 only: requests.py refuses any other
    "user": Rule("opaque", shape=str),
    "presence_penalty": _honoured(),
    "frequency_penalty": _honoured(),
    "repetition_penalty": _honoured(),
    "min_p": _honoured(),
    "logit_bias": _honoured(),
    "logprobs": _honoured(),
    "response_format": _honoured(),  # completions too, as vLLM
}

CHAT_FIELDS: Final[dict[str, Rule]] = {
    **SHARED,
    "messages": _honoured(),
    "safety_identifier": Rule("opaque", shape=str),
    "prompt_cache_key": Rule("opaque", shape=str),
    "metadata": Rule("opaque", shape=dict),
    "top_logprobs": _honoured(),
    "tools": _honoured(),
    "tool_choice": _honoured(),
    "parallel_tool_calls": _honoured(),
    "chat_template_kwargs": _honoured(),
    "audio": _refused("audio output is not served; leave 'audio' out"),
    "modalities": _refused('only text is served; send ["text"] or leave \'modalities\' out',
                           lambda v: v == ["text"]),
    "prediction": _refused("predicted outputs are not served; leave 'prediction' out"),
    "web_search_options": _refused("web search is not served; leave 'web_search_options' "
                                   "out"),
    "functions": _refused("the legacy 'functions' is not served; send 'tools' instead"),
    "function_call": _refused("the legacy 'function_call' is not served; send "
                              "'tool_choice' instead"),
    "service_tier": _refused('one tier is served; send "auto" or leave \'service_tier\' out',
                             lambda v: v in ("auto", "default")),
    "store": _refused("this server stores no completions; send false or leave 'store' out",
                      lambda v: v is False),
    "reasoning_effort": _refused("set a reasoning model's thinking through "
                                 "'chat_template_kwargs' (e.g. {\"enable_thinking\": false}) "
                                 "instead; leave 'reasoning_effort' out"),
    "verbosity": _refused("the model's verbosity cannot be set; leave 'verbosity' out"),
    "moderation": _refused("this server does not moderate; leave 'moderation' out"),
    "prompt_cache_retention": _refused("this server's prompt cache is the operator's "
                                       "([serve] prompt_cache_bytes), not a request's; "
                                       "leave 'prompt_cache_retention' out"),
    "prompt_cache_options": _refused("this server's prompt cache is the operator's "
                                     "([serve] prompt_cache_bytes), not a request's; "
                                     "leave 'prompt_cache_options' out"),
}

COMPLETION_FIELDS: Final[dict[str, Rule]] = {
    **SHARED,
    "prompt": _honoured(),
    "echo": _refused("echoing the prompt is not served; leave 'echo' out or false",
                     lambda v: v is False),
    "best_of": _refused("one candidate is generated per request; leave 'best_of' out or 1",
                        lambda v: v == 1 and not isinstance(v, bool)),
    "suffix": _refused("insertion (a suffix after the completion) is not served; leave "
                       "'suffix' out", lambda v: v == ""),
}


# A chat message's fields, by its role (``requests.py`` reads them; ``name`` and an
# assistant's ``reasoning_content`` go to the chat template, whose messages carry them).
MESSAGE_FIELDS: Final[dict[str, Rule]] = {
    "role": _honoured(),
    "content": _honoured(),
    "name": _honoured(),
}

# A text part of a message's content (the only part type served).
TEXT_PART_FIELDS: Final[dict[str, Rule]] = {"type": _honoured(), "text": _honoured()}

ROLE_FIELDS: Final[dict[str, dict[str, Rule]]] = {
    "system": MESSAGE_FIELDS,
    "user": MESSAGE_FIELDS,
    "assistant": {
        **MESSAGE_FIELDS,
        "tool_calls": _honoured(),
        "reasoning_content": _honoured(),  # an earlier answer's, as this server returns it
        "refusal": _refused("a refusal is not read back into the chat; send its text as "
                            "'content' instead"),
        "audio": _refused("audio is not served; leave an assistant message's 'audio' out"),
        "function_call": _refused("the legacy 'function_call' is not served; send "
                                  "'tool_calls' instead"),
    },
    "tool": {**MESSAGE_FIELDS, "tool_call_id": _honoured()},
}


def check_fields(body: Mapping[str, Any], table: Mapping[str, Rule], prefix: str = "") -> None:
    """Refuse ``body`` (a request's top-level object, or one of its messages: ``prefix``
    is then its path, ``messages[2]``) if it holds a refused field with a value that asks
    for something, or fields ``table`` does not know (each named)."""
    def path(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    unknown = [name for name, value in body.items() if value is not None and name not in table]
    if unknown:
        names = ", ".join(show(path(n)) for n in unknown[:MAX_NAMED])
        more = f" and {len(unknown) - MAX_NAMED} more" if len(unknown) > MAX_NAMED else ""
        raise invalid(f"unknown field{'s' if len(unknown) > 1 else ''} {names}{more}: this "
                      "server honours OpenAI's fields and top_k, and refuses what it does not "
                      "know rather than ignore it; remove "
                      f"{'them' if len(unknown) > 1 else 'it'}", path(unknown[0])[:200],
                      "unknown_parameter")
    for name, value in body.items():
        rule = table[name] if value is not None else None
        if rule is not None and rule.state == "refused" and not (
                rule.allowed is not None and rule.allowed(value)):
            raise invalid(f"{path(name)!r} is not supported by this server: {rule.note}",
                          path(name), "unsupported_parameter")
        if rule is not None and rule.shape is not None and not isinstance(value, rule.shape):
            wanted = "a string" if rule.shape is str else "an object"
            raise invalid(f"{path(name)!r} must be {wanted}, not {kind(value)}", path(name))
