"""A reasoning model's settings and reasoning, as the clients name them.

Three names for one thing, in each direction:

- Asked for: OpenAI's ``reasoning_effort`` (none, minimal, low, medium, high; LiteLLM,
  aider, LangChain send it) and OpenRouter's ``reasoning`` object (``{"effort": ...}``,
  which Open WebUI sends; ``{"enabled": false}`` is effort none). The model hears it
  through its chat template (``template_kwargs``): every template gets
  ``reasoning_effort`` as a variable (gpt-oss's reads it; a template that does not just
  never looks), and none or minimal also sets ``enable_thinking`` false, the switch of
  Qwen3-style templates. A model that does not reason reads neither and answers as
  always. The client's own ``chat_template_kwargs`` win over both: they name the model's
  variables themselves, so a client that sets ``enable_thinking`` there keeps it.
  The Responses API's ``reasoning.effort`` and the Messages API's ``output_config.effort``
  (or ``thinking.budget_tokens``, ``messages.py``) come here too: each endpoint puts the
  effort on its ``ChatRequest`` and ``chatting.py`` calls ``template_kwargs``, one rule
  for all. Their newer names above high (``xhigh``, ``max``) read as high
  (``read_effort``): templates know none above it. One documented difference: the
  Messages API's ``thinking`` is Anthropic's switch, so its request carries
  ``enable_thinking`` itself (true for enabled or adaptive, false when disabled or
  absent, as Anthropic's models do not think unless asked), and, like a client's
  ``chat_template_kwargs``, it wins.
- Sent back in history: an assistant message's ``reasoning_content`` (DeepSeek's,
  vLLM's older name, this server's answers by default) or ``reasoning`` (vLLM's newer
  one); both, different, are refused.
- Answered: ``[serve] reasoning_field`` picks the key of a chat answer's reasoning,
  whole and streamed (``formats.ChatFormat``): ``reasoning_content`` (the default: what
  DeepSeek, mlx-lm's server and vLLM before 0.10 send, which the clients already read),
  ``reasoning`` (vLLM's newer key, OpenRouter's), or ``both``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, get_args

from mlxceld.api.errors import invalid
from mlxceld.api.fields import Fields, show
from mlxceld.api.surface import REASONING_FIELDS, check_fields

EFFORTS: Final = ("none", "minimal", "low", "medium", "high")
QUIET_EFFORTS: Final = frozenset({"none", "minimal"})  # enable_thinking false
ABOVE_HIGH: Final = ("xhigh", "max")  # the Responses and Messages APIs' names, read as high
ReasoningField = Literal["reasoning_content", "reasoning", "both"]
REASONING_KEYS: Final[tuple[str, ...]] = get_args(ReasoningField)


def reasoning_keys(field: ReasoningField) -> tuple[str, ...]:
    """The keys a chat answer's reasoning goes under."""
    return ("reasoning_content", "reasoning") if field == "both" else (field,)


def parse_effort(fields: Fields, ignored: list[str] | None) -> str | None:
    """A chat request's ``reasoning_effort``, or its ``reasoning.effort``
    (``reasoning.enabled`` false: none); the two, different: refused (400)."""
    effort = _effort(fields, "reasoning_effort")
    value = fields.object("reasoning")
    if value is None:
        return effort
    check_fields(value, REASONING_FIELDS, "reasoning", ignored)
    inner = Fields(value, "reasoning")
    nested = _effort(inner, "effort")
    if not inner.boolean("enabled", True):
        if nested not in (None, "none"):
            raise invalid(f"'reasoning.enabled' is false but 'reasoning.effort' is "
                          f"{nested!r}; send one of them", "reasoning.enabled")
        nested = "none"
    if effort is not None and nested is not None and effort != nested:
        raise invalid(f"'reasoning_effort' is {effort!r} but 'reasoning' asks for "
                      f"{nested!r}; send one of them", "reasoning")
    return effort or nested


def _effort(fields: Fields, name: str) -> str | None:
    effort = fields.string(name)
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"{fields.path(name)!r} must be one of {', '.join(EFFORTS)}, not "
                      f"{show(effort)}", fields.path(name))
    return effort


def parse_history_reasoning(fields: Fields) -> str | None:
    """An assistant message's earlier reasoning: ``reasoning_content`` or ``reasoning``
    (the same; both, different: refused naming ``reasoning``)."""
    content, plain = fields.string("reasoning_content"), fields.string("reasoning")
    if content is not None and plain is not None and content != plain:
        raise invalid(f"{fields.path('reasoning')!r} and 'reasoning_content' differ; they "
                      "are the same field (vLLM's and DeepSeek's names): send one",
                      fields.path("reasoning"))
    return content if content is not None else plain


def read_effort(effort: str) -> str:
    """An effort as the template gets it: ``ABOVE_HIGH`` as high, the rest as they are."""
    return "high" if effort in ABOVE_HIGH else effort


def template_kwargs(client: Mapping[str, Any], effort: str | None) -> dict[str, Any]:
    """What the chat template is given besides messages and tools: ``effort`` as
    ``reasoning_effort`` (and none or minimal as ``enable_thinking`` false), under the
    client's ``chat_template_kwargs``, which win."""
    ours: dict[str, Any] = {}
    if effort is not None:
        ours["reasoning_effort"] = effort
        if effort in QUIET_EFFORTS:
            ours["enable_thinking"] = False
    return {**ours, **client}
