"""Engine arguments under vLLM's module path: `from pagellm.engine.arg_utils import AsyncEngineArgs`."""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.config import ENGINE, SCHEDULER, ArgumentValueError, EngineArgs, arg, no_effect

# A bound on requests that wait for the engine, so that a burst is refused (429) instead of queueing
# without limit and answering every client minutes late.
DEFAULT_MAX_NUM_QUEUED_REQUESTS = 1024

__all__ = ["AsyncEngineArgs", "EngineArgs", "DEFAULT_MAX_NUM_QUEUED_REQUESTS"]


@dataclass
class AsyncEngineArgs(EngineArgs):
    """The offline engine's arguments, plus what only a serving engine needs (vLLM's enable_log_requests,
    pagellm's max_num_queued_requests)."""

    enable_log_requests: bool = no_effect(False, group=ENGINE)
    max_num_queued_requests: int = arg(DEFAULT_MAX_NUM_QUEUED_REQUESTS, group=SCHEDULER, vllm=False,
                                       help="requests that may wait for one of the max_num_seqs slots before new "
                                            f"ones get HTTP 429 (default: {DEFAULT_MAX_NUM_QUEUED_REQUESTS})")

    def validate(self) -> None:
        super().validate()
        value = self.max_num_queued_requests
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentValueError(
                f"max_num_queued_requests={value!r} is out of range; allowed: an int >= 1 (how many requests "
                "may wait for the engine before new ones are refused)."
            )
