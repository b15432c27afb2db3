"""The server's adapters: `--lora-modules` (name=path, or vLLM's JSON form), the names clients pass as `model`,
and vLLM's runtime `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`, which vLLM offers only when
VLLM_ALLOW_RUNTIME_LORA_UPDATING is set (pagellm reads that, or PAGELLM_ALLOW_RUNTIME_LORA_UPDATING).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import BaseModel

from pagellm.lora.request import LoRARequest

RUNTIME_UPDATING_VARIABLES = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "PAGELLM_ALLOW_RUNTIME_LORA_UPDATING")


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list | None) -> list[LoRAModulePath]:
    """vLLM's --lora-modules: each `name=path`, or a JSON object {"name", "path"[, "base_model_name"]}."""
    modules = []
    for value in values or []:
        if isinstance(value, LoRAModulePath):
            modules.append(value)
            continue
        text = str(value).strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"lora_modules entry {text!r:.120} is not valid JSON: {exc}") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                    not isinstance(spec.get("path"), str) or set(spec) - {"name", "path", "base_model_name"}:
                raise ValueError(f"lora_modules entry {text!r:.120} must be "
                                 '{"name": str, "path": str, "base_model_name": str (optional)}.')
            modules.append(LoRAModulePath(spec["name"], spec["path"], spec.get("base_model_name")))
            continue
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules entry {text!r:.120} must be name=path or a JSON object "
                             '{"name": ..., "path": ...}.')
        modules.append(LoRAModulePath(name, path))
    names = [m.name for m in modules]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"lora_modules names {repeated} more than once; give each adapter its own name.")
    return modules


class LoRARegistry:
    """Adapter name -> LoRARequest, each with an id of its own (never reused, so that a name loaded again
    with another directory never meets the old one's slot or cached prefix)."""

    def __init__(self, check: Callable[[LoRARequest], object], reserved_names: list[str]) -> None:
        self.check = check
        self.reserved_names = set(reserved_names)
        self.requests: dict[str, LoRARequest] = {}
        self.base_model_names: dict[str, str | None] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, module: LoRAModulePath) -> LoRARequest:
        """Reads and checks the adapter (a ValueError naming what is wrong) and registers its name."""
        if module.name in self.reserved_names:
            raise ValueError(f"the LoRA adapter name {module.name!r} is already the base model's name.")
        with self._lock:
            if module.name in self.requests:
                raise ValueError(f"The lora adapter '{module.name}' has already been loaded.")
            request = LoRARequest(module.name, next(self._ids), module.path)
        self.check(request)
        with self._lock:
            if module.name in self.requests:
                raise ValueError(f"The lora adapter '{module.name}' has already been loaded.")
            self.requests[module.name] = request
            self.base_model_names[module.name] = module.base_model_name
        return request

    def remove(self, name: str) -> None:
        with self._lock:
            self.requests.pop(name)
            self.base_model_names.pop(name, None)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.requests.get(name) if name is not None else None


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_UPDATING_VARIABLES)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = ""
    lora_int_id: int | None = None


router = APIRouter()


def _error(status: int, message: str, param: str) -> Response:
    from pagellm.entrypoints.openai.errors import OpenAIError

    return OpenAIError(status, message, param, "invalid_value" if status == 400 else "model_not_found").response()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    serving = raw_request.app.state.serving
    if not request.lora_name or not request.lora_path:
        return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    try:
        await serving.off_loop(serving.loras.add, LoRAModulePath(request.lora_name, request.lora_path))
    except ValueError as exc:
        return _error(400, str(exc), "lora_path")
    return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", status_code=200)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    loras: LoRARegistry = raw_request.app.state.serving.loras
    if not request.lora_name and request.lora_int_id is None:
        return _error(400, "either 'lora_name' and 'lora_int_id' needs to be provided.", "lora_name")
    name = request.lora_name or next((n for n, r in loras.requests.items() if r.lora_int_id == request.lora_int_id),
                                     "")
    if name not in loras.requests:
        return _error(404, f"The lora adapter '{name or request.lora_int_id}' cannot be found.", "lora_name")
    loras.remove(name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)


def install(app: FastAPI) -> None:
    """The runtime load/unload routes, where the environment allows them (as vLLM gates them)."""
    if runtime_updating_allowed():
        app.include_router(router)
