"""The engine's inner loop: scheduler + model runner over one KV pool. Works on token ids only."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch

from pagellm.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs
from pagellm.core.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import EngineCoreOutput, Scheduler, SchedulerConfig, SchedulerStats
from pagellm.cpu_features import cpu_has_native
from pagellm.models import loader
from pagellm.models.llama import head_dim_of
from pagellm.worker.kv_cache import (
    GiB,
    KVCacheSpec,
    allocate_kv_cache,
    device_memory_at_start,
    kv_cache_budget,
    layer_views,
    measure_peak,
)
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    source: loader.ModelSource
    hf_config: object
    tokenizer: object
    eos_token_ids: frozenset[int]
    max_model_len: int
    dtype: torch.dtype
    device: torch.device


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
        device = pick_device(args.device)
        if device.type == "cpu":
            # Every core this process may run on; torch's default can count cores outside the affinity mask.
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        total_memory, free_memory = device_memory_at_start(device)
        if device.type == "cuda" and free_memory < args.gpu_memory_utilization * total_memory:
            raise ValueError(
                f"only {free_memory / GiB:.2f} GiB of {total_memory / GiB:.2f} GiB device memory is free, less than "
                f"gpu_memory_utilization={args.gpu_memory_utilization} asks for; lower gpu_memory_utilization "
                "or free the device."
            )
        source = loader.resolve_model(args.model)
        hf_config, gguf_state_dict = loader.load_hf_config(source)
        loader.check_architecture(hf_config)
        max_model_len = resolve_max_model_len(args.max_model_len, hf_config)
        dtype = resolve_dtype(args.dtype, hf_config, device)
        model = loader.load_model(source, hf_config, gguf_state_dict, dtype, device, max_model_len,
                                  args.load_format, args.seed)
        del gguf_state_dict
        tokenizer = loader.load_tokenizer(source, args.tokenizer)
        eos_ids = frozenset(loader.eos_token_ids(source, hf_config, tokenizer))
        self.model_info = ModelInfo(source, hf_config, tokenizer, eos_ids, max_model_len, dtype, device)

        budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[device.type]
        self.runner = ModelRunner(model, device, args.block_size, max_model_len, args.max_num_seqs, args.seed, eos_ids)
        spec = KVCacheSpec(hf_config.num_hidden_layers, hf_config.num_key_value_heads, head_dim_of(hf_config),
                           args.block_size, dtype)
        weights_bytes = model.weights_bytes()
        # A step can never hold more than max_num_seqs sequences of max_model_len tokens.
        profile_tokens = min(budget, args.max_num_seqs * max_model_len)
        use_graphs = not args.enforce_eager and self.runner.can_capture_cuda_graphs()
        prefill_peak, decode_peak = self._profile(spec, profile_tokens, min(args.max_num_seqs, budget), max_model_len,
                                                  device)
        activation_peak = max(prefill_peak, decode_peak)
        # The graphs' pool keeps about one worst decode step's temporaries for good, beside the activations.
        graph_reserve = decode_peak if use_graphs else 0
        num_blocks, kv_bytes, kv_reason = self._num_blocks(args, spec, device, total_memory, weights_bytes,
                                                           activation_peak + graph_reserve)
        _check_fits(num_blocks, args.block_size, max_model_len)
        self.runner.set_kv_pool(allocate_kv_cache(spec, num_blocks, device))
        graph_bytes = self.runner.capture_cuda_graphs() if use_graphs else 0

        self.scheduler = Scheduler(
            SchedulerConfig(budget, args.max_num_seqs, max_model_len, args.enable_chunked_prefill),
            KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching),
        )
        self.startup = StartupReport(time.perf_counter() - started, num_blocks, args.block_size, kv_bytes,
                                     weights_bytes, activation_peak, max_model_len)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB (%s); %.1f requests of max_model_len=%d fit at "
            "once. Weights %.2f GiB, activation peak %.2f GiB (prefill %.2f, decode of %d + sampler %.2f), %s, "
            "device %s, dtype %s, attention %s, ready in %.1f s.",
            num_blocks, args.block_size, self.startup.num_tokens, kv_bytes / GiB, kv_reason,
            self.startup.max_concurrency, max_model_len, weights_bytes / GiB, activation_peak / GiB,
            prefill_peak / GiB, min(args.max_num_seqs, budget), decode_peak / GiB,
            f"CUDA graphs for {len(self.runner.graphs.sizes)} decode batch sizes up to {self.runner.graphs.sizes[-1]} "
            f"({graph_bytes / 2**20:.0f} MiB, {graph_reserve / 2**20:.0f} MiB reserved)"
            if use_graphs else "eager steps",
            device, str(dtype).removeprefix("torch."), self.runner.attn_backend.name, self.startup.seconds,
        )

    def _profile(self, spec: KVCacheSpec, budget: int, num_decodes: int, max_model_len: int,
                 device) -> tuple[int, int]:
        """Activation peaks of the largest prefill step and of the worst decode step with its sampler."""
        seq_len = min(budget, max_model_len)
        blocks = cdiv(budget, seq_len) * cdiv(seq_len, spec.block_size)
        one_layer = dataclasses.replace(spec, num_layers=1)
        scratch = layer_views(allocate_kv_cache(one_layer, blocks, device))
        with measure_peak(device) as prefill:
            self.runner.profile_prefill(budget, scratch)
        with measure_peak(device) as decode:
            self.runner.profile_decode(num_decodes, scratch)
        del scratch
        return prefill["peak"], decode["peak"]

    @staticmethod
    def _num_blocks(args, spec, device, total_memory, weights_bytes, activation_peak) -> tuple[int, int, str]:
        """(blocks, bytes, what decided the size) of the KV pool."""
        if args.num_gpu_blocks_override is not None:
            blocks = args.num_gpu_blocks_override
            return blocks, blocks * spec.bytes_per_block, "num_gpu_blocks_override"
        budget = kv_cache_budget(device, args.gpu_memory_utilization, total_memory, weights_bytes,
                                 activation_peak, args.kv_cache_memory_bytes)
        num_blocks = budget.kv_cache // spec.bytes_per_block
        return num_blocks, num_blocks * spec.bytes_per_block, budget.reason

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       whole_groups: bool = True) -> None:
        """End user requests (every sequence of each), or single sequences with whole_groups=False."""
        self.scheduler.finish_requests(request_ids, status, whole_groups)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        self.last_scheduled_request_ids = frozenset()
        scheduler_output = self.scheduler.schedule()
        self.last_scheduled_request_ids = frozenset(scheduler_output.num_scheduled_tokens)
        if scheduler_output.is_empty and self.scheduler.has_unfinished_requests():
            stats = self.scheduler.get_stats()
            raise RuntimeError(f"the scheduler could schedule nothing although requests are waiting: {stats}")
        runner_output = self.runner.execute(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu' or 'auto'.")
    return torch.device(name)


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and getattr(hf_config, "model_type", "") == "mistral":
        # Attention here is full, which equals sliding-window attention only within one window.
        limit = min(limit, window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds what the model supports ({limit}, from max_position_embeddings"
            f"{' and sliding_window' if window else ''}); pass max_model_len <= {limit}."
        )
    return requested


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    named = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
             "bfloat16": torch.bfloat16}
    if name != "auto":
        return named[name]
    if device.type == "cpu":
        # Without native bf16 (AVX512-BF16/AMX) CPU bf16 matmuls are emulated and slower than fp32.
        return torch.bfloat16 if cpu_has_native(torch.bfloat16) else torch.float32
    config_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if config_dtype in (torch.float16, "float16"):
        return torch.float16
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _check_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    need = cdiv(max_model_len, block_size)
    if num_blocks < need:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks ({num_blocks * block_size} tokens), but one request of "
            f"max_model_len={max_model_len} needs {need} blocks ({max_model_len} tokens). Raise "
            "gpu_memory_utilization or kv_cache_memory_bytes (or num_gpu_blocks_override), or lower max_model_len."
        )
