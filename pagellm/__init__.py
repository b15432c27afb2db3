"""pagellm: LLM inference and serving on a paged KV cache, with vLLM's API."""

from pagellm.config import EngineArgs
from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.engine.async_llm_engine import AsyncLLMEngine
from pagellm.entrypoints.llm import LLM
from pagellm.logger import configure_logging
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

configure_logging()

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "AsyncEngineArgs",
           "AsyncLLMEngine"]
__version__ = "0.1.0"
