"""The OpenAI-compatible routes (completions, chat, responses), plus tokenization, health, version, Prometheus
metrics, and vLLM's /ping, /load and /render endpoints."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import pagellm
from pagellm.entrypoints.openai import serving_render
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
)
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.serving import OpenAIServing
from pagellm.entrypoints.openai.serving_chat import create_chat_completion
from pagellm.entrypoints.openai.serving_completion import create_completion
from pagellm.entrypoints.openai.serving_responses import (
    ResponseStore,
    cancel_response,
    create_response,
    retrieve_response,
)

router = APIRouter()


def _serving(raw_request: Request) -> OpenAIServing:
    return raw_request.app.state.serving


@router.get("/v1/models")
async def list_models(raw_request: Request) -> JSONResponse:
    serving = _serving(raw_request)
    cards = [ModelCard(id=name, root=serving.config.model_root, max_model_len=serving.max_model_len)
             for name in serving.config.served_model_names]
    # LoRA adapters as vLLM lists them: their directory as root, the base model (or the one they name) as parent.
    cards += [ModelCard(id=name, root=lora.lora_path, max_model_len=serving.max_model_len,
                        parent=serving.loras.base_model_names.get(name) or serving.model_name)
              for name, lora in list(serving.loras.requests.items())]
    return JSONResponse(ModelList(data=cards).model_dump())


@router.post("/v1/completions")
async def completions(request: CompletionRequest, raw_request: Request) -> Response:
    return await create_completion(_serving(raw_request), request, raw_request)


@router.post("/v1/chat/completions")
async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await create_chat_completion(_serving(raw_request), request, raw_request)


@router.post("/v1/responses")
async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
    return await create_response(_serving(raw_request), _responses_store(raw_request), request, raw_request)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, raw_request: Request, stream: bool = False) -> JSONResponse:
    return retrieve_response(_responses_store(raw_request), response_id, stream)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, raw_request: Request) -> JSONResponse:
    return cancel_response(_responses_store(raw_request), response_id)


def _responses_store(raw_request: Request) -> ResponseStore:
    """The app's store of finished responses, made on first use with the server's bounds."""
    state = raw_request.app.state
    if getattr(state, "responses_store", None) is None:
        config = _serving(raw_request).config
        state.responses_store = ResponseStore(config.responses_store_max_entries, config.responses_store_max_bytes)
    return state.responses_store


@router.post("/v1/completions/render")
async def render_completion(request: CompletionRequest, raw_request: Request) -> JSONResponse:
    serving = _serving(raw_request)
    serving_render.check_enabled(serving)
    return JSONResponse(await serving_render.render_completion(serving, request))


@router.post("/v1/chat/completions/render")
async def render_chat(request: ChatCompletionRequest, raw_request: Request) -> JSONResponse:
    serving = _serving(raw_request)
    serving_render.check_enabled(serving)
    return JSONResponse(await serving_render.render_chat(serving, request))


@router.post("/v1/responses/render")
async def render_response(request: ResponsesRequest, raw_request: Request) -> JSONResponse:
    serving = _serving(raw_request)
    serving_render.check_enabled(serving)
    return JSONResponse(await serving_render.render_response(serving, _responses_store(raw_request), request))


@router.post("/tokenize")
async def tokenize(request: TokenizeRequest, raw_request: Request) -> JSONResponse:
    serving = _serving(raw_request)
    serving.check_model(request.model)
    if isinstance(request, TokenizeChatRequest):
        token_ids = (await serving.chat_prompt(request.messages, request.add_generation_prompt)).token_ids
    else:
        token_ids = await serving.encode(request.prompt, "prompt", request.add_special_tokens)
    return JSONResponse({"count": len(token_ids), "max_model_len": serving.max_model_len, "tokens": token_ids})


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
    serving = _serving(raw_request)
    serving.check_model(request.model)
    serving.check_token_ids("tokens", request.tokens)
    return JSONResponse({"prompt": await serving.decode(request.tokens)})


@router.get("/health")
async def health(raw_request: Request) -> Response:
    dead = _serving(raw_request).engine.dead_error
    if dead is not None:
        return OpenAIError(503, f"the engine cannot serve requests: {dead}", None, "engine_dead").response()
    return Response(status_code=200)


@router.get("/ping")
@router.post("/ping")
async def ping(raw_request: Request) -> Response:
    """SageMaker's health check, as vLLM answers it: the same as /health."""
    return await health(raw_request)


@router.get("/load")
async def load(raw_request: Request) -> JSONResponse:
    """vLLM's server load: generating requests in flight (0 unless --enable-server-load-tracking)."""
    return JSONResponse({"server_load": getattr(raw_request.app.state, "server_load_metrics", 0)})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": pagellm.__version__})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    return Response(generate_latest(raw_request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
