"""`use_beam_search` on the server, as vLLM's server runs it: each step asks the engine for one token of every live
beam with its 2 x beam_width most likely next tokens, keeps the beam_width best continuations by cumulative
log-probability, and sets aside the beams that end in EOS; at max_tokens the beam_width best of all, ranked by
cumulative log-probability / length ** length_penalty, are the choices.

Each step's beams are ordinary engine requests (one token each), so the engine goes on serving everyone else
in between, and the prefix cache holds the shared beginnings. The ranking is vLLM's online one (its length
counts the prompt's tokens too); the offline `LLM.beam_search` (engine/beam_search.py) follows transformers'."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.requests import Request

from pagellm.entrypoints.openai.serving import OpenAIServing, PromptInput
from pagellm.outputs import CompletionOutput, PositionLogprobs
from pagellm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class BeamSearchRequest:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The beams' steps share prefix-cache blocks only under this salt, as the request's would.
    cache_salt: str | None = None


@dataclass
class _Beam:
    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None


def _score(beam: _Beam, eos_token_ids: set[int], length_penalty: float) -> float:
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_token_ids else 0)
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


async def beam_search(serving: OpenAIServing, raw_request: Request, base_id: str, prompt: PromptInput,
                      request: BeamSearchRequest) -> list[CompletionOutput]:
    """The beam_width best completions of one prompt, best first."""
    eos_ids = set() if request.ignore_eos else set(serving.engine.engine.core.model_info.eos_token_ids)
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * request.beam_width, ignore_eos=True,
                                 output_kind=RequestOutputKind.FINAL_ONLY)
    num_prompt = len(prompt.token_ids)
    beams = [_Beam(list(prompt.token_ids))]
    completed: list[_Beam] = []
    for step in range(request.max_tokens):
        if await raw_request.is_disconnected():
            break
        positions = await asyncio.gather(*(
            _next_token_logprobs(serving, f"{base_id}-step{step}-beam{index}", beam.tokens, step_params,
                                 request.cache_salt)
            for index, beam in enumerate(beams)
        ))
        candidates: list[tuple[float, int, _Beam, PositionLogprobs]] = []
        for beam, position in zip(beams, positions):
            for token_id, logprob in position.items():
                cum_logprob = beam.cum_logprob + logprob.logprob
                if token_id in eos_ids:
                    tokens = beam.tokens + [token_id] if request.include_stop_str_in_output else beam.tokens
                    completed.append(_Beam(tokens, cum_logprob, beam.logprobs + [position], "stop", token_id))
                else:
                    candidates.append((cum_logprob, token_id, beam, position))
        candidates.sort(key=lambda candidate: -candidate[0])
        beams = [_Beam(parent.tokens + [token_id], cum_logprob, parent.logprobs + [position])
                 for cum_logprob, token_id, parent, position in candidates[: request.beam_width]]
        if not beams:
            break
    best = sorted(completed + beams, key=lambda b: _score(b, eos_ids, request.length_penalty), reverse=True)
    return [await _completion(serving, index, beam, num_prompt, eos_ids, request)
            for index, beam in enumerate(best[: request.beam_width])]


async def _next_token_logprobs(serving: OpenAIServing, request_id: str, tokens: list[int], params: SamplingParams,
                               cache_salt: str | None) -> PositionLogprobs:
    prompt = {"prompt_token_ids": tokens} if cache_salt is None else {"prompt_token_ids": tokens,
                                                                      "cache_salt": cache_salt}
    stream = serving.engine.add_request(request_id, prompt, params)
    output = None
    async for output in serving.engine.outputs(stream):
        pass
    completion = output.outputs[0]
    if completion.finish_reason == "error" or not completion.logprobs:
        raise RuntimeError(f"beam search: the engine request {request_id} ended without log-probabilities "
                           f"({completion.finish_reason}).")
    return completion.logprobs[0]


async def _completion(serving: OpenAIServing, index: int, beam: _Beam, num_prompt: int, eos_ids: set[int],
                request: BeamSearchRequest) -> CompletionOutput:
    generated = beam.tokens[num_prompt:]
    # An EOS kept by include_stop_str_in_output stays in the tokens, not in the text.
    text_tokens = generated[:-1] if generated and generated[-1] in eos_ids else generated
    text = await serving.off_loop(
        lambda: serving.tokenizer.decode(text_tokens, skip_special_tokens=request.skip_special_tokens))
    return CompletionOutput(index, text, generated, beam.cum_logprob, beam.logprobs[: len(generated)],
                            beam.finish_reason or "length", beam.stop_reason)
