"""pagellm: LLM inference and serving on a paged KV cache, with vLLM's API.

The public names load on first use (PEP 562), so that `import pagellm.core` or `pagellm.config`, which
need no torch, do not pay for it: `from pagellm import LLM, SamplingParams` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagellm.cpu_threads import configure_at_import
from pagellm.logger import configure_logging

# Before anything imports torch: libgomp reads its wait policy once, when torch loads it.
configure_at_import()
configure_logging()

# Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "pagellm.entrypoints.llm",
    "SamplingParams": "pagellm.sampling_params",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "EngineArgs": "pagellm.config",
    "AsyncEngineArgs": "pagellm.engine.arg_utils",
    "AsyncLLMEngine": "pagellm.engine.async_llm_engine",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagellm.config import EngineArgs
    from pagellm.engine.arg_utils import AsyncEngineArgs
    from pagellm.engine.async_llm_engine import AsyncLLMEngine
    from pagellm.entrypoints.llm import LLM
    from pagellm.outputs import CompletionOutput, RequestOutput
    from pagellm.sampling_params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
