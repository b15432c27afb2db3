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
class CompletionProgress:
    """One completion's text, tokens and logprobs so far, and how much of them earlier DELTA outputs carried:
    the state both the output processor (engine side) and the async engine's stream (consumer side) keep."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text_len: int = 0
    sent_tokens: int = 0
    # Whether it moved since the last output taken.
    changed: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take(self, delta: bool, visible_text_len: int | None = None) -> CompletionOutput:
        """The output to hand out now: what is new since the last one (delta) or all of it, up to
        `visible_text_len` characters of text (all of it by default)."""
        visible = len(self.text) if visible_text_len is None else visible_text_len
        if delta:
            text, token_ids = self.text[self.sent_text_len : visible], self.token_ids[self.sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self.sent_tokens :]
        else:
            text, token_ids = self.text[:visible], list(self.token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        self.sent_text_len, self.sent_tokens = visible, len(self.token_ids)
        self.changed = False
        return CompletionOutput(self.index, text, token_ids, self.cumulative_logprob, logprobs, self.finish_reason,
                                self.stop_reason)


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
