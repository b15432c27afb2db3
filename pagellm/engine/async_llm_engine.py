"""An asyncio front for the engine: requests come and go while the engine steps in the background.

The LLMEngine is not thread-safe, so one thread owns it. Event loops hand it adds and aborts through a
lock-protected queue that it drains between steps; it sleeps on a condition when there is nothing to do,
and hands each step's outputs to per-request streams on their own loops with `call_soon_threadsafe`, so
a slow or cancelled consumer never holds up the step or anyone else's tokens.

A request with n > 1 or best_of is one engine request: the scheduler computes its prompt once and forks
the samples off it (sharing its blocks), and the stream carries all of them.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import torch

from pagellm.config import EngineArgs
from pagellm.core.scheduler import SchedulerStats
from pagellm.engine.arg_utils import DEFAULT_MAX_NUM_QUEUED_REQUESTS, AsyncEngineArgs
from pagellm.engine.llm_engine import LLMEngine, PromptType
from pagellm.engine.request_stream import RequestStream
from pagellm.executor import ExecutorDeadError
from pagellm.metrics import IterationStats, RequestTimer, StatLogger
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# A step that fails takes only its own requests down; this many failures in a row, with no good step
# between them, means the engine itself is broken (a lost device, a corrupt pool), and it stops.
DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES = 3
# Each idle call faults in at least one chunk (kv_prefault.CHUNK_BYTES) and stops after this long: a request
# that arrives meanwhile waits for one chunk at most.
_IDLE_PREFAULT_SECONDS = 0.0001


class EngineDeadError(RuntimeError):
    """The engine cannot go on; every request, present and future, fails with this."""


class EngineStepError(RuntimeError):
    """A step that this request was part of raised; the request was aborted, the engine goes on."""


class QueueFullError(RuntimeError):
    """More requests wait for a slot than max_num_queued_requests allows."""

    # What a client is told to wait before retrying (HTTP Retry-After), in seconds.
    retry_after_s = 1


@dataclass
class _AddOp:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    stream: RequestStream
    arrival_time: float
    priority: int = 0
    lora_request: object = None


@dataclass
class _FailAllOp:
    """Ends every request in flight with `error` (a server that shuts down); the engine goes on."""

    error: BaseException


@dataclass
class _AbortOp:
    request_id: str
    # Set when a consumer walks away: then only that stream's request may go, not a later one that reused the id.
    stream: RequestStream | None = None


@dataclass
class _LiveRequest:
    stream: RequestStream
    timer: RequestTimer


_Delivery = tuple[RequestStream, RequestOutput | BaseException]


class AsyncLLMEngine:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_num_queued_requests: int = DEFAULT_MAX_NUM_QUEUED_REQUESTS,
        stat_loggers: Sequence[StatLogger] = (),
        max_consecutive_step_failures: int = DEFAULT_MAX_CONSECUTIVE_STEP_FAILURES,
    ) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        # The engine thread detokenizes with the engine's tokenizer; callers on event loops get their own
        # copy, so the two never share one tokenizer object across threads.
        self.tokenizer = copy.deepcopy(engine.get_tokenizer())
        self.max_num_queued_requests = max_num_queued_requests
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        # torch's intra-op thread count is set per thread: the engine thread applies this one again.
        self._torch_threads = torch.get_num_threads()

        # Shared between the engine thread and callers; guarded by _cond.
        self._cond = threading.Condition()
        self._ops: list[_AddOp | _AbortOp | _FailAllOp] = []
        # Sequences asked for by adds not yet applied, and the scheduler's running and waiting counts as of
        # the last iteration (plus the adds taken since): what the 429 compares with max_num_seqs.
        self._num_pending_sequences = 0
        self._num_running = 0
        self._num_waiting = 0
        self._max_num_seqs = engine.args.max_num_seqs
        self._request_ids: set[str] = set()
        # Requests refused by max_num_queued_requests since the engine thread last recorded stats.
        self._num_admission_rejections = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead_error: EngineDeadError | None = None
        self._stats: SchedulerStats = engine.get_stats()

        # Owned by the engine thread. The ops taken but not yet applied: if the loop dies part-way through
        # them, their callers are failed too, never left waiting.
        self._live: dict[str, _LiveRequest] = {}
        # Live requests no step has scheduled yet (whose timers wait for their first scheduled time).
        self._unscheduled: set[str] = set()
        self._ops_in_hand: list[_AddOp | _AbortOp | _FailAllOp] = []
        self._consecutive_failures = 0

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, stat_loggers: Sequence[StatLogger] = ()
    ) -> AsyncLLMEngine:
        """Loads the model and sizes the KV pool now; needs no event loop (the engine thread starts on first use)."""
        max_queued = getattr(engine_args, "max_num_queued_requests", DEFAULT_MAX_NUM_QUEUED_REQUESTS)
        return cls(LLMEngine(engine_args), max_num_queued_requests=max_queued, stat_loggers=stat_loggers)

    # ---- the caller's side (any thread with a running event loop) ---------------------------------

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str, priority: int = 0, *,
        lora_request=None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request as the engine makes them: cumulative by default, or as
        `sampling_params.output_kind` asks. Stopping the iteration (break, cancel, close) aborts the request.
        `lora_request`: the LoRA adapter it runs with (a pagellm.lora.request.LoRARequest), or None."""
        stream = self.add_request(request_id, prompt, sampling_params, priority, lora_request=lora_request)
        async with aclosing(self.outputs(stream)) as outputs:
            async for output in outputs:
                yield output

    def add_request(self, request_id: str, prompt: PromptType, sampling_params: SamplingParams | None,
                    priority: int = 0, *, lora_request=None) -> RequestStream:
        """Queues a request at once, raising here (not at the first output) when it cannot be taken:
        QueueFullError, EngineDeadError, or ValueError for a reused id. Pass the stream to `outputs`, or
        abort it; bad prompts and parameters are reported by the stream. With n > 1 each output carries
        the completions that moved (CompletionOutput.index tells them apart)."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        stream = RequestStream(request_id, params.output_kind, asyncio.get_running_loop())
        engine_params = params.clone()
        engine_params.output_kind = RequestOutputKind.DELTA
        if engine_params.structured_outputs is not None and engine_params.structured_grammar is None:
            # Parsed and compiled in the grammar threads, never waited for on the engine thread: a grammar
            # xgrammar refuses ends the request with the reason (the HTTP routes wait for the parse, and say 400).
            grammar = self.engine.grammar_compiler.submit(engine_params.structured_outputs)
            engine_params.structured_grammar = grammar.future()
        with self._cond:
            if self._dead_error is not None:
                raise EngineDeadError(str(self._dead_error))
            if self._stopping:
                raise EngineDeadError("the engine is shutting down; it takes no new requests.")
            if request_id in self._request_ids:
                raise ValueError(f"request_id={request_id!r} is already in use; request ids must be unique.")
            # Every sequence counts (n, best_of): one request must not queue past the bound for many. With
            # nothing queued a request is always taken, or one of more sequences than the bound never could be.
            queued = self._num_waiting_for_a_slot()
            if queued and self._num_waiting_for_a_slot(engine_params.num_sequences) > self.max_num_queued_requests:
                self._num_admission_rejections += 1
                raise QueueFullError(
                    f"{queued} sequences are already waiting for one of the max_num_seqs={self._max_num_seqs} "
                    f"slots and this request adds {engine_params.num_sequences}; the limit is "
                    f"max_num_queued_requests={self.max_num_queued_requests}; retry later, or raise "
                    "--max-num-queued-requests."
                )
            self._request_ids.add(request_id)
            self._ops.append(_AddOp(request_id, prompt, engine_params, stream, time.monotonic(), priority,
                                    lora_request))
            self._num_pending_sequences += engine_params.num_sequences
            self._ensure_started()
            self._cond.notify()
        return stream

    async def outputs(self, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of a request from `add_request`; leaving early aborts it and frees its blocks."""
        try:
            while True:
                output = await stream.next_output()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:
                self._queue_abort(stream.request_id, stream)

    async def abort(self, request_id: str) -> None:
        """Ends the request and frees its blocks; its stream gets a last output with finish_reason "abort"."""
        self.abort_request(request_id)

    def abort_request(self, request_id: str) -> None:
        """`abort` for code without an event loop (or that must not yield to it)."""
        self._queue_abort(request_id, None)

    async def get_tokenizer(self):
        return self.tokenizer

    async def check_health(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    def get_stats(self) -> SchedulerStats:
        """Scheduler and KV-cache counts as of the end of the engine's last iteration."""
        return self._stats

    @property
    def num_waiting_requests(self) -> int:
        """Requests (or samples) that wait for a slot: beyond max_num_seqs, counting those running, those
        in the scheduler's queue and those not yet handed to it. What --max-num-queued-requests bounds."""
        with self._cond:
            return self._num_waiting_for_a_slot()

    def _num_waiting_for_a_slot(self, num_new_sequences: int = 0) -> int:
        # A request that arrives while fewer than max_num_seqs run is scheduled in the next step: it waits
        # for nothing, so it must not count against the bound (it did, and 32 of 40 requests got 429s).
        wanted = self._num_running + self._num_waiting + self._num_pending_sequences + num_new_sequences
        return max(0, wanted - self._max_num_seqs)

    @property
    def num_requests_in_flight(self) -> int:
        """Requests added and not yet finished, failed or aborted."""
        with self._cond:
            return len(self._request_ids)

    def fail_all_requests(self, error: BaseException) -> None:
        """Ends every request in flight (their streams raise `error`) and frees their blocks; the engine
        goes on and takes new requests."""
        with self._cond:
            if self._dead_error is None and self._thread is not None:
                self._ops.append(_FailAllOp(error))
                self._cond.notify()

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        with self._cond:
            self.stat_loggers = [*self.stat_loggers, stat_logger]

    @property
    def dead_error(self) -> EngineDeadError | None:
        # A tensor-parallel worker that died while the engine was idle is news before the next step.
        if self._dead_error is None and self.engine.core.executor.failure is not None:
            return EngineDeadError(f"{self.engine.core.executor.failure}; restart the server.")
        return self._dead_error

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self._cond:
            self._ensure_started()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread; requests still in flight fail with EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.engine.shutdown()

    def _queue_abort(self, request_id: str, stream: RequestStream | None) -> None:
        with self._cond:
            if request_id in self._request_ids and self._dead_error is None:
                self._ops.append(_AbortOp(request_id, stream))
                self._cond.notify()

    def _ensure_started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagellm-engine", daemon=True)
            self._thread.start()

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self._torch_threads)
        try:
            prefaulting = True
            while True:
                with self._cond:
                    while not self._has_work() and not prefaulting:
                        self._cond.wait()
                    if self._stopping:
                        break
                    idle = not self._has_work()
                    if not idle:
                        self._ops_in_hand, self._ops = self._ops, []
                        # Until the scheduler's count is read again below, count the taken adds as waiting.
                        self._num_waiting += self._num_pending_sequences
                        self._num_pending_sequences = 0
                if idle:
                    # Nothing to run: fault in the next chunk of the KV pool, which a request would pay for later.
                    prefaulting = self.engine.prefault_kv_cache(_IDLE_PREFAULT_SECONDS)
                    continue
                self._iterate()
        except BaseException as exc:  # noqa: BLE001 - whatever stops the loop must reach every waiting caller
            if not isinstance(exc, EngineDeadError):
                logger.exception("The engine loop crashed")
                exc = EngineDeadError(f"the engine loop crashed: {exc!r}")
            else:
                logger.error("%s", exc)
            self._die(exc)
            return
        self._die(EngineDeadError("the engine was shut down; restart the server to serve again."))

    def _has_work(self) -> bool:
        return bool(self._ops) or self._stopping or self.engine.has_unfinished_requests()

    def _iterate(self) -> None:
        stats = IterationStats()
        deliveries: list[_Delivery] = []
        try:
            while self._ops_in_hand:
                self._apply(self._ops_in_hand[0], stats, deliveries)
                self._ops_in_hand.pop(0)
            if self.engine.has_unfinished_requests():
                self._step(stats, deliveries)
            # Published and recorded before the outputs go out: a consumer that sees its request finish also
            # sees its blocks freed and the request in the metrics.
            self._record(self._publish_stats(), stats)
        finally:
            # Even when the engine dies here, what this iteration already produced reaches its consumers.
            orphans = self._deliver(deliveries)
        if orphans:
            orphan_stats = IterationStats()
            for stream in orphans:
                self._apply_abort(stream.request_id, stream, orphan_stats, [])
            self._record(self._publish_stats(), orphan_stats)

    def _record(self, scheduler_stats: SchedulerStats, stats: IterationStats) -> None:
        if scheduler_stats.num_waiting:
            stats.num_waiting_deferred = len(self.engine.core.scheduler.grammar_futures_pending())
        with self._cond:
            stat_loggers = self.stat_loggers
            stats.num_admission_rejections, self._num_admission_rejections = self._num_admission_rejections, 0
        for stat_logger in stat_loggers:
            try:
                stat_logger.record(scheduler_stats, stats)
            except Exception:
                logger.exception("A stat logger failed; serving goes on")

    def _apply(self, op: _AddOp | _AbortOp | _FailAllOp, stats: IterationStats, deliveries: list[_Delivery]) -> None:
        """One op; one that raises fails its own request (or, for a fail-all, the requests) and no other."""
        try:
            if isinstance(op, _AddOp):
                self._apply_add(op, deliveries)
            elif isinstance(op, _AbortOp):
                self._apply_abort(op.request_id, op.stream, stats, deliveries)
            else:
                self._fail_requests(list(self._live), op.error, stats, deliveries)
        except Exception as exc:
            logger.exception("Handing a request to the engine failed; failing that request alone")
            request_ids = list(self._live) if isinstance(op, _FailAllOp) else [op.request_id]
            self._fail_requests(request_ids, exc, stats, deliveries, stream=getattr(op, "stream", None))

    def _fail_requests(self, request_ids: list[str], error: BaseException, stats: IterationStats,
                       deliveries: list[_Delivery], stream: RequestStream | None = None) -> None:
        """Ends these requests with `error`: out of the engine (blocks freed) and their streams told."""
        try:
            self.engine.abort_request(request_ids)
        except Exception as abort_exc:
            raise EngineDeadError(
                f"requests could not be freed after {error!r} ({abort_exc!r}); restart the server."
            ) from abort_exc
        now = time.monotonic()
        for request_id in request_ids:
            live = self._forget(request_id)
            if live is not None:
                live.timer.on_finish("error", now, stats)
                deliveries.append((live.stream, error))
            elif stream is not None:  # an add that failed before it was live
                deliveries.append((stream, error))

    def _publish_stats(self) -> SchedulerStats:
        scheduler_stats = self.engine.get_stats()
        with self._cond:
            self._num_running = scheduler_stats.num_running
            self._num_waiting = scheduler_stats.num_waiting
            self._stats = scheduler_stats
        return scheduler_stats

    def _forget(self, request_id: str) -> _LiveRequest | None:
        """The request has left the engine: its id may be used again."""
        live = self._live.pop(request_id, None)
        self._unscheduled.discard(request_id)
        with self._cond:
            self._request_ids.discard(request_id)
        return live

    def _apply_add(self, op: _AddOp, deliveries: list[_Delivery]) -> None:
        try:
            self.engine.add_request(op.request_id, op.prompt, op.params, op.priority, op.lora_request)
        except ValueError as exc:  # bad input: this request's failure alone, and nothing of it was added
            self._forget(op.request_id)
            deliveries.append((op.stream, exc))
            return
        timer = RequestTimer(op.arrival_time, n=op.params.n, max_tokens=op.params.max_tokens,
                             max_model_len=self.max_model_len)
        timer.on_queued(time.monotonic())
        self._live[op.request_id] = _LiveRequest(op.stream, timer)
        self._unscheduled.add(op.request_id)

    def _apply_abort(
        self, request_id: str, stream: RequestStream | None, stats: IterationStats, deliveries: list[_Delivery]
    ) -> None:
        live = self._live.get(request_id)
        if live is None or (stream is not None and live.stream is not stream):
            return  # finished, failed, never admitted, or the id now names a newer request
        outputs = self.engine.abort_request([request_id])
        self._forget(request_id)
        now = time.monotonic()
        for output in outputs:
            live.timer.on_output(output, now, stats)
        live.timer.on_finish("abort", now, stats)
        deliveries.extend((live.stream, output) for output in outputs)

    def _step(self, stats: IterationStats, deliveries: list[_Delivery]) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._note_scheduled(started, stats)
            self._fail_step(exc, stats, deliveries)
            return
        self._note_scheduled(started, stats)
        self._consecutive_failures = 0
        now = time.monotonic()
        for output in outputs:
            live = self._live.get(output.request_id)
            if live is None:
                continue
            if output.error is not None:  # this request alone failed inside the step; the engine ended it
                self._forget(output.request_id)
                live.timer.on_finish("error", now, stats)
                error = EngineStepError(f"request {output.request_id} failed: {output.error}")
                deliveries.append((live.stream, error))
                continue
            live.timer.on_output(output, now, stats)
            deliveries.append((live.stream, output))
            if output.finished:
                self._forget(output.request_id)
                reason = output.outputs[0].finish_reason if output.outputs else None
                live.timer.on_finish(reason or "stop", now, stats)

    def _note_scheduled(self, step_started: float, stats: IterationStats) -> None:
        """The requests of the step's batch that no step had scheduled before were first scheduled as it
        began. (A request's first sequence carries the request's id; its forks come only after it ran.)"""
        scheduled = self.engine.core.last_scheduled_request_ids
        stats.stepped = bool(scheduled)
        if not self._unscheduled:
            return
        for request_id in self._unscheduled & scheduled:
            self._unscheduled.discard(request_id)
            self._live[request_id].timer.on_scheduled(step_started)

    def _fail_step(self, exc: Exception, stats: IterationStats, deliveries: list[_Delivery]) -> None:
        if isinstance(exc, ExecutorDeadError):  # the model's ranks are gone: no later step can succeed
            raise EngineDeadError(f"{exc} Restart the server.") from exc
        self._consecutive_failures += 1
        if self._consecutive_failures >= self.max_consecutive_step_failures:
            raise EngineDeadError(
                f"{self._consecutive_failures} engine steps in a row failed (the limit is "
                f"{self.max_consecutive_step_failures}); the last with {exc!r}. Restart the server."
            ) from exc
        # The step scheduled sequences: a request with n > 1 runs several, under its own id and forks of it.
        sequences = self.engine.core.scheduler.requests
        scheduled = {sequences[s].group_id if s in sequences else s for s in self.engine.core.last_scheduled_request_ids}
        # With nothing scheduled, nothing could make progress: every request is part of the failure.
        failed = [r for r in self._live if r in scheduled] or list(self._live)
        logger.error("An engine step failed; failing its %d requests %s", len(failed), failed[:8], exc_info=exc)
        error = EngineStepError(f"the engine step that these requests were part of failed: {exc!r}")
        error.__cause__ = exc
        self._fail_requests(failed, error, stats, deliveries)

    def _deliver(self, deliveries: list[_Delivery]) -> list[RequestStream]:
        """Hands outputs to their loops, one callback per loop; returns the streams whose loop has closed."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Delivery]] = defaultdict(list)
        for stream, item in deliveries:
            by_loop[stream.loop].append((stream, item))
        orphans: list[RequestStream] = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody will ever read these requests
                orphans.extend(stream for stream, _ in items)
        return orphans

    def _die(self, error: EngineDeadError) -> None:
        with self._cond:
            self._dead_error = error
            pending, self._ops = self._ops_in_hand + self._ops, []
            self._ops_in_hand = []
            self._num_pending_sequences = 0
            self._request_ids.clear()
        streams = [live.stream for live in self._live.values()]
        streams += [op.stream for op in pending if isinstance(op, _AddOp) and op.request_id not in self._live]
        self._live.clear()
        self._unscheduled.clear()
        self._deliver([(stream, EngineDeadError(str(error))) for stream in streams])


def _put_all(items: list[_Delivery]) -> None:
    for stream, item in items:
        stream.put(item)


__all__ = ["AsyncEngineArgs", "AsyncLLMEngine", "EngineDeadError", "EngineStepError", "QueueFullError"]
