"""POST /generate: the simple route of the seed's FastAPI example, with a JSON body.

`{"prompt": str, "stream": bool, ...SamplingParams fields}` -> `{"text": str, "finish_reason": str}`; with
`"stream": true`, one JSON object per line, each carrying the text added since the previous line.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import fields

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from pagellm.entrypoints.openai.errors import bad_request, from_exception
from pagellm.entrypoints.openai.serving import (
    Choice,
    OpenAIServing,
    abort_on_disconnect,
    build_sampling_params,
    merge_outputs,
)
from pagellm.entrypoints.openai.structured import compiled_grammar
from pagellm.sampling_params import RequestOutputKind, SamplingParams

router = APIRouter()

# What a client may set: output_kind follows from "stream", and the fields SamplingParams keeps out of its
# repr are the ones the engine fills in.
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams) if f.repr) - {"output_kind"}
# Fields whose results a reply of one text cannot carry.
NOT_RETURNED = ("best_of", "logprobs", "prompt_logprobs")


@router.post("/generate")
async def generate(raw_request: Request) -> Response:
    serving: OpenAIServing = raw_request.app.state.serving
    try:
        body = await raw_request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc}); send a JSON object.", None, "json_invalid")
    except RecursionError:  # json's parser recurses once per level of nesting
        raise bad_request("the request body is nested too deeply to parse; send a JSON object of plain fields.",
                          None, "json_invalid") from None
    except ClientDisconnect:
        # Gone before its whole body arrived (or cut by --body-read-timeout): no one reads this answer, and it
        # is no server error to log.
        raise bad_request("the client disconnected before the whole request body arrived.", None,
                          "client_disconnected") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}.")
    prompt = body.pop("prompt", None)
    stream = body.pop("stream", False)
    if not isinstance(prompt, str):
        raise bad_request(f"prompt={prompt!r:.80} must be a string.", "prompt")
    if not isinstance(stream, bool):
        raise bad_request(f"stream={stream!r:.80} must be true or false.", "stream")
    unknown = sorted(set(body) - SAMPLING_FIELDS)
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}; allowed: prompt, stream, {', '.join(sorted(SAMPLING_FIELDS))}.",
                          unknown[0], "unknown_field")
    if body.get("n", 1) != 1:
        raise bad_request(f"n={body['n']!r}: /generate returns one text; for several, use /v1/completions with n.", "n")
    # From here on the fields are SamplingParams' own, checked (types included) by SamplingParams itself,
    # as the offline API checks them.
    for name in NOT_RETURNED:
        if body.get(name) is not None:
            raise bad_request(f"{name}={body[name]!r}: /generate returns only text; use /v1/completions for {name}.",
                              name, "unsupported_parameter")
    if "logit_bias" in body:
        body["logit_bias"] = serving.logit_bias(body["logit_bias"])
    output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    params = build_sampling_params({**body, "output_kind": output_kind})
    params.structured_grammar = await compiled_grammar(serving.engine, params.structured_outputs)
    for name in ("stop_token_ids", "allowed_token_ids"):
        if getattr(params, name):
            serving.check_token_ids(name, getattr(params, name))
    (prompt_input,) = await serving.completion_prompts(prompt)
    serving.check_length(prompt_input, params.max_tokens, "prompt")
    choices = serving.submit(f"generate-{uuid.uuid4().hex}", [prompt_input], params)
    if stream:
        return StreamingResponse(_stream(serving, raw_request, choices), media_type="application/x-ndjson")
    await serving.run_to_completion(raw_request, choices)
    (choice,) = choices
    return JSONResponse({"text": choice.text, "finish_reason": choice.finish_reason})


async def _stream(serving: OpenAIServing, raw_request: Request, choices: list[Choice]) -> AsyncIterator[str]:
    try:
        async with abort_on_disconnect(raw_request, serving.engine, choices):
            async for _, output in merge_outputs(serving.engine, choices):
                completion = output.outputs[0]
                if completion.text or output.finished:
                    line = {"text": completion.text, "finish_reason": completion.finish_reason if output.finished else None}
                    yield json.dumps(line, ensure_ascii=False) + "\n"
    except Exception as exc:  # headers are out: the error travels in the stream
        yield json.dumps(from_exception(exc).body()) + "\n"
