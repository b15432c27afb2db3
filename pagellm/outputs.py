"""What a request produces, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.kv_usage import KVUsage


@dataclass
class Logprob:
    """One token's log-probability at a position, its rank there (1 = most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob, for the chosen token and the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sequence; None for EOS or length.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # Set when processing this request inside an engine step raised: it finished with finish_reason
    # "error" and only it did (the other requests of that step went on).
    error: str | None = None
    # The request's KV memory so far (all its sequences): peak blocks, sharing, copies, prefix-cache
    # tokens, preemptions, waste. All zero for a request that ended before it held a block.
    kv: KVUsage | None = None
