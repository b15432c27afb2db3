"""One rank's share of the model: its weights, its model runner and the KV pool of its KV heads.

With tensor_parallel_size=1 the engine process holds the only one; with N ranks each process holds one,
and all of them size their pools together (the smallest that every rank can hold).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from pagellm.attention.kv_spec import kv_cache_spec_for
from pagellm.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs
from pagellm.core.kv_cache_manager import cdiv, max_blocks_per_sequence
from pagellm.cpu_features import cpu_has_native
from pagellm.cpu_threads import cpu_share, openmp_wait_description
from pagellm.distributed.parallel_state import SINGLE, TensorParallelGroup, building_with
from pagellm.layers.quantization import check_source_quantization, quantization_config_for
from pagellm.models import loader
from pagellm.models.llama import check_tensor_parallel_size, head_dim_of
from pagellm.models.sliding_window import model_sliding_window
from pagellm.spec_decode.config import SpeculativeConfig
from pagellm.spec_decode.draft_model import DraftProposer, DraftRelay, PairedKVSpec, load_draft_runner
from pagellm.spec_decode.heads import HeadProposer, load_head_runner
from pagellm.worker.kv_cache import (
    GiB,
    KVCacheSpec,
    allocate_kv_cache,
    device_memory_at_start,
    layer_views,
    measure_peak,
    return_free_heap,
)
from pagellm.worker.kv_prefault import KVPoolPrefaulter
from pagellm.worker.memory_fit import (
    Footprint,
    LeastPool,
    check_pool_fits,
    check_weights_fit,
    cpu_default_pool,
    gguf_share,
    planned_model,
    refuse_pool_too_small,
)
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.profiling import profile_decode, profile_prefill

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    source: loader.ModelSource
    hf_config: object
    tokenizer: object  # None on ranks other than 0, which never see text
    eos_token_ids: frozenset[int]
    max_model_len: int
    dtype: torch.dtype
    device: torch.device


class ModelWorker:
    def __init__(self, args: EngineArgs, group: TensorParallelGroup = SINGLE, device: torch.device | None = None,
                 ranks_on_host: int = 1) -> None:
        device = device or pick_device(args.device)
        if device.type == "cpu" and group.size == 1:
            # torch's default counts cores outside the affinity mask and ignores a cgroup's CPU quota.
            share = cpu_share()
            torch.set_num_threads(share.threads)
            logger.info("CPU kernels: %s; OpenMP threads wait: %s", share.describe(), openmp_wait_description())
        memory = device_memory_at_start(device)
        if device.type == "cpu":
            memory = memory.shared_by(ranks_on_host)
        if device.type == "cuda" and memory.free < args.gpu_memory_utilization * memory.total:
            raise ValueError(
                f"only {memory.free / GiB:.2f} GiB of {memory.total / GiB:.2f} GiB device memory is free, less than "
                f"gpu_memory_utilization={args.gpu_memory_utilization} asks for; lower gpu_memory_utilization "
                "or free the device."
            )
        source = loader.resolve_model(args.model, args.revision, args.download_dir)
        check_source_quantization(source.is_gguf, args.quantization, args.quantization_config)
        if source.is_gguf:
            # Before the file is read: a file larger than memory is refused without touching it.
            check_weights_fit(*gguf_share(source.path, group), _explicit_pool(args, None), memory)
        hf_config, gguf_state_dict = loader.load_hf_config(source, args.trust_remote_code)
        loader.check_architecture(hf_config)
        check_tensor_parallel_size(hf_config, group.size, group.expert_parallel)
        max_model_len = resolve_max_model_len(args.max_model_len, hf_config)
        dtype = resolve_dtype(args.dtype, hf_config, device)
        self.max_num_batched_tokens = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS[device.type]
        budget = self.max_num_batched_tokens
        # The least pool: one request of max_model_len (a window plus a chunk on sliding-window models).
        need_blocks = max_blocks_per_sequence(max_model_len, args.block_size, model_sliding_window(hf_config), budget)
        quant_config = None if source.is_gguf else quantization_config_for(
            hf_config, args.quantization, args.quantization_config)
        planned = planned_model(hf_config, max_model_len, dtype, group, quant_config)
        planned_spec = kv_cache_spec_for(hf_config, planned.num_kv_heads, head_dim_of(hf_config), args.block_size,
                                         dtype, args.kv_cache_dtype)
        least_pool = _explicit_pool(args, planned_spec) or LeastPool(
            need_blocks * planned_spec.bytes_per_block, f"one request of max_model_len={max_model_len}",
            "max_model_len")
        # A GGUF's linear layers make their parameters as their blocks arrive: its file says what they take.
        weights = (gguf_share(source.path, group, gguf_state_dict.transcoding_growth()) if source.is_gguf
                   else (planned.parameter_bytes, planned.described))
        check_weights_fit(*weights, least_pool, memory)
        with building_with(group):
            model = loader.load_model(source, hf_config, gguf_state_dict, dtype, device, max_model_len,
                                      args.load_format, args.seed, args.quantization,
                                      args.quantization_config)
        del gguf_state_dict
        tokenizer, eos_ids = None, frozenset()
        if group.rank == 0:
            tokenizer = loader.load_tokenizer(source, args.tokenizer, args.tokenizer_revision, args.download_dir,
                                              args.trust_remote_code)
            eos_ids = frozenset(loader.eos_token_ids(source, hf_config, tokenizer))
        self.model_info = ModelInfo(source, hf_config, tokenizer, eos_ids, max_model_len, dtype, device)
        self.group = group

        spec = kv_cache_spec_for(hf_config, model.num_kv_heads_per_rank, head_dim_of(hf_config), args.block_size,
                                 dtype, args.kv_cache_dtype)
        self.kv_spec = spec
        self.runner = ModelRunner(model, device, args.block_size, max_model_len, args.max_num_seqs, args.seed, eos_ids,
                                  spec.format)
        if args.enable_lora:
            from pagellm.lora.manager import LoRAManager

            self.runner.lora = LoRAManager(model, args.max_loras, args.max_lora_rank,
                                           args.max_cpu_loras or args.max_loras, dtype, device)
        draft_spec = self._load_draft(args, hf_config, max_model_len, dtype, device)
        # The adapters' device slots and a draft model count as weights in the memory budget.
        self.weights_bytes = (model.weights_bytes() + (self.runner.lora.slots_bytes if self.runner.lora else 0)
                              + (self.runner.drafter.runner.model.weights_bytes() if draft_spec else 0))
        # A step can never hold more than max_num_seqs sequences of max_model_len tokens.
        profile_tokens = min(budget, args.max_num_seqs * max_model_len)
        self.num_profiled_decodes = min(args.max_num_seqs, budget)
        # A captured decode step would hold its collectives too, and the ranks would have to capture and replay
        # the same batch sizes in lockstep; that is not built, so tensor-parallel steps run eagerly.
        self.use_graphs = (not args.enforce_eager and group.size == 1 and not args.enable_lora
                           and self.runner.can_capture_cuda_graphs())
        self.prefill_peak, self.decode_peak = self._profile(self.runner, spec, profile_tokens,
                                                            self.num_profiled_decodes, max_model_len, device)
        if draft_spec is not None:
            # The draft's forwards run apart from the target's: the larger of the two peaks counts.
            peaks = self._profile(self.runner.drafter.runner, draft_spec, profile_tokens, self.num_profiled_decodes,
                                  max_model_len, device)
            self.prefill_peak, self.decode_peak = max(self.prefill_peak, peaks[0]), max(self.decode_peak, peaks[1])
            self.runner.drafter.runner.release_profiled_buffers()
        self.runner.release_profiled_buffers()
        # Every block holds its tokens' K/V of the target's layers and, with a draft model, of the draft's.
        pool_spec = PairedKVSpec(spec, draft_spec) if draft_spec is not None else spec
        self.activation_peak = max(self.prefill_peak, self.decode_peak)
        # The graphs' pool keeps about one worst decode step's temporaries for good, beside the activations.
        self.graph_reserve = self.decode_peak if self.use_graphs else 0
        footprint = Footprint(memory, self.weights_bytes, self.prefill_peak, self.decode_peak,
                              self.num_profiled_decodes, self.graph_reserve)
        num_blocks, self.kv_reason, refusal = _num_blocks(args, pool_spec, device, footprint, need_blocks,
                                                          max_model_len)
        # Every rank addresses the same block ids: the pool is as large as the smallest rank can hold. A rank
        # that refuses still takes part (with no blocks), so that no other rank waits on it.
        smallest = group.min_over_ranks(0 if refusal is not None else num_blocks)
        if refusal is not None:
            raise refusal
        if smallest < num_blocks:
            self.kv_reason += f"; the smallest of {group.size} ranks' pools"
        self.num_blocks = smallest
        self.kv_bytes = smallest * pool_spec.bytes_per_block
        _check_fits(self.num_blocks, args.block_size, max_model_len, model_sliding_window(hf_config), budget)
        if device.type == "cpu":
            return_free_heap()
        pool = allocate_kv_cache(spec, self.num_blocks, device)
        self.runner.set_kv_pool(pool)
        if draft_spec is not None:
            self.runner.drafter.runner.set_kv_pool(allocate_kv_cache(draft_spec, self.num_blocks, device))
            logger.info("Speculative decoding with %s: %s, %.2f GiB of weights; %s.",
                        args.speculative_config.get("model") or args.speculative_config.get("method"),
                        self.runner.drafter.runner.model.weight_format,
                        self.runner.drafter.runner.model.weights_bytes() / GiB, pool_spec.describe())
        self.pool_spec = pool_spec
        self.kv_prefaulter = KVPoolPrefaulter(pool) if device.type == "cpu" else None
        if self.kv_prefaulter is not None:
            self.kv_prefaulter.advance(args.kv_prefault_seconds)
        self.graph_bytes = self.runner.capture_cuda_graphs() if self.use_graphs else 0

    def _load_draft(self, args: EngineArgs, hf_config, max_model_len: int, dtype: torch.dtype,
                    device: torch.device) -> KVCacheSpec | None:
        """speculative_config's draft model or head (methods draft_model, mtp, eagle): loaded into the runner's
        drafter."""
        if args.speculative_config is None:
            return None
        config = SpeculativeConfig.from_dict(args.speculative_config)
        if not config.uses_draft_model:
            return None
        if config.uses_head:
            head_runner, head_spec = load_head_runner(
                config, self.runner.model, self.model_info.source, hf_config, max_model_len, dtype, device,
                args.block_size, self.runner.input_batch, args.seed, args.kv_cache_dtype, args.load_format,
                args.download_dir, args.trust_remote_code, self.group)
            self.runner.drafter = HeadProposer(head_runner, self.max_num_batched_tokens, self.group)
            return head_spec
        if self.group.rank != 0:
            # The draft runs on rank 0 alone; this rank's pool holds the target's layers only.
            self.runner.drafter = DraftRelay(self.group)
            return None
        draft_runner, draft_spec = load_draft_runner(
            config, hf_config, max_model_len, dtype, device, args.block_size, self.runner.input_batch, args.seed,
            args.kv_cache_dtype, args.load_format, args.download_dir, args.trust_remote_code)
        self.runner.drafter = DraftProposer(draft_runner, self.max_num_batched_tokens, config.disable_by_batch_size,
                                            self.group)
        return draft_spec

    @staticmethod
    def _profile(runner: ModelRunner, spec: KVCacheSpec, budget: int, num_decodes: int, max_model_len: int,
                 device) -> tuple[int, int]:
        """Activation peaks of the largest prefill step and of the worst decode step with its sampler."""
        seq_len = min(budget, max_model_len)
        blocks = cdiv(budget, seq_len) * cdiv(seq_len, spec.block_size)
        one_layer = dataclasses.replace(spec, num_layers=1)
        scratch = layer_views(allocate_kv_cache(one_layer, blocks, device))
        with measure_peak(device) as prefill:
            profile_prefill(runner, budget, scratch)
        with measure_peak(device) as decode:
            profile_decode(runner, num_decodes, scratch)
        del scratch
        return prefill["peak"], decode["peak"]


def _explicit_pool(args: EngineArgs, spec: KVCacheSpec | None) -> LeastPool | None:
    """The pool the arguments ask for, where they do (num_gpu_blocks_override needs the spec to be sized)."""
    if args.num_gpu_blocks_override is not None and spec is not None:
        blocks = args.num_gpu_blocks_override
        return LeastPool(blocks * spec.bytes_per_block, f"num_gpu_blocks_override={blocks}", "num_gpu_blocks_override")
    if args.kv_cache_memory_bytes is not None:
        return LeastPool(args.kv_cache_memory_bytes, f"kv_cache_memory_bytes={args.kv_cache_memory_bytes}",
                         "kv_cache_memory_bytes")
    return None


def _num_blocks(args: EngineArgs, spec: KVCacheSpec | PairedKVSpec, device: torch.device, footprint: Footprint,
                need_blocks: int, max_model_len: int) -> tuple[int, str, ValueError | None]:
    """(blocks, what decided the size, the refusal where the pool cannot fit) of the KV pool."""
    if args.num_gpu_blocks_override is not None or args.kv_cache_memory_bytes is not None:
        name = "num_gpu_blocks_override" if args.num_gpu_blocks_override is not None else "kv_cache_memory_bytes"
        blocks = (args.num_gpu_blocks_override if args.num_gpu_blocks_override is not None
                  else args.kv_cache_memory_bytes // spec.bytes_per_block)
        try:
            check_pool_fits(footprint, blocks * spec.bytes_per_block, name)
        except ValueError as refusal:
            return 0, name, refusal
        return blocks, name, None
    utilization = args.gpu_memory_utilization
    usable = int(utilization * footprint.memory.total)
    if device.type == "cpu":
        kv, reason = cpu_default_pool(footprint, usable, utilization)
    else:
        kv, reason = max(usable - footprint.beside_pool, 0), f"gpu_memory_utilization={utilization}"
    blocks = kv // spec.bytes_per_block
    if blocks < need_blocks and usable - footprint.beside_pool < need_blocks * spec.bytes_per_block:
        return 0, reason, refuse_pool_too_small(footprint, usable, utilization, need_blocks * spec.bytes_per_block,
                                                max_model_len)
    return blocks, reason, None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu' or 'auto'.")
    return torch.device(name)


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    # Sliding-window layers attend through their window (models/sliding_window.py), so the window is no limit.
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds what the model supports ({limit}, from max_position_embeddings); "
            f"pass max_model_len <= {limit}."
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


def _check_fits(num_blocks: int, block_size: int, max_model_len: int, sliding_window: int | None,
                max_chunk_tokens: int) -> None:
    # With a sliding window on every layer a sequence holds only its window and the chunk being computed.
    need = max_blocks_per_sequence(max_model_len, block_size, sliding_window, max_chunk_tokens)
    if num_blocks < need:
        window = f" with sliding_window={sliding_window}" if sliding_window is not None else ""
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks ({num_blocks * block_size} tokens), but one request of "
            f"max_model_len={max_model_len}{window} needs {need} blocks at once. Raise "
            "gpu_memory_utilization or kv_cache_memory_bytes (or num_gpu_blocks_override), or lower max_model_len."
        )
