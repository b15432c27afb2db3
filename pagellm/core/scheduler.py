"""Continuous batching under one token budget per step, with preemption by recomputation."""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagellm.core.kv_cache_manager import (
    NO_CACHED_PREFIX,
    CachedPrefix,
    KVCacheManager,
    KVCacheStats,
    cdiv,
    max_blocks_per_sequence,
)
from pagellm.core.kv_usage import KVAccount
from pagellm.core.request import Request, RequestStatus
from pagellm.lora.request import LoRARequest
from pagellm.lora.slot_table import LoRASlotTable
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.speculator import SpecDecodingStats, Speculator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    # Without chunking a prompt must fit one step's budget whole; requests resumed after preemption
    # are always allowed to chunk, or one that grew past the budget could never run again.
    enable_chunked_prefill: bool = True
    # Rows of a step from which the model's products switch kernels, and a row's last bits with them
    # (ModelRunner.kernel_switch_rows; None: never). A verifying step stays below it, so that its rows are
    # computed as the plain decode steps without speculation compute them, whichever speculator runs.
    kernel_switch_rows: int | None = None


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
    # The sequence's completion index (seeded sampling offsets the seed by it, as vLLM does).
    sample_index: int = 0
    # Sequences to sample at once at the first sample (n > 1 / best_of), forked afterwards.
    num_samples_at_first: int = 1
    appends_sampled_tokens: bool = True
    # The device slot of its LoRA adapter (-1: the base model).
    lora_slot: int = -1


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]
    # Copy-on-write replaced these (table index, block id) entries of the request's table.
    replaced_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Tokens appended from outside the sampler (beam search's choices).
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    # Requests the runner must forget: finished, aborted or preempted since the last step.
    finished_request_ids: set[str]
    # (source, destination) blocks the runner copies before the forward: copy-on-write of shared blocks.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: draft tokens to verify after each listed request's next token (counted in
    # num_scheduled_tokens; pagellm/spec_decode).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # (slot, adapter) the runner loads before the forward: adapters of requests admitted this step.
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: of the chosen token, and of the most likely ones."""

    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    """One sampled token per request whose scheduled tokens reached the end of its sequence."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Samples 1..k-1 of a request that samples k sequences at its first token (forked afterwards).
    forked_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request that asked for them, aligned with [sampled token, *forked tokens].
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Per request with prompt_logprobs: one entry per prompt position computed this step (from 1 on).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests whose structured-output grammar allows no further token, with why: they stop unsampled.
    structured_stops: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: the tokens a request took after its sampled one (accepted drafts, then the
    # target's correction or bonus token); logprobs, when asked for, cover them too.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    group_id: str = ""
    sample_index: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    # Why the request failed, when finish_reason is "error".
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _StepBuilder:
    """What one schedule() call has handed out so far, and the token budget it has left."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    cached: list[CachedRequestData] = field(default_factory=list)
    new: list[NewRequestData] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request_id: str, num_tokens: int) -> None:
        self.num_scheduled[request_id] = num_tokens
        self.budget -= num_tokens


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache: KVCacheStats
    spec_decoding: SpecDecodingStats | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 *, speculator: Speculator | None = None, lora_slots: LoRASlotTable | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.speculator = speculator
        # With LoRA enabled: which adapter each device slot holds, and the requests using it.
        self.lora_slots = lora_slots
        self.requests: dict[str, Request] = {}
        # Both kept in arrival order: the oldest request is served first and preempted last,
        # so it always makes progress and nothing waits forever.
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._preempted_this_step = False
        self.num_preemptions = 0
        # Live sequences of each user request (n > 1 and beam search run several).
        self.groups: dict[str, set[str]] = {}
        # Seats of max_num_seqs each user request holds while it runs (Request.reserved_seats).
        self._reserved_seats: dict[str, int] = {}
        # Running sequences the runner has not been sent yet (forked since the last step).
        self._unseen_by_runner: set[str] = set()
        # Tokens appended from outside the sampler that the runner has not been sent yet.
        self._appended: dict[str, list[int]] = {}
        self._fork_counter = 0

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.group_id in self.groups:
            raise ValueError(f"request_id={request.request_id!r} is already in use; request ids must be unique")
        self.check_fits(request.num_tokens, max(request.reserved_seats, 1 + request.num_pending_forks))
        self.requests[request.request_id] = request
        self.groups[request.group_id] = {request.request_id}
        self._reserved_seats[request.group_id] = request.reserved_seats
        if request.kv_account is None:
            request.kv_account = KVAccount(self.kv.block_size, request.group_id)
        self._enqueue(request)

    def check_fits(self, num_prompt_tokens: int, num_sequences: int) -> None:
        """A ValueError unless a request of this many sequences could ever run: all of them at once under
        max_num_seqs, and in the pool with the prompt's blocks shared and one block of its own each."""
        max_num_seqs = self.config.max_num_seqs
        if num_sequences > max_num_seqs:
            raise ValueError(
                f"the request runs {num_sequences} sequences at once (n, best_of or beam width), more than "
                f"max_num_seqs={max_num_seqs}; ask for at most {max_num_seqs}, or raise max_num_seqs."
            )
        block_size, num_blocks = self.kv.block_size, self.kv.pool.num_blocks
        # The prompt's blocks plus the first sample's slot (a sliding window holds fewer at once), then a
        # block for each other sequence's first token.
        first = max_blocks_per_sequence(num_prompt_tokens + 1, block_size, self.kv.sliding_window,
                                        self.config.max_num_batched_tokens)
        needed = first + num_sequences - 1
        if needed > num_blocks:
            raise ValueError(
                f"the request's {num_sequences} sequences need at least {needed} KV blocks to take one step "
                f"({num_prompt_tokens} prompt tokens shared, then a block each), more than the pool's {num_blocks}; "
                "ask for fewer sequences (n, best_of, beam width), shorten the prompt, or give the KV cache more "
                "memory."
            )

    def _enqueue(self, request: Request) -> None:
        """Into the waiting queue in order_key order (arrivals usually go last, the preempted near the front)."""
        if not self.waiting or self.waiting[-1].order_key <= request.order_key:
            self.waiting.append(request)
        else:
            bisect.insort(self.waiting, request, key=lambda r: r.order_key)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus, whole_groups: bool = False) -> None:
        """End sequences from outside the core (abort, or a stop string found in the text). With
        `whole_groups`, an id names a user request and ends all of its sequences."""
        assert status.is_finished
        for request_id in list(request_ids):
            members = self.groups.get(request_id, {request_id}) if whole_groups else {request_id}
            for member in sorted(members):
                request = self.requests.get(member)
                if request is not None:
                    self._dequeue_and_finish(request, status)

    def _dequeue_and_finish(self, request: Request, status: RequestStatus) -> None:
        # Looked up rather than inferred from the status: a request that failed part-way through its
        # update may have left the running list already.
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, status)

    def fork_request(self, parent_id: str, child_id: str, sample_index: int = 0) -> Request:
        """A new sequence with the parent's tokens, progress and blocks (shared, copy-on-write)."""
        parent = self.requests[parent_id]
        if child_id in self.requests:
            raise ValueError(f"request_id={child_id!r} is already in use")
        child = Request(
            child_id, parent.prompt_token_ids, parent.sampling_params, parent.arrival_index,
            parent.max_output_tokens, parent.stop_token_ids,
        )
        child.all_token_ids = list(parent.all_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.group_id = parent.group_id
        child.sample_index = sample_index
        child.appends_sampled_tokens = parent.appends_sampled_tokens
        child.cumulative_logprob = parent.cumulative_logprob
        child.kv_account = parent.kv_account
        child.priority = parent.priority
        child.cache_salt = parent.cache_salt
        child.lora_request = parent.lora_request
        # The prompt's scores belong to the parent: a child recomputed after preemption reports none.
        child.num_prompt_logprobs_reported = parent.num_prompt_tokens - 1
        self._fork_counter += 1
        child.fork_order = self._fork_counter
        child.status = parent.status
        self.requests[child_id] = child
        self.groups[parent.group_id].add(child_id)
        if parent.status == RequestStatus.RUNNING:
            self.kv.fork(parent_id, child_id)
            self._acquire_lora(child)
            bisect.insort(self.running, child, key=lambda r: r.order_key)
            self._unseen_by_runner.add(child_id)
        else:
            # Without blocks it waits like its parent does, right behind it, and is recomputed.
            child.num_computed_tokens = 0
            self.waiting.insert(self.waiting.index(parent) + 1, child)
        return child

    def append_token(self, request_id: str, token_id: int) -> None:
        """Extend a sequence with a token chosen outside the sampler (beam search)."""
        request = self.requests[request_id]
        request.append_token(token_id)
        if request.status == RequestStatus.RUNNING and request_id not in self._unseen_by_runner:
            self._appended.setdefault(request_id, []).append(token_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions, self.kv.stats(),
                              self.speculator.stats if self.speculator is not None else None)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _StepBuilder(self.config.max_num_batched_tokens)
        self._preempted_this_step = False
        # A prompt that needs a step of its own is admitted first; if it cannot be admitted after all,
        # the running requests take the step as usual, so that no step schedules nothing while
        # something could run.
        if not (self._prefill_needs_own_step(step.budget) and self._admit_waiting(step)):
            self._schedule_running(step)
            self._admit_waiting(step)
        if not step.num_scheduled and self.waiting:
            self._admit_by_preempting_idle(step)
        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        loads = self.lora_slots.take_loads() if self.lora_slots is not None else []
        return SchedulerOutput(step.new, step.cached, step.num_scheduled, finished, self.kv.take_block_copies(),
                               spec_token_ids=step.spec_token_ids, lora_loads=loads)

    def _schedule_running(self, step: _StepBuilder) -> None:
        index = 0
        speculating = self.speculator is not None and self.speculator.active_for_batch(len(self.running))
        switch = self.config.kernel_switch_rows
        # Draft tokens this step may verify in all.
        draft_rows = step.budget if switch is None else max(switch - 1 - len(self.running), 0)
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, step.budget)
            if num_new == 0:
                index += 1  # a beam candidate waiting for the caller to choose its next token
                continue
            drafts = self.speculator.drafts_for(request, min(step.budget - 1, draft_rows),
                                                self.config.max_model_len, len(self.running)) \
                if speculating and request.num_computed_tokens == request.num_tokens - 1 else []
            # Drafts take only free blocks: speculation never preempts anyone.
            new_block_ids = self.kv.allocate_slots(request.request_id, request.num_tokens + len(drafts)) \
                if drafts else None
            if new_block_ids is not None:
                step.spec_token_ids[request.request_id] = drafts
                num_new += len(drafts)
                draft_rows -= len(drafts)
            else:
                new_block_ids = self._allocate_or_preempt(request, num_new)
            if new_block_ids is None:
                break  # the request preempted itself, and everything after it went first
            if request.request_id in self._unseen_by_runner:
                self._unseen_by_runner.discard(request.request_id)
                self.kv.take_replaced_blocks(request.request_id)
                step.new.append(self._new_request_data(request))
            else:
                step.cached.append(
                    CachedRequestData(
                        request.request_id,
                        new_block_ids,
                        self.kv.take_replaced_blocks(request.request_id),
                        self._appended.pop(request.request_id, []),
                    )
                )
            step.add(request.request_id, num_new)
            index += 1

    def _admit_waiting(self, step: _StepBuilder) -> bool:
        """Admits waiting requests in arrival order while budget, seats and blocks last; True if any was."""
        admitted = False
        # Admitting while preempting would just take back the blocks the preemption freed.
        while (
            not self._preempted_this_step
            and self.waiting
            and step.budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self._next_admissible()
            if request is None:
                break  # every waiting request still waits for its grammar to compile
            if not self._has_seats_for(request):
                break  # its n sequences would not fit under max_num_seqs once forked
            # Prompt log-probabilities need logits at every prompt position, so nothing may be skipped.
            wants_prompt_scores = request.sampling_params.prompt_logprobs is not None
            prefix = (NO_CACHED_PREFIX if wants_prompt_scores
                      else self.kv.find_cached_prefix(request.all_token_ids, request.cache_salt, request.lora_int_id))
            num_new = request.num_tokens - prefix.num_tokens
            if num_new > step.budget:
                may_chunk = self.config.enable_chunked_prefill or request.num_preemptions > 0
                if not may_chunk:
                    break
                num_new = step.budget
            if not self._has_blocks_for_forks(request, prefix, num_new):
                break
            new_block_ids = self.kv.allocate_slots(request.request_id, prefix.num_tokens + num_new, prefix,
                                                   request.kv_account)
            if new_block_ids is None:
                break
            self.waiting.remove(request)
            self._acquire_lora(request)
            self.kv.record_prefix_query(request.num_tokens, prefix.num_tokens)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = prefix.num_tokens
                request.kv_account.cached_tokens = prefix.num_tokens
            request.num_computed_tokens = prefix.num_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.order_key)
            step.new.append(self._new_request_data(request))
            step.add(request.request_id, num_new)
            admitted = True
        return admitted

    def _admit_by_preempting_idle(self, step: _StepBuilder) -> None:
        """Nothing could be scheduled: every running sequence waits for the caller (beam candidates that
        reported their next token while a sibling was preempted), and they hold the blocks or seats the
        waiting head needs. They are preempted, newest first, until the head is admitted. Each goes to the
        back of the queue, behind its siblings that have not reported yet: it has nothing to compute
        before the caller extends it, and at the front it would be readmitted ahead of them forever."""
        while not step.num_scheduled and self.waiting:
            idle = [r for r in self.running if r.num_computed_tokens == r.num_tokens]
            if not idle:
                return
            victim = idle[-1]
            self.running.remove(victim)
            self._preempt(victim)
            self.waiting.remove(victim)
            self.waiting.append(victim)
            self._preempted_this_step = False  # the blocks were freed for the head, not for a running request
            self._admit_waiting(step)

    def _has_seats_for(self, request: Request) -> bool:
        """Whether the request's user request, with all of its sequences (its n samples once forked, its beam
        width), fits under max_num_seqs beside the seats the running user requests hold."""
        groups = {r.group_id for r in self.running}
        groups.discard(request.group_id)
        held = sum(self._seats_of(group_id) for group_id in groups)
        return held + self._seats_of(request.group_id) <= self.config.max_num_seqs

    def _seats_of(self, group_id: str) -> int:
        """Its live sequences and the samples still to fork, or its reservation if that is more."""
        members = self.groups[group_id]
        live = len(members) + sum(self.requests[m].num_pending_forks for m in members)
        return max(live, self._reserved_seats[group_id])

    def _has_blocks_for_forks(self, request: Request, prefix: CachedPrefix, num_new: int) -> bool:
        """A request that forks at its first sample is admitted only with a block free for each fork's first
        token: admitted without, its forks would preempt the requests behind it (or one another) at once."""
        if not request.num_pending_forks:
            return True
        new_blocks = cdiv(prefix.num_tokens + num_new, self.kv.block_size) - len(prefix.blocks)
        return new_blocks + request.num_pending_forks <= self.kv.pool.num_free_blocks

    def _next_admissible(self) -> Request | None:
        """The oldest waiting request that can run: one whose structured-output grammar is still compiling
        (off the engine thread) is passed over, so it delays no one behind it."""
        for request in self.waiting:
            if request.grammar_ready and (self.lora_slots is None or self.lora_slots.can_admit(request.lora_request)):
                return request
        return None

    def _acquire_lora(self, request: Request) -> None:
        if self.lora_slots is not None:
            request.lora_slot = self.lora_slots.acquire(request.request_id, request.lora_request)

    def _release_lora(self, request: Request) -> None:
        if self.lora_slots is not None:
            self.lora_slots.release(request.request_id, request.lora_slot)
        request.lora_slot = -1

    def grammar_futures_pending(self) -> list:
        """Compile futures of waiting requests that cannot run until their grammar is ready."""
        return [r.sampling_params.structured_grammar for r in self.waiting if not r.grammar_ready]

    def _prefill_needs_own_step(self, budget: int) -> bool:
        """Without chunking, a prompt that fits only a step's whole budget would wait behind the running
        decodes for as long as any of them runs; such a prompt gets a step of its own (decodes pause
        for that one step), as a prefill-first scheduler would give it."""
        if self.config.enable_chunked_prefill or not self.waiting or not self.running:
            return False
        head = self.waiting[0]
        need = head.num_tokens - head.num_computed_tokens
        decodes = sum(r.num_tokens - r.num_computed_tokens for r in self.running)
        if need > budget or need + decodes <= budget or head.num_preemptions or not self._has_seats_for(head):
            return False
        return self.kv.num_blocks_needed(head.request_id, need) <= self.kv.pool.num_free_blocks

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request.request_id,
            list(request.all_token_ids),
            request.num_prompt_tokens,
            request.num_computed_tokens,
            self.kv.block_ids(request.request_id),
            request.sampling_params,
            request.sample_index,
            1 + request.num_pending_forks,
            request.appends_sampled_tokens,
            request.lora_slot,
        )

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
        self._release_lora(request)
        self._unseen_by_runner.discard(request.request_id)
        self._appended.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.kv_account.preemptions += 1
        self.num_preemptions += 1
        self._preempted_this_step = True
        self._finished_since_last_step.add(request.request_id)
        self._enqueue(request)
        log = logger.warning if self.num_preemptions == 1 or self.num_preemptions % 100 == 0 else logger.debug
        log(
            "Preempted request %s (%d tokens) because the KV cache is full; it will be recomputed. "
            "Preemptions so far: %d. More KV memory (gpu_memory_utilization / kv_cache_memory_bytes) "
            "or a lower max_num_seqs avoids this.",
            request.request_id, request.num_tokens, self.num_preemptions,
        )

    # ---- after the forward pass ------------------------------------------------------------

    def record_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """The step's forward took `seconds`: what speculation weighs its drafts' cost by."""
        if self.speculator is None or scheduler_output.is_empty:
            return
        scheduled = scheduler_output.num_scheduled_tokens
        num_tokens = sum(scheduled.values())
        num_drafts = sum(len(drafts) for drafts in scheduler_output.spec_token_ids.values())
        self.speculator.record_step(num_tokens, num_tokens == len(scheduled) + num_drafts, seconds)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends each request's sampled token and checks it for a stop. Whatever raises while one request
        is handled ends that request's group alone, with finish_reason "error"; the others go on."""
        outputs: list[EngineCoreOutput] = []
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            try:
                drafts = scheduler_output.spec_token_ids.get(request_id)
                outputs.extend(self._update_request(request, num_tokens, runner_output) if drafts is None
                               else self._update_speculative(request, drafts, runner_output))
            except Exception as exc:  # noqa: BLE001 - one request's fault must not end its neighbours
                outputs.append(self._fail_group(request, exc))
        return outputs

    def _update_request(
        self, request: Request, num_tokens: int, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """One scheduled request after the forward: its progress, its sampled token, its stop check."""
        request_id = request.request_id
        computed_before = request.num_computed_tokens
        request.num_computed_tokens += num_tokens
        self.kv.publish_full_blocks(request_id, request.all_token_ids, request.num_computed_tokens,
                                    request.cache_salt, request.lora_int_id)
        # After publishing: a released block stays in the prefix cache, free and evictable.
        self.kv.release_slid_out_blocks(request_id, request.num_computed_tokens)
        prompt_logprobs = self._new_prompt_logprobs(request, computed_before,
                                                    runner_output.prompt_logprobs.get(request_id))
        if request_id in runner_output.structured_stops:
            return self._stop_unsampled(request, runner_output.structured_stops[request_id], prompt_logprobs)
        token_id = runner_output.sampled_token_ids.get(request_id)
        if token_id is None:
            if request.num_computed_tokens >= request.num_tokens:
                raise RuntimeError(f"request {request_id} reached the end of its sequence but got no token")
            # A prefill chunk: only prompt log-probabilities to report.
            return [self._output(request, [], None, None, prompt_logprobs)] if prompt_logprobs else []
        logprobs = runner_output.logprobs.get(request_id)
        if not request.appends_sampled_tokens:
            return [self._output(request, [], None, logprobs, prompt_logprobs)]
        outputs = []
        siblings = self._fork_first_samples(request, runner_output.forked_token_ids.get(request_id, []))
        for index, sequence in enumerate([request, *siblings]):
            token = token_id if sequence is request else sequence.all_token_ids[-1]
            entry = logprobs[index : index + 1] if logprobs else None
            if sequence is request:
                sequence.append_token(token)
            if entry:
                sequence.cumulative_logprob += entry[0].logprob
            status = sequence.check_stop()
            if status is not None:
                self.running.remove(sequence)
                self._finish(sequence, status)
            outputs.append(self._output(sequence, [token], status, entry,
                                        prompt_logprobs if sequence is request else None))
        return outputs

    def _update_speculative(self, request: Request, drafts: list[int],
                            runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """A request that verified drafts: it takes its sampled token and the accepted ones after it, up to a stop;
        the slots of the tokens it did not take are given back (never published), as if never scheduled."""
        request_id = request.request_id
        taken = [runner_output.sampled_token_ids[request_id], *runner_output.spec_token_ids.get(request_id, ())]
        self.speculator.record(request_id, len(drafts), len(taken) - 1)
        logprobs = runner_output.logprobs.get(request_id)
        status, num_taken = None, 0
        while status is None and num_taken < len(taken):
            request.append_token(taken[num_taken])
            if logprobs:
                request.cumulative_logprob += logprobs[num_taken].logprob
            num_taken += 1
            status = request.check_stop()
        request.num_computed_tokens += num_taken
        self.kv.truncate(request_id, request.num_computed_tokens)
        self.kv.publish_full_blocks(request_id, request.all_token_ids, request.num_computed_tokens,
                                    request.cache_salt, request.lora_int_id)
        self.kv.release_slid_out_blocks(request_id, request.num_computed_tokens)
        if status is not None:
            self.running.remove(request)
            self._finish(request, status)
        return [self._output(request, taken[:num_taken], status, logprobs[:num_taken] if logprobs else None, None)]

    def _fail_group(self, request: Request, exc: Exception) -> EngineCoreOutput:
        """Ends every sequence of the request's group with FINISHED_ERROR, freeing their blocks."""
        logger.error("Request %s failed while its step results were processed; it alone is ended",
                     request.group_id, exc_info=exc)
        for member_id in sorted(self.groups.get(request.group_id, ())):
            self._dequeue_and_finish(self.requests[member_id], RequestStatus.FINISHED_ERROR)
        output = self._output(request, [], RequestStatus.FINISHED_ERROR, None, None)
        output.error = f"{type(exc).__name__}: {exc}"
        return output

    @staticmethod
    def _new_prompt_logprobs(request: Request, computed_before: int,
                             entries: list[TokenLogprobs] | None) -> list[TokenLogprobs] | None:
        """The prompt log-probabilities of this step not reported before. Entry i scores prompt token
        computed_before + i + 1; after a preemption the recomputation scores tokens already reported."""
        if not entries:
            return entries
        fresh = entries[max(0, request.num_prompt_logprobs_reported - computed_before):]
        request.num_prompt_logprobs_reported = max(request.num_prompt_logprobs_reported,
                                                   computed_before + len(entries))
        return fresh

    def _stop_unsampled(self, request: Request, reason: str, prompt_logprobs) -> list[EngineCoreOutput]:
        """Finish a sequence that has no token to take ("stop", with the reason); at its first sample, the
        sequences it would have forked end the same way, so the user request still gets all n."""
        request.stop_reason = reason
        pending, request.num_pending_forks = request.num_pending_forks, 0
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        output = self._output(request, [], RequestStatus.FINISHED_STOPPED, None, prompt_logprobs)
        forks = [dataclasses.replace(output, sample_index=index, prompt_logprobs=None) for index in range(1, pending + 1)]
        return [output, *forks]

    def _fork_first_samples(self, request: Request, tokens: list[int]) -> list[Request]:
        """At its first sample a request with n > 1 becomes n sequences sharing the prompt's blocks."""
        if not request.num_pending_forks:
            return []
        if len(tokens) != request.num_pending_forks:
            raise RuntimeError(f"request {request.request_id} expected {request.num_pending_forks} forked samples")
        request.num_pending_forks = 0
        children = []
        for index, token in enumerate(tokens, start=1):
            child = self.fork_request(request.request_id, f"{request.group_id}#{index}", sample_index=index)
            child.append_token(token)
            children.append(child)
        return children

    @staticmethod
    def _output(request, new_token_ids, status, logprobs, prompt_logprobs) -> EngineCoreOutput:
        return EngineCoreOutput(
            request.request_id,
            new_token_ids,
            status.finish_reason if status else None,
            request.stop_reason,
            request.num_cached_tokens or 0,
            request.group_id,
            request.sample_index,
            logprobs,
            prompt_logprobs,
            request.cumulative_logprob,
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if self.speculator is not None:
            self.speculator.finish(request)
        self.kv.free(request.request_id)
        self._release_lora(request)
        del self.requests[request.request_id]
        self._unseen_by_runner.discard(request.request_id)
        self._appended.pop(request.request_id, None)
        members = self.groups.get(request.group_id)
        if members is not None:
            members.discard(request.request_id)
            if not members:
                del self.groups[request.group_id]
                del self._reserved_seats[request.group_id]
        self._finished_since_last_step.add(request.request_id)
