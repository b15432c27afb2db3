"""Request and response bodies of the OpenAI-compatible API (the fields the OpenAI API and vLLM define).

Unknown request fields are refused (400, naming the field) rather than ignored, as the OpenAI API does: a
misspelt `max_token` should not silently fall back to a default. Types are strict, as SamplingParams checks
them for the offline API and /generate: `"false"` is not a boolean and `"5"` is not a number.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pagellm.core.kv_usage import KVUsage

# Token ids first: pydantic's smart union then keeps [1, 2, 3] as ids, and a list of strings stays text.
PromptField = Union[list[int], list[list[int]], str, list[str]]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False


class ResponseFormat(StrictModel):
    type: str
    # {"name": ..., "schema": {...}, "strict": ..., "description": ...} as OpenAI's clients send it.
    json_schema: dict[str, Any] | None = None


class SamplingFields(StrictModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions, with OpenAI's ranges."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* (one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# vLLM's default cap on log-probabilities per position; OpenAI allows 5 (completions) and 20 (chat).
MAX_LOGPROBS = 20


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # The same cap as n: every sequence counts against max_num_seqs (a larger best_of is refused there too).
    best_of: int | None = Field(default=None, ge=1, le=128)
    suffix: str | None = None


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, ...) pass through to the chat template.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(StrictModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


# A body with "messages" is a chat; errors then name the fields of that form only.
TokenizeRequest = Annotated[
    Union[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
          Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]],
    Discriminator(lambda body: "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body
                  else "TokenizeCompletionRequest"),
]


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # pagellm's extra object beside `usage`: the KV memory of its engine requests, added up field by field.
    kv: KVUsage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    # As CompletionResponse.kv.
    kv: KVUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagellm"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
