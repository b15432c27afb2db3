"""vLLM's render endpoints: POST /v1/completions/render, /v1/chat/completions/render and /v1/responses/render
answer what the request would run with (its prompt's token ids and its sampling parameters), without
generating. The body is vLLM's `GenerateRequest`: a list of them for completions (one per prompt), one for a
chat or a response. As in vLLM, they answer only on a server started with --enable-scale-out.

Each validates and prepares its request as its generating route does, so a request the route refuses is
refused here with the same error."""

from __future__ import annotations

import dataclasses
import uuid

from pagellm.entrypoints.openai.errors import OpenAIError, bad_request, not_supported
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.serving import OpenAIServing, PromptInput
from pagellm.entrypoints.openai.serving_chat import _check_chat_supported, _structured_outputs
from pagellm.entrypoints.openai.serving_responses import ResponseStore, prepare_response
from pagellm.entrypoints.openai.structured import requested_structured_outputs
from pagellm.sampling_params import SamplingParams


def check_enabled(serving: OpenAIServing) -> None:
    if not serving.config.enable_scale_out:
        raise OpenAIError(403, "the render endpoints are off on this server; restart it with --enable-scale-out to "
                               "turn them on (as vLLM's).", None, "scale_out_disabled")


async def render_completion(serving: OpenAIServing, request: CompletionRequest) -> list[dict]:
    """As create_completion prepares its engine requests (serving_completion.py)."""
    serving.check_model(request.model)
    serving.check_stream_options(request)
    if request.best_of is not None and request.best_of > request.n and request.stream:
        raise bad_request(f"best_of={request.best_of} > n={request.n} cannot stream: which n completions are "
                          "returned is known only at the end; drop stream or best_of.", "best_of")
    if request.suffix is not None:
        raise not_supported("suffix", request.suffix)
    prompts = await serving.completion_prompts(request.prompt)
    for prompt in prompts:
        serving.check_length(prompt, request.max_tokens, "prompt")
    params = serving.sampling_params(request, request.max_tokens, request.logprobs, request.best_of,
                                     requested_structured_outputs(request))
    base_id = f"cmpl-{uuid.uuid4().hex}"
    return [generate_request(serving, base_id if len(prompts) == 1 else f"{base_id}-{index}", prompt, params,
                             request)
            for index, prompt in enumerate(prompts)]


async def render_chat(serving: OpenAIServing, request: ChatCompletionRequest) -> dict:
    """As create_chat_completion prepares its engine request (serving_chat.py)."""
    serving.check_model(request.model)
    serving.check_stream_options(request)
    _check_chat_supported(request)
    max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
    plan, structured = _structured_outputs(request, serving.config.auto_tool_parser)
    if plan is not None and plan.parser is not None and plan.parser.marker_is_special_token:
        request = request.model_copy(update={"skip_special_tokens": False})
    template_kwargs = dict(request.chat_template_kwargs or {})
    if request.tools:
        template_kwargs.setdefault("tools", request.tools)
    prompt = await serving.chat_prompt(request.messages, request.add_generation_prompt, template_kwargs)
    serving.check_length(prompt, max_tokens, "messages", max_tokens_param)
    num_top = (request.top_logprobs or 0) if request.logprobs else None
    params = serving.sampling_params(request, max_tokens, num_top, structured=structured)
    return generate_request(serving, f"chatcmpl-{uuid.uuid4().hex}", prompt, params, request)


async def render_response(serving: OpenAIServing, store: ResponseStore, request: ResponsesRequest) -> dict:
    prepared = await prepare_response(serving, request, store)
    return generate_request(serving, prepared.response_id, prepared.prompt, prepared.params,
                            request.sampling_fields())


def generate_request(serving: OpenAIServing, request_id: str, prompt: PromptInput, params: SamplingParams,
                     request: SamplingFields) -> dict:
    """vLLM's GenerateRequest: what a token-in/token-out engine would be sent. pagellm has no multimodal
    features, transfer parameters or reasoning parser, so those fields are null."""
    stream_options = request.stream_options.model_dump() if request.stream and request.stream_options else None
    return {
        "request_id": request_id,
        "token_ids": prompt.token_ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": sampling_params_dict(params, serving.max_model_len - len(prompt.token_ids)),
        "model": request.model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": getattr(request, "return_token_ids", None),
        "output_mode": "tokens",
        "stream": request.stream,
        "stream_options": stream_options,
        "cache_salt": getattr(request, "cache_salt", None),
        "priority": getattr(request, "priority", 0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def sampling_params_dict(params: SamplingParams, room: int) -> dict:
    """The user-facing fields of SamplingParams as JSON; max_tokens resolved as the engine resolves None
    (the room left in the context)."""
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.repr}
    values["max_tokens"] = room if params.max_tokens is None else min(params.max_tokens, room)
    values["output_kind"] = int(params.output_kind)
    if params.structured_outputs is not None:
        values["structured_outputs"] = {key: value for key, value in
                                        dataclasses.asdict(params.structured_outputs).items() if value is not None}
    return values
