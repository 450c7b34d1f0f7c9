"""The JSON shapes of the OpenAI API that the router port answers with.

Field for field what OpenAI's API reference shows, so that its clients parse
them: ``logprobs`` is null unless the request asked for them, ``usage`` is null on the
chunks of a stream except the last one when the client asked for usage.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

from mlxceld.engine import FinishReason

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


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(TypedDict):
    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str]


class ChatChunkChoice(TypedDict):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


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


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]
