"""Request fields beyond sampling: which ones pagellm refuses when set, the response id, and stream usage options.

A field that only informs (user, metadata, store, session_id, ...) or names a feature this server does not run
(KV transfer, custom extensions) is accepted and changes nothing, as in a vLLM server without that feature. A field
whose non-default value would change the result in a way pagellm cannot produce is a 400 naming it: answering
without it would silently give a different result than the client asked for."""

from __future__ import annotations

import uuid

from starlette.requests import Request

from pagellm.entrypoints.openai.errors import bad_request
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

# vLLM's header that overrides the body's request_id.
REQUEST_ID_HEADER = "X-Request-Id"


def _refuse(param: str, value: object, why: str) -> None:
    raise bad_request(f"{param}={value!r:.80} is not supported by this server: {why}; omit {param}.", param,
                      "unsupported_parameter")


def refuse_unsupported(request: SamplingFields) -> None:
    """The 400 for the first field set to something pagellm cannot do (the fields of both routes)."""
    if request.watermarking:
        _refuse("watermarking", request.watermarking, "pagellm does not watermark its output")
    if request.logprob_token_ids is not None:
        _refuse("logprob_token_ids", request.logprob_token_ids,
                "log-probabilities come for the top tokens (logprobs / top_logprobs), not for chosen ids")
    if request.repetition_detection is not None:
        _refuse("repetition_detection", request.repetition_detection, "pagellm has no repetition detector")
    if request.thinking_token_budget not in (None, -1):
        _refuse("thinking_token_budget", request.thinking_token_budget,
                "pagellm has no reasoning parser to count thinking tokens with")
    if isinstance(request, CompletionRequest):
        _refuse_completion_fields(request)
    if isinstance(request, ChatCompletionRequest):
        _refuse_chat_fields(request)


def _refuse_completion_fields(request: CompletionRequest) -> None:
    if request.suffix is not None:
        _refuse("suffix", request.suffix, "fill-in-the-middle needs a model-specific prompt format")
    if request.prompt_embeds is not None:
        _refuse("prompt_embeds", "...", "prompts are text or token ids here")


def _refuse_chat_fields(request: ChatCompletionRequest) -> None:
    if request.mm_processor_kwargs:
        _refuse("mm_processor_kwargs", request.mm_processor_kwargs, "pagellm serves text-only models")
    if request.media_io_kwargs:
        _refuse("media_io_kwargs", request.media_io_kwargs, "pagellm serves text-only models")
    if request.modalities is not None and request.modalities != ["text"]:
        _refuse("modalities", request.modalities, "pagellm answers in text only")
    if request.audio is not None:
        _refuse("audio", request.audio, "pagellm answers in text only")
    if request.functions is not None or request.function_call is not None:
        param = "functions" if request.functions is not None else "function_call"
        _refuse(param, getattr(request, param), "the deprecated functions API is not served; pass tools and "
                "tool_choice instead")
    if request.web_search_options is not None:
        _refuse("web_search_options", request.web_search_options, "pagellm does not search the web")
    if request.moderation is not None:
        _refuse("moderation", request.moderation, "pagellm does not run a moderation model")


def response_ids(prefix: str, request: SamplingFields, raw_request: Request) -> tuple[str, str]:
    """(The response id, the base of its engine request ids). As in vLLM the id is prefix-<X-Request-Id header>,
    else prefix-<request_id>, else random; a client's id gets a random tail inside the engine, where ids must be
    unique while two requests with the same id may run at once."""
    given = raw_request.headers.get(REQUEST_ID_HEADER) or request.request_id
    if not given:
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        return response_id, response_id
    response_id = f"{prefix}-{given}"
    return response_id, f"{response_id}-{uuid.uuid4().hex[:8]}"


def stream_usage(request: SamplingFields) -> tuple[bool, bool]:
    """(usage at the end of a stream, usage on every chunk): continuous_usage_stats counts only with
    include_usage, as in vLLM."""
    options = request.stream_options
    include = bool(options and options.include_usage)
    return include, include and bool(options.continuous_usage_stats)
