"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

Every failure a client can cause or meet maps to one status; the server itself goes on serving.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm.engine.async_llm_engine import EngineDeadError, EngineStepError, QueueFullError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param, code)


def not_supported(param: str, value: object) -> OpenAIError:
    return bad_request(
        f"{param}={value!r} is not supported yet by this server; omit {param}.",
        param, "unsupported_parameter",
    )


# SamplingParams and the engine start their messages with "name=value" or "name contains ...".
_NAMED_VALUE = re.compile(r"^(\w+)(?:=| contains )")


def from_exception(exc: BaseException) -> OpenAIError:
    """The OpenAI error for an exception raised while serving a request."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, str(exc), None, "queue_full", {"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"the engine cannot serve requests: {exc}", None, "engine_dead")
    if isinstance(exc, EngineStepError):
        return OpenAIError(500, str(exc), None, "engine_step_failed")
    if isinstance(exc, ValueError):
        match = _NAMED_VALUE.match(str(exc))
        return bad_request(str(exc), match.group(1) if match else None)
    logger.exception("Unexpected error while serving a request", exc_info=exc)
    return OpenAIError(500, f"internal server error: {exc!r}", None, "internal_error")


_SCALAR_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _is_union_tag(part: object) -> bool:
    """pydantic names each member of a union in an error's location ('list[int]', 'str', 'TextContentPart');
    clients know fields, not union members."""
    if not isinstance(part, str):
        return False
    return "[" in part or part in _SCALAR_TAGS or part[:1].isupper() or part.startswith("function-")


def _field_path(location: tuple) -> tuple[str | None, list[str]]:
    """('body', 'prompt', 'list[int]') -> ('prompt', ['list[int]']); a body that is one of several models
    (/tokenize) names the model first: ('body', 'TokenizeChatRequest', 'messages') -> ('messages', [])."""
    parts, tags = [], []
    for part in location:
        if part == "body" and not parts:
            continue
        if _is_union_tag(part):
            if not parts:
                continue
            tags.append(str(part))
            break
        parts.append(str(part))
    return ".".join(parts) or None, tags


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    error = errors[0]
    if error.get("type") == "json_invalid":
        detail = error.get("ctx", {}).get("error", "")
        return bad_request(f"the request body is not valid JSON ({detail}); send a JSON object.", None, "json_invalid")
    param, _ = _field_path(error.get("loc", ()))
    shown = json.dumps(error.get("input"), default=str)[:80]
    if error.get("type") == "extra_forbidden":
        return bad_request(f"unknown field {param!r}; remove it (see the API reference for the fields allowed).",
                           param, "unknown_field")
    if error.get("type") == "missing":
        return bad_request(f"{param} is required.", param, "missing_field")
    union_tags = []
    for other in errors:
        other_param, tags = _field_path(other.get("loc", ()))
        if other_param == param:
            union_tags += [t for t in tags if t not in union_tags]
    if len(union_tags) > 1:
        return bad_request(f"{param}: got {shown}, which is none of the allowed forms: {', '.join(union_tags)}.",
                           param, "invalid_type")
    return bad_request(f"{param or 'body'}: {error.get('msg')} (got {shown}).", param, error.get("type"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = ""
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return OpenAIError(exc.status_code, message, None, phrase.lower().replace(" ", "_") or None).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()
