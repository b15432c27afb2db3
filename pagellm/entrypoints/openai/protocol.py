"""Request and response bodies of the OpenAI-compatible API: the fields of vLLM's protocol models and OpenAI's.

Requests take every field vLLM's CompletionRequest / ChatCompletionRequest take (tests/data/vllm_request_fields.json
lists them) and OpenAI's own. A field pagellm does not know is ignored with a warning in the log, as vLLM ignores
it, so that a client written for vLLM or OpenAI runs unchanged; a known field set to a value that would change the
result in a way pagellm cannot produce is a 400 naming it (see fields.refuse_unsupported). Types are strict, as
SamplingParams checks them for the offline API and /generate: `"false"` is not a boolean and `"5"` is not a number.

Responses carry the keys vLLM's response models carry (null where pagellm has nothing to put), plus pagellm's `kv`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

from pagellm.core.kv_usage import KVUsage

logger = logging.getLogger(__name__)

# Token ids first: pydantic's smart union then keeps [1, 2, 3] as ids, and a list of strings stays text.
PromptField = Union[list[int], list[list[int]], str, list[str]]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

# vLLM's default cap on log-probabilities per position (ModelConfig.max_logprobs); the server's own cap is the
# engine argument max_logprobs when it has one. OpenAI allows 5 (completions) and 20 (chat).
MAX_LOGPROBS = 20

# How many unknown field names one warning line shows.
_SHOWN_UNKNOWN_FIELDS = 20


class StrictModel(BaseModel):
    """A request body: strict types; unknown fields ignored, with a warning naming them (vLLM's OpenAIBaseModel
    logs and ignores them as well)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    _known_fields: ClassVar[frozenset[str] | None] = None

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(str(key) for key in data.keys() - cls._field_names())
            if unknown:
                shown = unknown[:_SHOWN_UNKNOWN_FIELDS] + (["..."] if len(unknown) > _SHOWN_UNKNOWN_FIELDS else [])
                logger.warning("%s: ignoring fields this server does not know: %s", cls.__name__, ", ".join(shown))
        return data

    @classmethod
    def _field_names(cls) -> frozenset[str]:
        # Each class keeps its own set (a subclass has more fields than its base).
        if cls.__dict__.get("_known_fields") is None:
            names = set(cls.model_fields)
            names |= {f.alias for f in cls.model_fields.values() if f.alias}
            cls._known_fields = frozenset(names)
        return cls._known_fields


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    # vLLM's: usage on every chunk (with include_usage).
    continuous_usage_stats: bool | None = False


class ResponseFormat(StrictModel):
    type: str
    # {"name": ..., "schema": {...}, "strict": ..., "description": ...} as OpenAI's clients send it.
    json_schema: dict[str, Any] | None = None


class SamplingFields(StrictModel):
    """The fields /v1/completions and /v1/chat/completions share, with OpenAI's ranges."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # null or unset: the model's generation_config default, else 0 (as vLLM).
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # Accepted and not used, as in vLLM and OpenAI (an end-user id for abuse monitoring).
    user: str | None = None
    # vLLM's sampling extensions.
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    # Beam search's: scores are divided by length ** length_penalty.
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Keep this many prompt tokens (-1: as many as the context allows), cut from truncation_side ("left" keeps
    # the last ones, vLLM's default for generation).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: Annotated[int, Field(ge=-1)] | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs / guided_* (one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's request extensions.
    priority: Int64 = 0
    # The response id's suffix (cmpl-<request_id>); an X-Request-Id header takes precedence, as in vLLM.
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Accepted with vLLM's types; they change nothing here (no routed experts, KV or encoder-cache transfer, custom
    # extensions, render-only options), as they change nothing in a vLLM server without those features.
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] = 0
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # Chunking of a stream (tokens per chunk); pagellm sends each engine step's tokens as they come.
    stream_interval: Annotated[int, Field(ge=1)] | None = None
    # Refused unless at their defaults: pagellm has no repetition detector and no reasoning parser.
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None

    @model_validator(mode="after")
    def _check_cache_salt(self) -> SamplingFields:
        # vLLM's validate_cache_salt: the salt ends up in cache keys and paths.
        salt = self.cache_salt
        if salt is not None and (len(salt) > 128 or any(c in salt for c in "@/\\\x00")):
            raise ValueError("cache_salt must be at most 128 characters and must not contain '@', '/', '\\' or NUL.")
        return self


class CompletionRequest(SamplingFields):
    prompt: PromptField
    # null means OpenAI's default of 16, as in vLLM.
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=-1)] | None = None
    # The same cap as n: every sequence counts against max_num_seqs (a larger best_of is refused there too).
    best_of: int | None = Field(default=None, ge=1, le=128)
    suffix: str | None = None
    prompt_embeds: bytes | list[bytes] | None = None
    add_special_tokens: bool = True

    @field_validator("max_tokens", mode="after")
    @classmethod
    def _null_max_tokens(cls, value: int | None) -> int:
        return 16 if value is None else value


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
    n: int | None = Field(default=1, ge=1, le=128)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # Written into the chat template's variables (reasoning_effort, and enable_thinking unless the request's
    # chat_template_kwargs set it), as vLLM does.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True
    # vLLM's extensions.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None
    # OpenAI's. Accepted and not used: they neither change the text nor ask for what pagellm cannot give.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # Predicted outputs only speed OpenAI's answer up; the answer is the same without them.
    prediction: dict[str, Any] | None = None
    # OpenAI's, refused when set (fields.refuse_unsupported): audio output, the deprecated functions API, web
    # search, moderation.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

    @field_validator("n", mode="after")
    @classmethod
    def _null_n(cls, value: int | None) -> int:
        return 1 if value is None else value


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
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)

    def counts(self) -> dict[str, int]:
        """The three counts alone: a stream's usage, as vLLM sends it."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token (null for an echoed prompt's first)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


# vLLM's per-position prompt log-probabilities: {"token id": {"logprob", "rank", "decoded_token"}}, null first.
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    # pagellm's extra object beside `usage`: the KV memory of its engine requests, added up field by field.
    kv: KVUsage | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _without_empty_tool_calls(self, handler) -> dict:
        # vLLM's ChatMessage leaves tool_calls out when there are none.
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    # As CompletionResponse.kv.
    kv: KVUsage | None = None


class ModelPermission(BaseModel):
    """vLLM's (and OpenAI's former) permission object of a model card: what a client may do with the model."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=_now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagellm"
    root: str
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
