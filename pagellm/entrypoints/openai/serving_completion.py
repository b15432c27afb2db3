"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from pagellm.entrypoints.openai.beam_search import BeamSearchRequest, beam_search
from pagellm.entrypoints.openai.errors import bad_request, from_exception
from pagellm.entrypoints.openai.fields import refuse_unsupported, response_ids, stream_usage
from pagellm.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs_json
from pagellm.entrypoints.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from pagellm.entrypoints.openai.serving import (
    SSE_DONE,
    Choice,
    OpenAIServing,
    PromptInput,
    abort_on_disconnect,
    kv_info,
    merge_outputs,
    record,
    sse,
)
from pagellm.entrypoints.openai.structured import compiled_grammar, requested_structured_outputs
from pagellm.outputs import RequestOutput


def _check_fields(request: CompletionRequest) -> None:
    if request.best_of is not None and request.best_of > request.n and request.stream:
        raise bad_request(f"best_of={request.best_of} > n={request.n} cannot stream: which n completions are "
                          "returned is known only at the end; drop stream or best_of.", "best_of")
    if request.stream and request.prompt_logprobs not in (None, 0):
        raise bad_request("prompt_logprobs are not sent in a stream; drop stream or prompt_logprobs.",
                          "prompt_logprobs")
    if request.use_beam_search:
        _check_beam_search(request)


def _check_beam_search(request: CompletionRequest) -> None:
    if request.stream:
        raise bad_request("use_beam_search cannot stream: the best beams are known only at the end; drop stream.",
                          "use_beam_search")
    if request.echo and request.logprobs is not None:
        raise bad_request("echo with logprobs needs the prompt's log-probabilities, which beam search does not "
                          "compute; drop echo or logprobs.", "echo")
    if request.prompt_logprobs is not None:
        raise bad_request("beam search does not compute prompt_logprobs; drop one of them.", "prompt_logprobs")
    if requested_structured_outputs(request) is not None:
        raise bad_request("beam search takes no structured-output constraint; drop use_beam_search or the "
                          "constraint.", "use_beam_search")


async def create_completion(serving: OpenAIServing, request: CompletionRequest, raw_request: Request):
    lora_request = serving.check_model(request.model)
    serving.check_stream_options(request)
    refuse_unsupported(request)
    _check_fields(request)
    num_top = serving.num_logprobs("logprobs", request.logprobs)
    prompt_logprobs = serving.num_logprobs("prompt_logprobs", request.prompt_logprobs)
    if prompt_logprobs is None and request.echo and num_top is not None:
        prompt_logprobs = num_top  # echo with logprobs scores the prompt's tokens too, as vLLM does
    # echo with max_tokens=0 returns the prompt alone; the engine still makes (and vLLM counts) one token.
    echo_only = bool(request.echo) and request.max_tokens == 0
    max_tokens = 1 if echo_only else request.max_tokens
    prompts = await serving.completion_prompts(request.prompt, request.add_special_tokens)
    prompts = [serving.truncate(p, request.truncate_prompt_tokens, request.truncation_side) for p in prompts]
    for prompt in prompts:
        serving.check_length(prompt, max_tokens, "prompt")
    response_id, engine_id = response_ids("cmpl", request, raw_request)
    priority = serving.priority(request, raw_request)
    if request.use_beam_search:
        choices = await _beam_search_choices(serving, request, raw_request, engine_id, prompts, max_tokens)
    else:
        params = serving.sampling_params(request, max_tokens, num_top, request.best_of,
                                         requested_structured_outputs(request), prompt_logprobs)
        params.structured_grammar = await compiled_grammar(serving.engine, params.structured_outputs)
        choices = serving.submit(engine_id, prompts, params, priority, request.cache_salt, lora_request)
        if request.stream:
            stream = _stream(serving, request, raw_request, response_id, prompts, choices, num_top)
            return StreamingResponse(stream, media_type="text/event-stream")
        await serving.run_to_completion(raw_request, choices)

    response_choices = [await _choice(serving, request, c, prompts[c.prompt_index], num_top, echo_only)
                        for c in choices]
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    response = CompletionResponse(id=response_id, model=serving.model_name, choices=response_choices,
                                  usage=UsageInfo.of(prompt_tokens, sum(c.num_tokens for c in choices)),
                                  kv=None if request.use_beam_search else kv_info(choices))
    return JSONResponse(response.model_dump())


async def _choice(serving: OpenAIServing, request: CompletionRequest, c: Choice, prompt: PromptInput,
                  num_top: int | None, echo_only: bool) -> CompletionChoice:
    """One finished choice; with echo its text (and logprobs) start with the prompt's, as vLLM's do."""
    text, token_ids, positions = c.text, c.token_ids, c.logprobs
    if request.echo:
        # vLLM leaves the echoed text out when the prompt's token ids are returned instead.
        echo = "" if request.return_token_ids else await _echo_text(serving, prompt)
        prompt_positions = c.prompt_logprobs or [None] * len(prompt.token_ids)
        if echo_only:
            text, token_ids, positions = echo, prompt.token_ids, prompt_positions
        else:
            text, token_ids = echo + text, prompt.token_ids + token_ids
            positions = prompt_positions + positions
    logprobs = None
    if num_top is not None:
        logprobs = completion_logprobs(token_ids, positions, num_top, 0, serving.tokenizer,
                                       bool(request.return_tokens_as_token_ids))
    return CompletionChoice(
        index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        token_ids=c.token_ids if request.return_token_ids else None,
        prompt_logprobs=prompt_logprobs_json(c.prompt_logprobs),
        prompt_token_ids=prompt.token_ids if request.return_token_ids else None,
    )


async def _beam_search_choices(serving: OpenAIServing, request: CompletionRequest, raw_request: Request,
                               engine_id: str, prompts: list[PromptInput], max_tokens: int) -> list[Choice]:
    """Beam search per prompt, its beam_width (= n) best beams as the prompt's choices."""
    search = BeamSearchRequest(beam_width=request.n, max_tokens=max_tokens, ignore_eos=request.ignore_eos,
                               length_penalty=request.length_penalty,
                               include_stop_str_in_output=request.include_stop_str_in_output,
                               skip_special_tokens=request.skip_special_tokens, cache_salt=request.cache_salt)
    try:
        results = await asyncio.gather(*(beam_search(serving, raw_request, f"{engine_id}-{i}", prompt, search)
                                         for i, prompt in enumerate(prompts)))
    except Exception as exc:  # the engine's verdict on a step request (queue full, dead engine)
        raise from_exception(exc) from exc
    choices = []
    for prompt_index, (prompt, outputs) in enumerate(zip(prompts, results)):
        for output in outputs:
            choice = Choice(prompt_index * request.n + output.index, prompt_index, f"{engine_id}-{prompt_index}",
                            None, sample_index=output.index)
            record(choice, RequestOutput(choice.request_id, prompt.text, prompt.token_ids, [output], True))
            choices.append(choice)
    return choices


async def _stream(
    serving: OpenAIServing,
    request: CompletionRequest,
    raw_request: Request,
    response_id: str,
    prompts: list[PromptInput],
    choices: list[Choice],
    num_top: int | None,
) -> AsyncIterator[str]:
    include_usage, continuous_usage = stream_usage(request)
    return_token_ids = bool(request.return_token_ids)
    created = int(time.time())

    def chunk(choice_payloads: list[dict], usage: dict | None = None, final: bool = False) -> str:
        payload = {"id": response_id, "object": "text_completion", "created": created, "model": serving.model_name,
                   "choices": choice_payloads}
        if usage is not None:
            payload["usage"] = usage
        if final:
            payload["kv"] = kv_info(choices).to_dict()
        return sse(payload)

    # Choices whose first chunk (with the echoed prompt, or the prompt's ids) is still to go out.
    first_pending = {c.index for c in choices} if request.echo or return_token_ids else set()
    # Where each choice's next token text starts, for logprobs' text_offset.
    text_offsets = {c.index: 0 for c in choices}
    try:
        async with abort_on_disconnect(raw_request, serving.engine, choices):
            async for choice, output in merge_outputs(serving.engine, choices):
                completion = output.outputs[0]
                choice.num_tokens += len(completion.token_ids)
                prompt = prompts[choice.prompt_index]
                text, token_ids, positions = completion.text, completion.token_ids, completion.logprobs or []
                first = choice.index in first_pending
                if first:
                    first_pending.discard(choice.index)
                if first and request.echo:
                    echo = "" if return_token_ids else await _echo_text(serving, prompt)
                    text, token_ids = echo + text, prompt.token_ids + token_ids
                    positions = (output.prompt_logprobs or [None] * len(prompt.token_ids)) + positions
                logprobs = None
                if num_top is not None and token_ids:
                    logprobs = completion_logprobs(token_ids, positions, num_top, text_offsets[choice.index],
                                                   serving.tokenizer, bool(request.return_tokens_as_token_ids))
                    text_offsets[choice.index] += sum(len(token) for token in logprobs.tokens)
                if not (text or logprobs or first or output.finished or (return_token_ids and completion.token_ids)):
                    continue  # held back (a partial character, or what may begin a stop string)
                payload = {"index": choice.index, "text": text,
                           "logprobs": logprobs.model_dump() if logprobs else None,
                           "finish_reason": completion.finish_reason if output.finished else None,
                           "stop_reason": completion.stop_reason if output.finished else None,
                           "prompt_token_ids": prompt.token_ids if first else None,
                           "token_ids": list(completion.token_ids) if return_token_ids else None}
                usage = None
                if continuous_usage:
                    usage = UsageInfo.of(len(prompt.token_ids), choice.num_tokens).counts()
                yield chunk([payload], usage)
        if include_usage:
            prompt_tokens = sum(len(p.token_ids) for p in prompts)
            yield chunk([], UsageInfo.of(prompt_tokens, sum(c.num_tokens for c in choices)).counts(), final=True)
    except Exception as exc:  # headers are out: the error travels in the stream
        yield sse(from_exception(exc).body())
    yield SSE_DONE


async def _echo_text(serving: OpenAIServing, prompt: PromptInput) -> str:
    return prompt.text if prompt.text is not None else await serving.decode(prompt.token_ids)
