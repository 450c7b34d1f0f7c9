"""Every field a chat or completion request may hold, and what the router does with it.

One table per endpoint, each field in one of five states:

- ``honoured``: it does what OpenAI (or, for an extension, the server it comes from:
  vLLM, llama.cpp, OpenRouter) documents (``requests.py`` reads it; ``n`` only as 1).
- ``opaque``: an identifier or a label for the caller's own books (``user``,
  ``safety_identifier``, ``prompt_cache_key``, ``request_id``: strings; ``metadata``: an
  object): accepted once its type is checked, and by its nature nothing for a server
  that stores nothing to do.
- ``hint``: a hint other servers take, which changes nothing here (``cache_control``,
  ``cache_prompt``: the prompt cache is automatic; ``keep_alive``: the model stays
  loaded): accepted once its type is checked, and documented as doing nothing.
- ``refused``: a 400 (code ``unsupported_parameter``) naming the field and what to do,
  unless its value asks nothing this server does not do (``allowed``: ``n`` 1,
  ``modalities`` ``["text"]``, ``store`` false, ``echo`` false, ``best_of`` 1, a
  sampler's neutral value, ...).

Each chat message has its own table by role (``ROLE_FIELDS``), read the same way, and so
do a text content part and the ``reasoning`` object.
A field in no table is refused (400, code ``unknown_parameter``) naming every such field,
unless the operator set ``[serve] unknown_fields = "warn"``: then it is ignored, and the
caller's list ``ignored`` gets its path (``ignoring.py`` logs it once and names it in the
answer's ``x-mlxceld-ignored-fields`` header). ``null`` counts as absent, here as in
``fields.py``: some clients send every optional field, unset ones as null.

``python -m mlxceld.api.fielddoc`` writes these tables as docs/api-fields.md holds them (a
test checks that the two agree).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from mlxceld.api.errors import invalid
from mlxceld.api.fields import kind, show

State = Literal["honoured", "opaque", "hint", "refused"]
Shape = type | tuple[type, ...]
MAX_NAMED = 5  # unknown fields named in one error; the rest are counted
NUMBER: Final = (int, float)
SHAPE_WORDS: Final[dict[Any, str]] = {str: "a string", dict: "an object", bool: "a boolean",
                                      int: "an integer", NUMBER: "a number",
                                      (str, int, float): "a string or a number"}


@dataclass(frozen=True)
class Rule:
    state: State
    note: str = ""  # refused: why, and what to do; honoured, hint: what is done
    allowed: Callable[[Any], bool] | None = None  # refused: values that ask for nothing
    shape: Shape | None = None  # opaque, hint: the JSON type its value must have
    allowed_doc: str = ""  # the allowed values, as the docs show them


def honoured(note: str = "") -> Rule:
    return Rule("honoured", note)


def hint(note: str, shape: Shape) -> Rule:
    return Rule("hint", note, shape=shape)


def refused(note: str, allowed: Callable[[Any], bool] | None = None,
             allowed_doc: str = "") -> Rule:
    return Rule("refused", note, allowed, allowed_doc=allowed_doc)


def _neutral(name: str, value: float, note: str) -> Rule:
    """A sampler this server does not have: refused unless its neutral ``value``."""
    return refused(f"{note}; leave {name!r} out or {value:g}",
                    lambda v: not isinstance(v, bool) and v == value, f"{value:g}")


def _is(value: Any) -> Callable[[Any], bool]:
    return lambda v: v is value


SHARED: Final[dict[str, Rule]] = {
    "model": honoured(),
    "max_tokens": honoured(),
    "max_completion_tokens": honoured(),
    "temperature": honoured(),
    "top_p": honoured(),
    "top_k": honoured("an extension (vLLM, mlx_lm.server); 0 or -1 (vLLM's) is off"),
    "seed": honoured(),
    "stop": honoured("up to 16 strings"),
    "stream": honoured(),
    "stream_options": honoured(),
    "n": honoured("1 only"),
    "user": Rule("opaque", shape=str),
    "presence_penalty": honoured(),
    "frequency_penalty": honoured(),
    "repetition_penalty": honoured("vLLM's, mlx-lm's"),
    "min_p": honoured("vLLM's, llama.cpp's"),
    "logit_bias": honoured(),
    "logprobs": honoured(),
    "response_format": honoured("completions too, as vLLM"),
}

# Other servers' extras (vLLM, llama.cpp, Ollama), on both endpoints.
EXTRAS: Final[dict[str, Rule]] = {
    "min_tokens": honoured("vLLM's: end-of-sequence tokens are masked until this many "
                            "tokens were generated (stop strings still apply)"),
    "ignore_eos": honoured("vLLM's, llama.cpp's: end-of-sequence tokens are masked; the "
                            "answer runs to max_tokens or a stop string"),
    "guided_json": honoured("vLLM's: as response_format json_schema with this schema"),
    "request_id": Rule("opaque", shape=str),
    "cache_prompt": hint("llama.cpp's: the prompt (prefix) cache is automatic here", bool),
    "keep_alive": hint("Ollama's: the model stays loaded while the daemon serves it",
                        (str, int, float)),
    "num_ctx": hint("Ollama's: the context is the operator's ([serve] context_length); "
                     "a prompt that does not fit is refused", int),
    "spaces_between_special_tokens": hint("vLLM's: special tokens are never shown, so "
                                           "there is nothing to space", bool),
    "mirostat_tau": hint("llama.cpp's: read only with mirostat, which is refused "
                          "unless 0", NUMBER),
    "mirostat_eta": hint("llama.cpp's: read only with mirostat, which is refused "
                          "unless 0", NUMBER),
    "n_predict": refused("llama.cpp's native name; send 'max_tokens' instead"),
    "typical_p": _neutral("typical_p", 1.0, "locally typical sampling is not served"),
    "tfs_z": _neutral("tfs_z", 1.0, "tail-free sampling is not served"),
    "mirostat": _neutral("mirostat", 0, "mirostat sampling is not served"),
    "options": refused("Ollama's 'options' object is not read; send its fields "
                        "(temperature, top_p, top_k, seed, stop, ...) at the top level"),
    "skip_special_tokens": refused("special tokens are always skipped; send true or leave "
                                    "'skip_special_tokens' out", _is(True), "true"),
    "include_stop_str_in_output": refused("the stop string is never part of the output; "
                                           "send false or leave "
                                           "'include_stop_str_in_output' out",
                                           _is(False), "false"),
    "use_beam_search": refused("beam search is not served; send false or leave "
                                "'use_beam_search' out", _is(False), "false"),
    "length_penalty": _neutral("length_penalty", 1.0, "beam search is not served"),
    "stop_token_ids": refused("stop tokens by id are not served; send their text as "
                               "'stop'", lambda v: v == [], "[]"),
    "return_tokens_as_token_ids": refused("tokens are returned as text; send false or "
                                           "leave 'return_tokens_as_token_ids' out",
                                           _is(False), "false"),
    "guided_regex": refused("regular-expression output is not served; send "
                             "'response_format' (a JSON schema) instead"),
    "guided_choice": refused("a choice of strings is not served; send 'response_format' "
                              "(a JSON schema with an enum) instead"),
    "guided_grammar": refused("a grammar is not served; send 'response_format' (a JSON "
                               "schema) instead"),
    "priority": refused("requests are served first come, first served; send 0 or leave "
                         "'priority' out", lambda v: v == 0 and not isinstance(v, bool), "0"),
}

CHAT_FIELDS: Final[dict[str, Rule]] = {
    **SHARED,
    **EXTRAS,
    "messages": honoured(),
    "safety_identifier": Rule("opaque", shape=str),
    "prompt_cache_key": Rule("opaque", shape=str),
    "metadata": Rule("opaque", shape=dict),
    "top_logprobs": honoured(),
    "tools": honoured(),
    "tool_choice": honoured(),
    "parallel_tool_calls": honoured(),
    "chat_template_kwargs": honoured("vLLM's: variables for the chat template"),
    "reasoning_effort": honoured("none, minimal, low, medium or high: the chat template "
                                  "gets it as reasoning_effort, and none or minimal as "
                                  "enable_thinking false"),
    "reasoning": honoured("OpenRouter's and Open WebUI's {\"effort\": ...} (and "
                           "\"enabled\": false, as effort none)"),
    "audio": refused("audio output is not served; leave 'audio' out"),
    "modalities": refused('only text is served; send ["text"] or leave \'modalities\' out',
                           lambda v: v == ["text"], '["text"]'),
    "prediction": refused("predicted outputs are not served; leave 'prediction' out"),
    "web_search_options": refused("web search is not served; leave 'web_search_options' "
                                   "out"),
    "functions": refused("the legacy 'functions' is not served; send 'tools' instead"),
    "function_call": refused("the legacy 'function_call' is not served; send "
                              "'tool_choice' instead"),
    "service_tier": refused('one tier is served; send "auto" or leave \'service_tier\' out',
                             lambda v: v in ("auto", "default"), '"auto", "default"'),
    "store": refused("this server stores no completions; send false or leave 'store' out",
                      _is(False), "false"),
    "verbosity": refused("the model's verbosity cannot be set; leave 'verbosity' out"),
    "moderation": refused("this server does not moderate; leave 'moderation' out"),
    "prompt_cache_retention": refused("this server's prompt cache is the operator's "
                                       "([serve] prompt_cache_bytes), not a request's; "
                                       "leave 'prompt_cache_retention' out"),
    "prompt_cache_options": refused("this server's prompt cache is the operator's "
                                     "([serve] prompt_cache_bytes), not a request's; "
                                     "leave 'prompt_cache_options' out"),
    "echo": refused("echoing the prompt is not served on chat; leave 'echo' out or false",
                     _is(False), "false"),
    "best_of": refused("one candidate is generated per request; leave 'best_of' out or 1",
                        lambda v: v == 1 and not isinstance(v, bool), "1"),
    "add_generation_prompt": refused("the assistant's turn is always opened; send true or "
                                      "leave 'add_generation_prompt' out", _is(True), "true"),
    "continue_final_message": refused("a final assistant message is not continued; send "
                                       "false or leave 'continue_final_message' out",
                                       _is(False), "false"),
}

COMPLETION_FIELDS: Final[dict[str, Rule]] = {
    **SHARED,
    **EXTRAS,
    "prompt": honoured(),
    "echo": refused("echoing the prompt is not served; leave 'echo' out or false",
                     _is(False), "false"),
    "best_of": refused("one candidate is generated per request; leave 'best_of' out or 1",
                        lambda v: v == 1 and not isinstance(v, bool), "1"),
    "suffix": refused("insertion (a suffix after the completion) is not served; leave "
                       "'suffix' out", lambda v: v == "", '""'),
}

# The ``reasoning`` object of a chat request (OpenRouter's; Open WebUI sends its effort).
REASONING_FIELDS: Final[dict[str, Rule]] = {
    "effort": honoured("as reasoning_effort"),
    "enabled": honoured("false: as effort none"),
    "max_tokens": refused("a reasoning budget in tokens is not served; send 'effort' "
                           "instead"),
    "exclude": refused("the reasoning is always returned apart from the content; send "
                        "false or leave 'reasoning.exclude' out", _is(False), "false"),
}

CACHE_CONTROL = hint("Anthropic's and OpenRouter's: the prompt (prefix) cache is "
                      "automatic here", dict)

# A chat message's fields, by its role (``requests.py`` reads them; ``name`` and an
# assistant's reasoning go to the chat template, whose messages carry them).
MESSAGE_FIELDS: Final[dict[str, Rule]] = {
    "role": honoured(),
    "content": honoured(),
    "name": honoured(),
    "cache_control": CACHE_CONTROL,
}

# A text part of a message's content (the only part type served).
TEXT_PART_FIELDS: Final[dict[str, Rule]] = {"type": honoured(), "text": honoured(),
                                            "cache_control": CACHE_CONTROL}

ROLE_FIELDS: Final[dict[str, dict[str, Rule]]] = {
    "system": MESSAGE_FIELDS,
    "user": MESSAGE_FIELDS,
    "assistant": {
        **MESSAGE_FIELDS,
        "tool_calls": honoured(),
        "reasoning_content": honoured("an earlier answer's reasoning, to the template"),
        "reasoning": honoured("the same as reasoning_content (vLLM's newer name)"),
        "refusal": refused("a refusal is not read back into the chat; send its text as "
                            "'content' instead"),
        "audio": refused("audio is not served; leave an assistant message's 'audio' out"),
        "function_call": refused("the legacy 'function_call' is not served; send "
                                  "'tool_calls' instead"),
    },
    "tool": {**MESSAGE_FIELDS, "tool_call_id": honoured()},
}


def check_fields(body: Mapping[str, Any], table: Mapping[str, Rule], prefix: str = "",
                 ignored: list[str] | None = None) -> None:
    """Refuse ``body`` (a request's top-level object, or one of its messages: ``prefix``
    is then its path, ``messages[2]``) if it holds a refused field with a value that asks
    for something, or fields ``table`` does not know (each named). ``ignored``: the
    operator's ``unknown_fields = "warn"``: unknown fields' paths go there instead, and
    nothing reads them."""
    def path(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    unknown = [name for name, value in body.items() if value is not None and name not in table]
    if unknown and ignored is not None:
        ignored.extend(path(n) for n in unknown)
    elif unknown:
        names = ", ".join(show(path(n)) for n in unknown[:MAX_NAMED])
        more = f" and {len(unknown) - MAX_NAMED} more" if len(unknown) > MAX_NAMED else ""
        raise invalid(f"unknown field{'s' if len(unknown) > 1 else ''} {names}{more}: this "
                      "server honours the fields docs/api-fields.md lists (each API's own, and "
                      "other servers' extensions), and refuses what it does not know rather "
                      "than ignore it; remove "
                      f"{'them' if len(unknown) > 1 else 'it'}", path(unknown[0])[:200],
                      "unknown_parameter")
    for name, value in body.items():
        rule = table.get(name) if value is not None else None
        if rule is not None and rule.state == "refused" and not (
                rule.allowed is not None and rule.allowed(value)):
            raise invalid(f"{path(name)!r} is not supported by this server: {rule.note}",
                          path(name), "unsupported_parameter")
        if rule is not None and rule.shape is not None and not _fits(value, rule.shape):
            raise invalid(f"{path(name)!r} must be {SHAPE_WORDS[rule.shape]}, not "
                          f"{kind(value)}", path(name))


def _fits(value: Any, shape: Shape) -> bool:
    """``value`` is of ``shape``'s JSON type (a boolean is no number here)."""
    return isinstance(value, shape) and (shape is bool or not isinstance(value, bool))
