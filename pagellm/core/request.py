"""A request as the scheduler sees it: token ids, progress, and a small status state machine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagellm.core.kv_usage import KVAccount
from pagellm.lora.request import LoRARequest
from pagellm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is a final state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Processing this request's step results raised; it alone was ended (see Scheduler.update_from_output).
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence. `num_computed_tokens` catches up with `num_tokens`; the gap is what a step computes."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int
    # The most tokens this request may produce: max_tokens, or what max_model_len leaves after the prompt.
    max_output_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prompt tokens served from the prefix cache when the request was first admitted.
    num_cached_tokens: int | None = None
    # The user's request id; a request with n > 1 runs as n sequences that share it.
    group_id: str = ""
    # This sequence's completion index within its group, and when it was forked (orders the group).
    sample_index: int = 0
    fork_order: int = 0
    # Sequences still to fork off at the first sample (n > 1 / best_of): they share the prompt's blocks.
    num_pending_forks: int = 0
    # False for beam-search candidates: each step reports log-probabilities and the caller picks the
    # next tokens (and forks) instead of the sampler.
    appends_sampled_tokens: bool = True
    cumulative_logprob: float = 0.0
    # Prompt tokens whose log-probabilities were reported (tokens 1..this); a request recomputed after
    # preemption scores its prompt again, and those repeats are not reported twice.
    num_prompt_logprobs_reported: int = 0
    # The KV memory the user request's sequences hold and held (one account per group, set when added).
    kv_account: KVAccount | None = None
    # Lower runs first under the "priority" scheduling policy (vLLM's convention); 0 under "fcfs".
    priority: int = 0
    # Mixed into the prefix cache's keys: requests with different salts never share cached blocks.
    cache_salt: str | None = None
    # Seats of max_num_seqs the user request holds while it runs, however many of its sequences are live
    # at the moment: a beam search holds its width (its beams fork and end at the caller's word).
    reserved_seats: int = 1
    # The LoRA adapter it runs with (None: the base model), and its device slot while it runs (-1: none).
    lora_request: LoRARequest | None = None
    lora_slot: int = -1

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def order_key(self) -> tuple[int, int, int]:
        """Served in this order, preempted in the reverse: by priority, then arrival, then fork."""
        return self.priority, self.arrival_index, self.fork_order

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def grammar_ready(self) -> bool:
        """False while the structured-output grammar compiles in the background (a Future not yet done)."""
        grammar = self.sampling_params.structured_grammar
        return grammar is None or grammar.done()

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """The final status the last appended token puts this request in, if any."""
        last = self.all_token_ids[-1]
        if self.num_output_tokens >= self.sampling_params.min_tokens and last in self.stop_token_ids:
            self.stop_reason = last if last in self.sampling_params.stop_token_ids else None
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
