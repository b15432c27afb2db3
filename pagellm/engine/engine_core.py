"""The engine's inner loop: scheduler + model runner over one KV pool. Works on token ids only."""

from __future__ import annotations

import atexit
import concurrent.futures
import gc
import logging
import time
from dataclasses import dataclass

from pagellm.config import EngineArgs
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import EngineCoreOutput, Scheduler, SchedulerConfig, SchedulerStats
from pagellm.executor import create_executor
from pagellm.lora.slot_table import LoRASlotTable
# Re-exported for benchmarks/memory.py and throughput.py: model resolution lives with the per-rank worker now.
from pagellm.executor.model_worker import resolve_dtype, resolve_max_model_len  # noqa: F401
from pagellm.models.sliding_window import model_sliding_window
from pagellm.spec_decode.speculator import make_speculator
from pagellm.worker.kv_cache import GiB, return_free_heap

logger = logging.getLogger(__name__)

# How long an idle step waits for a compiling grammar before returning (the caller steps again).
_GRAMMAR_WAIT_S = 0.5


@dataclass(frozen=True)
class StartupReport:
    seconds: float
    num_blocks: int
    block_size: int
    kv_cache_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        return self.num_tokens / self.max_model_len


class EngineCore:
    # The requests the current (or last) step scheduled: if the rest of the step raises, a caller can
    # fail exactly these and keep serving the others.
    last_scheduled_request_ids: frozenset[str] = frozenset()

    def __init__(self, args: EngineArgs) -> None:
        started = time.perf_counter()
        # What an earlier engine of this process froze is collectable again: a dropped engine held in a
        # reference cycle must not keep its KV pool while this one allocates another.
        gc.unfreeze()
        gc.collect()
        # Loads the model (on every tensor-parallel rank) and sizes the KV pool.
        self.executor = create_executor(args)
        worker = self.executor.driver
        self.model_info = worker.model_info
        self.runner = worker.runner
        max_model_len = self.model_info.max_model_len
        num_blocks = worker.num_blocks
        self.scheduler = Scheduler(
            SchedulerConfig(worker.max_num_batched_tokens, args.max_num_seqs, max_model_len,
                            args.enable_chunked_prefill, self.runner.kernel_switch_rows()),
            KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching,
                           model_sliding_window(self.model_info.hf_config)),
            speculator=make_speculator(args.speculative_config),
            lora_slots=LoRASlotTable(args.max_loras) if args.enable_lora else None,
        )
        self.startup = StartupReport(time.perf_counter() - started, num_blocks, args.block_size, worker.kv_bytes,
                                     worker.weights_bytes, worker.activation_peak, max_model_len)
        graphs = self.runner.graphs
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%s); %.1f requests of max_model_len=%d fit at "
            "once; %s. Weights %.2f GiB (%s), activation peak %.2f GiB (prefill %.2f, decode of %d + sampler %.2f), "
            "%s, device %s, dtype %s, attention %s, %s, ready in %.1f s.",
            num_blocks, args.block_size, self.startup.num_tokens, worker.kv_bytes / GiB, worker.kv_reason,
            self.startup.max_concurrency, max_model_len, worker.pool_spec.describe(), worker.weights_bytes / GiB,
            self.runner.model.weight_format,
            worker.activation_peak / GiB,
            worker.prefill_peak / GiB, worker.num_profiled_decodes, worker.decode_peak / GiB,
            f"CUDA graphs for {len(graphs.sizes)} decode batch sizes up to {graphs.sizes[-1]} "
            f"({worker.graph_bytes / 2**20:.0f} MiB, {worker.graph_reserve / 2**20:.0f} MiB reserved)"
            if worker.use_graphs else "eager steps",
            self.model_info.device, str(self.model_info.dtype).removeprefix("torch."), self.runner.attn_backend.name,
            f"tensor_parallel_size={args.tensor_parallel_size} (sizes per rank)" if args.tensor_parallel_size > 1
            else "one rank", self.startup.seconds,
        )
        freeze_startup_heap()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        self.executor.shutdown()

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       whole_groups: bool = True) -> None:
        """End user requests (every sequence of each), or single sequences with whole_groups=False."""
        self.scheduler.finish_requests(request_ids, status, whole_groups)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def prefault_kv_cache(self, seconds: float) -> bool:
        """Idle time: fault in more of the CPU KV pool for about `seconds`; False once nothing is left to do."""
        return self.executor.prefault_kv_cache(seconds)

    def step(self) -> list[EngineCoreOutput]:
        self.last_scheduled_request_ids = frozenset()
        scheduler_output = self.scheduler.schedule()
        self.last_scheduled_request_ids = frozenset(scheduler_output.num_scheduled_tokens)
        pending_grammars = self.scheduler.grammar_futures_pending() if scheduler_output.is_empty else []
        if pending_grammars:
            # Nothing else can run: wait for a grammar (the next step schedules it), not spin.
            concurrent.futures.wait(pending_grammars, timeout=_GRAMMAR_WAIT_S, return_when="FIRST_COMPLETED")
        elif scheduler_output.is_empty and self.scheduler.has_unfinished_requests():
            stats = self.scheduler.get_stats()
            raise RuntimeError(f"the scheduler could schedule nothing although requests are waiting: {stats}")
        started = time.perf_counter()
        runner_output = self.executor.execute(scheduler_output)
        self.scheduler.record_step_time(scheduler_output, time.perf_counter() - started)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if (self.model_info.device.type == "cpu" and not scheduler_output.is_empty
                and not self.scheduler.has_unfinished_requests()):
            # Idle now: the steps' freed activations and logits go back to the system rather than sit in the C
            # heap until the next burst (each step takes them again, up to the activation peak start-up counted).
            return_free_heap()
        return outputs

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()


def freeze_startup_heap() -> None:
    """Everything made so far (the model's modules, the tokenizer, the block pool) lives as long as the engine:
    out of the collector's sight, a full collection during serving scans only what serving made, instead of
    pausing a step for every object of start-up (vLLM freezes its heap after start-up likewise). Unfrozen at
    exit, so that interpreter shutdown still frees them (nanobind, under triton, reports any it finds alive)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    return_free_heap()


