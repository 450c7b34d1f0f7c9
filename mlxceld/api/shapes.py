"""The JSON shapes of the OpenAI API that the router port answers with.

Field for field what OpenAI's API reference shows, so that its clients parse
them: ``logprobs`` is null unless the request asked for them, ``usage`` is null on the
chunks of a stream except the last one when the client asked for usage. A model card adds
``context_length``, which OpenAI's clients ignore.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

from mlxceld.engine import FinishReason

# A chat answer that called tools ends with "tool_calls" (where the engine said "stop").
ChatFinishReason = FinishReason | Literal["tool_calls"]
ErrorType = Literal["invalid_request_error", "server_error"]


class ErrorDetail(TypedDict):
    message: str
    type: ErrorType
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    error: ErrorDetail


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]
    refusal: None


class TextLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class PromptTokensDetails(TypedDict):
    cached_tokens: int  # of the prompt's tokens, those a prompt cache gave


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: NotRequired[PromptTokensDetails]


class FunctionCall(TypedDict):
    name: str
    arguments: str  # a JSON object's text


class ToolCallShape(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(TypedDict):
    """``content`` is null when the answer is tool calls only; ``reasoning_content`` (the
    model's thinking, as vLLM and DeepSeek name it) and ``tool_calls`` only when there are
    any."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: NotRequired[str]
    reasoning: NotRequired[str]  # the same, by vLLM's newer name ([serve] reasoning_field)
    tool_calls: NotRequired[list[ToolCallShape]]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(TypedDict):
    name: NotRequired[str]
    arguments: str


class ToolCallDelta(TypedDict):
    """A call streamed as OpenAI does: its first delta has the index, id, type and name
    (arguments ""), the next ones more of the arguments under the same index."""

    index: int
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: FunctionCallDelta


class Delta(TypedDict):
    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str]
    reasoning_content: NotRequired[str]
    reasoning: NotRequired[str]
    tool_calls: NotRequired[list[ToolCallDelta]]


class ChatChunkChoice(TypedDict):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: NotRequired[Usage | None]


class TextChoice(TypedDict):
    index: int
    text: str
    logprobs: TextLogprobs | None
    finish_reason: FinishReason | None


class TextCompletion(TypedDict):
    """Both the whole answer and each chunk of a stream of ``POST /v1/completions``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: NotRequired[Usage | None]


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    # Not OpenAI's (its model object has no context): the most tokens a sequence holds,
    # prompt and completion together, as served ([serve] context_length caps the model's).
    # OpenRouter's /models says it so; vLLM's ``max_model_len``, llama.cpp's ``n_ctx``.
    context_length: int
    max_model_len: int  # the same, by vLLM's name (clients written for vLLM read it)


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]
