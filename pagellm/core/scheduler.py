"""Continuous batching under one token budget per step, with preemption by recomputation."""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagellm.core.kv_cache_manager import KVCacheManager, KVCacheStats
from pagellm.core.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    # Without chunking a prompt must fit one step's budget whole; requests resumed after preemption
    # are always allowed to chunk, or one that grew past the budget could never run again.
    enable_chunked_prefill: bool = True


@dataclass
class NewRequestData:
    """A request the model runner has not seen since it was admitted (or re-admitted after preemption)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    # Tokens whose K/V is already in the blocks (prefix-cache hits); computing starts after them.
    num_computed_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    # Requests the runner must forget: finished, aborted or preempted since the last step.
    finished_request_ids: set[str]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    """One sampled token per request whose scheduled tokens reached the end of its sequence."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache: KVCacheStats


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        # Both kept in arrival order: the oldest request is served first and preempted last,
        # so it always makes progress and nothing waits forever.
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._preempted_this_step = False
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use; request ids must be unique")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the core (abort, or a stop string found in the text)."""
        assert status.is_finished
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions, self.kv.stats())

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached: list[CachedRequestData] = []
        new: list[NewRequestData] = []
        self._preempted_this_step = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_block_ids = self._allocate_or_preempt(request, num_new)
            if new_block_ids is None:
                break  # the request preempted itself, and everything after it went first
            num_scheduled[request.request_id] = num_new
            cached.append(CachedRequestData(request.request_id, new_block_ids))
            budget -= num_new
            index += 1

        # Admitting while preempting would just take back the blocks the preemption freed.
        while (
            not self._preempted_this_step
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            prefix = self.kv.find_cached_prefix(request.all_token_ids)
            num_new = request.num_tokens - prefix.num_tokens
            if num_new > budget:
                may_chunk = self.config.enable_chunked_prefill or request.num_preemptions > 0
                if not may_chunk:
                    break
                num_new = budget
            new_block_ids = self.kv.allocate_slots(request.request_id, prefix.num_tokens + num_new, prefix)
            if new_block_ids is None:
                break
            self.waiting.popleft()
            self.kv.record_prefix_query(request.num_tokens, prefix.num_tokens)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = prefix.num_tokens
            request.num_computed_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival_index)
            num_scheduled[request.request_id] = num_new
            new.append(
                NewRequestData(
                    request.request_id,
                    list(request.all_token_ids),
                    request.num_prompt_tokens,
                    request.num_computed_tokens,
                    self.kv.block_ids(request.request_id),
                    request.sampling_params,
                )
            )
            budget -= num_new

        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        return SchedulerOutput(new, cached, num_scheduled, finished)

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[int] | None:
        """Slots for `num_new` more tokens of a running request, preempting the newest running ones
        until they fit. None when the request itself had to be preempted."""
        while True:
            block_ids = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new)
            if block_ids is not None:
                return block_ids
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_this_step = True
        self._finished_since_last_step.add(request.request_id)
        # Victims are taken newest first, so putting each at the front keeps the queue in arrival order.
        self.waiting.appendleft(request)
        log = logger.warning if self.num_preemptions == 1 or self.num_preemptions % 100 == 0 else logger.debug
        log(
            "Preempted request %s (%d tokens) because the KV cache is full; it will be recomputed. "
            "Preemptions so far: %d. More KV memory (gpu_memory_utilization / kv_cache_memory_bytes) "
            "or a lower max_num_seqs avoids this.",
            request.request_id, request.num_tokens, self.num_preemptions,
        )

    # ---- after the forward pass ------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        sampled = runner_output.sampled_token_ids
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_tokens
            self.kv.publish_full_blocks(request_id, request.all_token_ids, request.num_computed_tokens)
            token_id = sampled.get(request_id)
            if token_id is None:
                if request.num_computed_tokens >= request.num_tokens:
                    raise RuntimeError(f"request {request_id} reached the end of its sequence but got no token")
                continue  # a prefill chunk that did not reach the end of the sequence
            request.append_token(token_id)
            status = request.check_stop()
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    [token_id],
                    status.finish_reason if status else None,
                    request.stop_reason,
                    request.num_cached_tokens or 0,
                )
            )
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)
