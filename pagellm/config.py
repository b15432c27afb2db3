"""Engine arguments, as vLLM names them: one table from which `EngineArgs`, `LLM(**kwargs)` and the
`pagellm serve` flags are all made. Imports no torch.

Every field of vLLM's `EngineArgs` is here, with vLLM's name and default (tests/data/vllm_engine_args.json
records them; tests/test_engine_args.py checks that none is missing). Each carries how pagellm treats it:

- IMPLEMENTED: pagellm does what vLLM does with it.
- NO_EFFECT: accepted at any value; it cannot change what a request returns (logging, metrics, kernel and
  compilation hints, tuning of features pagellm has no use for), so a non-default value is logged and ignored.
- DEFAULT_ONLY: accepted at its default (and the values in `accepted`, which do what pagellm does anyway);
  any other value would change results in a way pagellm does not, so it is refused with a ValueError naming
  the argument, the value and what pagellm supports.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from dataclasses import MISSING, dataclass, field, fields

from pagellm import online_quantization

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# CPU memory is shared with the OS and every other process, so by default the CPU pool takes at most
# this much (vLLM's CPU backend also defaults to a 4 GiB KV space); kv_cache_memory_bytes overrides it.
CPU_DEFAULT_KV_CACHE_BYTES = 4 * 1024**3
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
# What vLLM leaves as None for the platform to decide, as pagellm decides it.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_DISTRIBUTED_TIMEOUT_SECONDS = 300.0
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# vLLM's names of the KV cache formats pagellm stores (pagellm/attention/kv_spec.py): the model's dtype, a half
# dtype of its own (a float32 model's K/V kept in bfloat16 or float16), fp8 (e4m3 or e5m2) and int8, the 8-bit ones
# with a scale per token and KV head.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head",
                   "int8_per_token_head")
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's names for a checkpoint method's kernels (Marlin, the auto_* spellings, moe_wna16 for a mixture of experts'
# AWQ / GPTQ experts, gpt-oss's MXFP4, ModelOpt's NVFP4) -> the checkpoint methods each is taken for: such a
# checkpoint runs on pagellm's kernels for its method.
QUANTIZATION_KERNEL_ALIASES = {"awq_marlin": ("awq",), "auto_awq": ("awq",), "gptq_marlin": ("gptq",),
                               "auto_gptq": ("gptq",), "moe_wna16": ("awq", "gptq"), "gpt_oss_mxfp4": ("mxfp4",),
                               "modelopt_fp4": ("modelopt",)}
# vLLM's StructuredOutputsConfig fields and defaults. pagellm's grammars run on xgrammar ("auto" picks it);
# disable_any_whitespace is read by the grammar code; the others select what pagellm has not and stay as they are.
STRUCTURED_OUTPUTS_DEFAULTS = {
    "backend": "auto",
    "disable_fallback": False,
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "reasoning_parser": "",
    "reasoning_parser_plugin": "",
    "enable_in_reasoning": False,
}
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
_STRUCTURED_OUTPUTS_FIXED = ("disable_fallback", "disable_additional_properties", "reasoning_parser",
                             "reasoning_parser_plugin", "enable_in_reasoning")
# The generation_config.json keys that become default sampling parameters (vLLM's list).
GENERATION_CONFIG_SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                                   "top_k", "top_p", "min_p", "max_new_tokens")


class Support(enum.Enum):
    IMPLEMENTED = "implemented"
    NO_EFFECT = "accepted, no effect"
    DEFAULT_ONLY = "default only"


# Help groups, named as vLLM names them (`pagellm serve --help=ModelConfig`).
MODEL, LOAD, ATTENTION, MAMBA, STRUCTURED = "ModelConfig", "LoadConfig", "AttentionConfig", "MambaConfig", \
    "StructuredOutputsConfig"
PARALLEL, CACHE, OFFLOAD, MULTIMODAL, LORA = "ParallelConfig", "CacheConfig", "OffloadConfig", \
    "MultiModalConfig", "LoRAConfig"
LOGGING, OBSERVABILITY, SCHEDULER, COMPILATION, KERNEL, VLLM, ENGINE = "LoggingConfig", "ObservabilityConfig", \
    "SchedulerConfig", "CompilationConfig", "KernelConfig", "VllmConfig", "Engine"


@dataclass(frozen=True)
class ArgSpec:
    """How one argument is offered: its help group and text, how pagellm treats it, how the CLI parses it."""

    group: str
    help: str
    support: Support
    # How a command-line value is read (pagellm/entrypoints/arg_parser.py): bool, int, float, str, optional_str,
    # size, max_model_len, json, json_list, str_or_json, list, int_list, append, hf_token.
    kind: str
    # DEFAULT_ONLY: values besides the default that pagellm takes, and why the others are refused.
    accepted: tuple = ()
    why: str = ""
    flags: tuple[str, ...] = ()
    choices: tuple | None = None
    # False: pagellm's own argument, not one of vLLM's.
    vllm: bool = True


def _kind_of(default: object) -> str:
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("str", str), ("json", dict)):
        if isinstance(default, types):
            return kind
    if isinstance(default, (list, set, tuple)):
        return "list"
    raise TypeError(f"say how the CLI reads an argument whose default is {default!r} (kind=...)")


def arg(default: object = MISSING, *, factory=MISSING, group: str, help: str = "",
        support: Support = Support.IMPLEMENTED, kind: str | None = None, accepted: tuple = (), why: str = "",
        flags: tuple[str, ...] = (), choices: tuple | None = None, vllm: bool = True):
    """One row of the table: a dataclass field whose metadata says how pagellm treats and parses it."""
    if kind is None:
        kind = _kind_of(factory() if factory is not MISSING else default)
    spec = ArgSpec(group, help, support, kind, accepted, why, flags, choices, vllm)
    if factory is not MISSING:
        return field(default_factory=factory, metadata={"arg": spec})
    return field(default=default, metadata={"arg": spec})


def no_effect(default: object = MISSING, *, group: str, factory=MISSING, kind: str | None = None, help: str = "",
              flags: tuple[str, ...] = ()):
    return arg(default, factory=factory, group=group, kind=kind, help=help, flags=flags, support=Support.NO_EFFECT)


def default_only(default: object = MISSING, *, group: str, why: str, factory=MISSING, kind: str | None = None,
                 accepted: tuple = (), help: str = "", flags: tuple[str, ...] = ()):
    return arg(default, factory=factory, group=group, kind=kind, help=help, flags=flags, accepted=accepted, why=why,
               support=Support.DEFAULT_ONLY)


# Reasons shared by many DEFAULT_ONLY rows.
_SPEC_CONFIG_ONLY = "pagellm takes speculative decoding settings from speculative_config"
_NO_DP = "pagellm runs one engine (data_parallel_size=1); start one server per replica behind a load balancer"
_NO_MM = "pagellm serves text-only models"
_NO_POOLING = "pagellm runs generative models (no pooling / embedding runners)"
_QUANT_METHODS = ("pagellm loads unquantized, GGUF, AWQ, GPTQ, compressed-tensors (int8/fp8 W8A8), fp8, "
                  "fbgemm_fp8, ModelOpt fp8, Quark W8A8, AutoRound, HQQ and bitsandbytes checkpoints, and quantizes "
                  "float ones to int8 or fp8 (or their experts alone to int8: experts_int8), NF4 (bitsandbytes) or rtn "
                  "as they load, or as vLLM's online shorthands say (fp8_per_tensor, fp8_per_channel, fp8_per_block, "
                  "mxfp8, int8_per_channel_weight_only; online with quantization_config)")
_NO_OFFLOAD = "pagellm keeps every weight on the device"
_NO_DISAGG = "pagellm does no disaggregated prefill / KV transfer"
_NO_CUSTOM_CODE = "pagellm runs its own model implementations"


@dataclass
class EngineArgs:
    """Everything that shapes an engine: every argument vLLM's EngineArgs takes, with vLLM's defaults,
    and pagellm's own (device, kv_prefault_seconds, structured_outputs_timeout)."""

    # ---- ModelConfig -----------------------------------------------------------------------------------
    # vLLM's default is "Qwen/Qwen3-0.6B" from the hub; pagellm reaches no hub, and None is its embedded model.
    model: str | None = arg(None, group=MODEL, kind="optional_str",
                            help=f"a local HF directory or .gguf file, a hub id found in the local Hugging Face "
                                 f"cache, or unset for the embedded {DEFAULT_MODEL}")
    model_weights: str = default_only("", group=MODEL, why="pagellm loads weights from the model argument")
    runner: str = default_only("auto", group=MODEL, accepted=("generate",), why=_NO_POOLING)
    convert: str = default_only("auto", group=MODEL, accepted=("none",), why=_NO_POOLING)
    tokenizer: str | None = arg(None, group=MODEL, kind="optional_str",
                                help="tokenizer directory or cached hub id (default: the model's)")
    tokenizer_mode: str = default_only("auto", group=MODEL, accepted=("hf",),
                                       why="pagellm uses the Hugging Face tokenizer (auto, hf)")
    trust_remote_code: bool = arg(False, group=MODEL,
                                  help="let transformers run the checkpoint's own config/tokenizer code")
    dtype: str = arg("auto", group=MODEL, choices=DTYPES,
                     help="weights and activations dtype (auto: bf16 where the device computes it natively)")
    seed: int = arg(0, group=MODEL, help="seed of the sampler's random draws")
    hf_config_path: str | None = default_only(None, group=MODEL, kind="optional_str",
                                              why="pagellm reads config.json from the model itself")
    allowed_local_media_path: str = no_effect("", group=MODEL)
    allowed_media_domains: list[str] | None = no_effect(None, group=MODEL, kind="list")
    revision: str | None = arg(None, group=MODEL, kind="optional_str",
                               help="branch, tag or commit of a hub id, as cached locally (default: main)")
    code_revision: str | None = default_only(None, group=MODEL, kind="optional_str", why=_NO_CUSTOM_CODE)
    tokenizer_revision: str | None = arg(None, group=MODEL, kind="optional_str",
                                         help="revision of a hub-id --tokenizer (default: main)")
    max_model_len: int | None = arg(None, group=MODEL, kind="max_model_len",
                                    help="longest sequence (prompt + output) in tokens, e.g. 4096 or 4k "
                                         "(default: the model's max_position_embeddings)")
    quantization: str | None = default_only(
        None, group=MODEL, kind="optional_str", flags=("-q",),
        accepted=("awq", "gptq", "compressed-tensors", "fp8", "fbgemm_fp8", "modelopt", "mxfp4", "int8", "experts_int8",
                  "gguf", "bitsandbytes", "auto-round", "quark", "rtn", "hqq", "ptpc_fp8",
                  *QUANTIZATION_KERNEL_ALIASES, *online_quantization.ONLINE_METHODS),
        why=_QUANT_METHODS)
    quantization_config: dict | None = arg(
        None, group=MODEL, kind="json",
        help='online quantization\'s settings, vLLM\'s: {"linear": FORMAT, "moe": FORMAT, "ignore": [modules]}, FORMAT '
             f"a shorthand or one of {', '.join(online_quantization.WEIGHT_FORMATS)}; ignore takes module names, "
             'fnmatch patterns and "re:" regular expressions; or {"targets": {pattern: shorthand}}')
    allow_deprecated_quantization: bool = no_effect(False, group=MODEL)
    enforce_eager: bool = arg(False, group=MODEL, help="run every step eagerly (no CUDA graphs)")
    enable_return_routed_experts: bool = default_only(False, group=MODEL,
                                                      why="pagellm does not return the experts a MoE model routed to")
    return_sampling_mask: bool = default_only(False, group=MODEL, why="pagellm returns no sampling masks")
    max_logprobs: int = arg(20, group=MODEL, help="most logprobs a request may ask for (-1: no limit)")
    logprobs_mode: str = default_only("raw_logprobs", group=MODEL,
                                      why="pagellm returns the model's log-probabilities (raw_logprobs)")
    use_fp64_gumbel: bool = default_only(False, group=MODEL, why="pagellm samples in float32")
    enable_trace_replay: bool = default_only(False, group=MODEL, why="pagellm records no traces to replay")
    disable_sliding_window: bool = default_only(False, group=MODEL,
                                                why="pagellm attends through each layer's sliding window")
    disable_cascade_attn: bool | None = no_effect(None, group=MODEL, kind="bool")
    skip_tokenizer_init: bool = default_only(False, group=MODEL, why="pagellm needs the tokenizer")
    enable_prompt_embeds: bool = default_only(False, group=MODEL, why="pagellm takes text or token-id prompts")
    served_model_name: str | list[str] | None = arg(None, group=MODEL, kind="list",
                                                    help="the name(s) clients pass as `model`; the first is "
                                                         "reported (default: the model argument)")
    config_format: str = default_only("auto", group=MODEL, accepted=("hf",),
                                      why="pagellm reads Hugging Face config.json files (and GGUF metadata)")
    hf_token: bool | str | None = no_effect(None, group=MODEL, kind="hf_token",
                                            help="unused: pagellm reads only what is on this machine")
    hf_overrides: dict = default_only(factory=dict, group=MODEL, kind="str_or_json", accepted=(None,),
                                      why="pagellm runs the checkpoint's config as it is")
    model_class_overrides: dict = default_only(factory=dict, group=MODEL, accepted=(None,), why=_NO_CUSTOM_CODE)
    pooler_config: dict | None = default_only(None, group=MODEL, kind="json", why=_NO_POOLING)
    generation_config: str = arg("auto", group=MODEL,
                                 help="default sampling parameters: auto (the model's generation_config.json), "
                                      "vllm (none), or a directory holding a generation_config.json")
    override_generation_config: dict = arg(factory=dict, group=MODEL,
                                           help='sampling defaults over generation_config, e.g. {"temperature": 0.5}')
    enable_sleep_mode: bool = default_only(False, group=MODEL, why="pagellm has no sleep mode")
    sleep_mode_offload_cudagraph: bool = no_effect(False, group=MODEL)
    sleep_preserve_parameter_names: list[str] = no_effect(factory=list, group=MODEL)
    enable_cumem_allocator: bool = no_effect(False, group=MODEL)
    enable_nccl_comm_suspend: bool = no_effect(False, group=MODEL)
    model_impl: str = default_only("auto", group=MODEL, accepted=("vllm",), why=_NO_CUSTOM_CODE)
    logits_processors: list | None = default_only(None, group=MODEL, kind="list",
                                                  why="pagellm loads no custom logits processors")
    io_processor_plugin: str | None = default_only(None, group=MODEL, kind="optional_str", why=_NO_POOLING)
    renderer_num_workers: int = no_effect(1, group=MODEL)

    # ---- LoadConfig ------------------------------------------------------------------------------------
    load_format: str = arg("auto", group=LOAD, choices=("auto", "dummy", "bitsandbytes"),
                           help="auto: the checkpoint's weights; dummy: random weights of its shapes "
                                "(benchmarks without a checkpoint); bitsandbytes: auto with "
                                "quantization=bitsandbytes (vLLM's older spelling)")
    download_dir: str | None = arg(None, group=LOAD, kind="optional_str",
                                   help="the Hugging Face cache to find hub ids in (default: $HF_HUB_CACHE, "
                                        "$HF_HOME/hub or ~/.cache/huggingface/hub); pagellm downloads nothing")
    safetensors_load_strategy: str | None = no_effect(None, group=LOAD, kind="optional_str")
    safetensors_prefetch_num_threads: int = no_effect(8, group=LOAD)
    safetensors_prefetch_block_size: int = no_effect(16 * 1024 * 1024, group=LOAD, kind="size")
    model_loader_extra_config: dict = default_only(factory=dict, group=LOAD, accepted=(None,),
                                                   why="pagellm's loader takes no extra options")
    ignore_patterns: str | list[str] = no_effect(factory=lambda: ["original/**/*"], group=LOAD)
    use_tqdm_on_load: bool = no_effect(True, group=LOAD)
    pt_load_map_location: str | dict = no_effect("cpu", group=LOAD, kind="str_or_json")

    # ---- AttentionConfig, MambaConfig (kernel choices; pagellm runs no Mamba layers) ---------------------
    attention_backend: str | None = no_effect(None, group=ATTENTION, kind="optional_str")
    mamba_config: dict = no_effect(factory=dict, group=MAMBA, kind="json")
    mamba_backend: str = no_effect("triton", group=MAMBA)
    mamba_ssu_algorithm: str | None = no_effect(None, group=MAMBA, kind="optional_str")
    enable_mamba_cache_stochastic_rounding: bool = no_effect(False, group=MAMBA)
    mamba_cache_philox_rounds: int = no_effect(0, group=MAMBA)

    # ---- StructuredOutputsConfig -----------------------------------------------------------------------
    reasoning_parser: str = default_only("", group=STRUCTURED, accepted=(None,),
                                         why="pagellm parses no reasoning sections")
    reasoning_parser_plugin: str | None = default_only(None, group=STRUCTURED, kind="optional_str", accepted=("",),
                                                       why="pagellm parses no reasoning sections")
    structured_outputs_timeout: float = arg(10.0, group=STRUCTURED, vllm=False,
                                            help="seconds a request's grammar may take to compile before the "
                                                 "request fails (default: 10)")

    # ---- ParallelConfig --------------------------------------------------------------------------------
    distributed_executor_backend: str | None = default_only(
        None, group=PARALLEL, kind="optional_str", accepted=("mp", "uni"),
        why="pagellm runs tensor-parallel ranks as local processes (mp), or in-process with one rank (uni)")
    pipeline_parallel_size: int = default_only(1, group=PARALLEL, flags=("-pp",),
                                               why="pagellm splits models by tensor parallelism only")
    # Across hosts (tensor_parallel_size ranks split evenly over nnodes): this engine is node 0 and hosts
    # the rendezvous at master_addr:master_port; the other nodes run `pagellm worker`. On one host the ranks
    # meet on a free loopback port, as vLLM's do.
    master_addr: str = arg("127.0.0.1", group=PARALLEL, help="address of node 0, where the nodes' ranks meet")
    master_port: int = arg(29501, group=PARALLEL, help="port of the rendezvous on node 0 (with --nnodes > 1)")
    nnodes: int = arg(1, group=PARALLEL, flags=("-n",), help="hosts the tensor-parallel ranks are spread over")
    node_rank: int = arg(0, group=PARALLEL, flags=("-r",),
                         help="this host's index: 0 runs the engine, 1.. run `pagellm worker`")
    # How long the ranks wait for each other: at the rendezvous, and inside a step's collectives.
    distributed_timeout_seconds: float | None = arg(None, group=PARALLEL, kind="float",
                                                    help="how long ranks wait for each other at the rendezvous "
                                                         f"and in a step (default: {DEFAULT_DISTRIBUTED_TIMEOUT_SECONDS:g})")
    cpu_distributed_timeout_seconds: int | None = no_effect(None, group=PARALLEL, kind="int")
    numa_bind: bool = no_effect(False, group=PARALLEL)
    numa_bind_nodes: list[int] | None = no_effect(None, group=PARALLEL, kind="int_list")
    numa_bind_cpus: list[str] | None = no_effect(None, group=PARALLEL, kind="list")
    device_ids: list | None = default_only(None, group=PARALLEL, kind="list",
                                           why="pagellm uses the devices CUDA_VISIBLE_DEVICES shows, in order")
    tensor_parallel_size: int = arg(1, group=PARALLEL, flags=("-tp",),
                                    help="ranks (processes; one GPU each on CUDA) that split every layer")
    prefill_context_parallel_size: int = default_only(1, group=PARALLEL, flags=("-pcp",),
                                                      why="pagellm does no context parallelism")
    decode_context_parallel_size: int = default_only(1, group=PARALLEL, flags=("-dcp",),
                                                     why="pagellm does no context parallelism")
    dcp_comm_backend: str | None = no_effect(None, group=PARALLEL, kind="optional_str")
    dcp_q_replicate: bool | None = no_effect(None, group=PARALLEL, kind="bool")
    dcp_kv_cache_interleave_size: int = no_effect(1, group=PARALLEL)
    cp_kv_cache_interleave_size: int | None = no_effect(None, group=PARALLEL, kind="int")
    data_parallel_size: int = default_only(1, group=PARALLEL, flags=("-dp",), why=_NO_DP)
    data_parallel_rank: int | None = default_only(None, group=PARALLEL, kind="int", flags=("-dpn",), why=_NO_DP)
    data_parallel_start_rank: int | None = default_only(None, group=PARALLEL, kind="int", flags=("-dpr",),
                                                        why=_NO_DP)
    data_parallel_size_local: int | None = default_only(None, group=PARALLEL, kind="int", flags=("-dpl",),
                                                        accepted=(1,), why=_NO_DP)
    data_parallel_address: str | None = no_effect(None, group=PARALLEL, kind="optional_str", flags=("-dpa",))
    data_parallel_rpc_port: int | None = no_effect(None, group=PARALLEL, kind="int", flags=("-dpp",))
    data_parallel_hybrid_lb: bool = default_only(False, group=PARALLEL, flags=("-dph",), why=_NO_DP)
    data_parallel_external_lb: bool = default_only(False, group=PARALLEL, flags=("-dpe",), why=_NO_DP)
    data_parallel_multi_port_external_lb: bool = default_only(False, group=PARALLEL, flags=("-dpm",), why=_NO_DP)
    data_parallel_backend: str = no_effect("mp", group=PARALLEL, flags=("-dpb",))
    enable_hc_sp: bool = default_only(False, group=PARALLEL, why="pagellm does no sequence parallelism")
    enable_expert_parallel: bool = arg(False, group=PARALLEL, flags=("-ep",),
                                       help="mixture-of-experts layers place whole experts on the tensor-parallel "
                                            "ranks (E/tensor_parallel_size each) instead of a slice of every expert")
    # The tuning of expert parallelism's all-to-all, load balancing and data-parallel variants, which pagellm's
    # all-reduce expert parallelism over the tensor-parallel ranks has no use for.
    enable_batch_sharded_sampling: bool | None = no_effect(None, group=PARALLEL, kind="bool")
    enable_ep_weight_filter: bool = no_effect(False, group=PARALLEL)
    all2all_backend: str = no_effect("allgather_reducescatter", group=PARALLEL)
    enable_elastic_ep: bool = no_effect(False, group=PARALLEL)
    elastic_ep_max_dp_size: int | None = no_effect(None, group=PARALLEL, kind="int")
    enable_dbo: bool = no_effect(False, group=PARALLEL)
    ubatch_size: int = no_effect(0, group=PARALLEL)
    dbo_decode_token_threshold: int = no_effect(32, group=PARALLEL)
    dp_sync_interval: int = no_effect(16, group=PARALLEL)
    dbo_prefill_token_threshold: int = no_effect(512, group=PARALLEL)
    disable_nccl_for_dp_synchronization: bool | None = no_effect(None, group=PARALLEL, kind="bool")
    eplb_config: dict = no_effect(factory=dict, group=PARALLEL, kind="json")
    enable_eplb: bool = no_effect(False, group=PARALLEL)
    expert_placement_strategy: str = no_effect("linear", group=PARALLEL)
    max_parallel_loading_workers: int | None = no_effect(None, group=PARALLEL, kind="int")
    ray_workers_use_nsight: bool = no_effect(False, group=PARALLEL)
    disable_custom_all_reduce: bool = no_effect(False, group=PARALLEL)
    enable_shm_tensor_arena: bool = no_effect(False, group=PARALLEL)
    worker_cls: str = default_only("auto", group=PARALLEL, why="pagellm runs its own model workers")
    worker_extension_cls: str = default_only("", group=PARALLEL, why="pagellm runs its own model workers")
    enable_fault_tolerance: bool = default_only(False, group=PARALLEL,
                                                why="pagellm fails the requests of a failed step and goes on")
    fault_tolerance_config: dict = default_only(factory=dict, group=PARALLEL, kind="json", accepted=(None,),
                                                why="pagellm fails the requests of a failed step and goes on")

    # ---- CacheConfig -----------------------------------------------------------------------------------
    block_size: int | None = arg(None, group=CACHE, kind="int",
                                 help=f"tokens per KV block, a power of two up to 128 (default: {DEFAULT_BLOCK_SIZE})")
    gpu_memory_utilization: float = arg(0.92, group=CACHE, flags=("--device-memory-utilization",),
                                        help="fraction of the device's memory the engine may take (on CPU the "
                                             "pool is capped at 4 GiB unless --kv-cache-memory-bytes says more)")
    kv_cache_memory_bytes: int | None = arg(None, group=CACHE, kind="size",
                                            help="exact KV pool size, e.g. 512MiB or 4G (overrides "
                                                 "--gpu-memory-utilization)")
    kv_cache_dtype: str = arg("auto", group=CACHE, choices=KV_CACHE_DTYPES,
                              help="KV cache format: auto (the model's dtype), bfloat16 or float16 (K/V rounded "
                                   "to that dtype whatever the model's: half a float32 model's cache), fp8 / "
                                   "fp8_e4m3 / fp8_e5m2 / fp8_per_token_head or int8_per_token_head (1 byte per "
                                   "value and a bfloat16 scale per token and KV head: ~2x the tokens)")
    num_gpu_blocks_override: int | None = arg(None, group=CACHE, kind="int",
                                              help="exact number of KV blocks (testing)")
    enable_prefix_caching: bool | None = arg(None, group=CACHE, kind="bool",
                                             help="reuse the KV blocks of prompt prefixes seen before (default: on)")
    prefix_caching_hash_algo: str = no_effect("sha256", group=CACHE)
    prefix_cache_retention_interval: int | None = no_effect(0, group=CACHE, kind="int")
    kv_cache_dtype_skip_layers: list[str] = no_effect(factory=list, group=CACHE)
    kv_sharing_fast_prefill: bool = default_only(False, group=CACHE, why="pagellm computes every layer's prefill")
    swa_bounded_replay: bool = default_only(True, group=CACHE,
                                            why="pagellm keeps the sliding-window blocks a request needs")
    mamba_cache_dtype: str = no_effect("auto", group=CACHE)
    mamba_ssm_cache_dtype: str = no_effect("auto", group=CACHE)
    mamba_block_size: int | None = no_effect(None, group=CACHE, kind="int")
    prefix_match_unit: int | None = default_only(None, group=CACHE, kind="int",
                                                 why="pagellm matches prefixes block by block")
    mamba_cache_mode: str = no_effect("none", group=CACHE)
    enable_mamba_shared_prefix_checkpoint: bool = no_effect(False, group=CACHE)
    replayssm_buffer_len: int = no_effect(16, group=CACHE)
    use_replayssm: bool = no_effect(False, group=CACHE)
    kv_offloading_size: float | None = default_only(None, group=CACHE, kind="float",
                                                    why="pagellm keeps the KV cache in its one pool")
    kv_offloading_backend: str = no_effect("native", group=CACHE)
    # CPU only: seconds of start-up spent faulting in the KV pool's first blocks, so that the first requests
    # do not pay for fresh pages (the rest is faulted in while the engine is idle); 0 leaves all of it to
    # first use, inf faults in the whole pool before the engine is ready.
    kv_prefault_seconds: float = arg(1.0, group=CACHE, vllm=False,
                                     help="CPU: seconds of start-up spent faulting in the KV pool's first pages, "
                                          "so that the first requests do not pay for them; the rest is faulted "
                                          "in while idle (default: 1.0)")

    # ---- OffloadConfig ---------------------------------------------------------------------------------
    offload_backend: str = no_effect("auto", group=OFFLOAD)
    cpu_offload_gb: float = default_only(0, group=OFFLOAD, kind="float", why=_NO_OFFLOAD)
    cpu_offload_params: set[str] = no_effect(factory=set, group=OFFLOAD)
    offload_group_size: int = default_only(0, group=OFFLOAD, why=_NO_OFFLOAD)
    offload_num_in_group: int = no_effect(1, group=OFFLOAD)
    offload_prefetch_step: int = no_effect(1, group=OFFLOAD)
    offload_params: set[str] = no_effect(factory=set, group=OFFLOAD)

    # ---- MultiModalConfig (pagellm serves text-only models; media inputs are refused per request) ------
    language_model_only: bool = no_effect(False, group=MULTIMODAL)
    limit_mm_per_prompt: dict = no_effect(factory=dict, group=MULTIMODAL, kind="json")
    enable_mm_embeds: bool = no_effect(False, group=MULTIMODAL)
    interleave_mm_strings: bool = no_effect(False, group=MULTIMODAL)
    media_io_kwargs: dict = no_effect(factory=dict, group=MULTIMODAL)
    mm_processor_kwargs: dict | None = no_effect(None, group=MULTIMODAL, kind="json")
    mm_processor_cache_gb: float = no_effect(4, group=MULTIMODAL, kind="float")
    mm_processor_cache_type: str | None = no_effect("lru", group=MULTIMODAL, kind="optional_str")
    mm_hasher_algorithm: str = no_effect("blake3", group=MULTIMODAL)
    mm_shm_cache_max_object_size_mb: int = no_effect(128, group=MULTIMODAL)
    mm_encoder_only: bool = default_only(False, group=MULTIMODAL, why=_NO_MM)
    mm_encoder_tp_mode: str = no_effect("weights", group=MULTIMODAL)
    mm_encoder_attn_backend: str | None = no_effect(None, group=MULTIMODAL, kind="optional_str")
    mm_encoder_attn_dtype: str | None = no_effect(None, group=MULTIMODAL, kind="optional_str")
    mm_encoder_fp8_scale_path: str | None = no_effect(None, group=MULTIMODAL, kind="optional_str")
    mm_encoder_fp8_scale_save_path: str | None = no_effect(None, group=MULTIMODAL, kind="optional_str")
    mm_encoder_fp8_scale_save_margin: float = no_effect(1.5, group=MULTIMODAL)
    skip_mm_profiling: bool = no_effect(False, group=MULTIMODAL)
    video_pruning_rate: float | None = no_effect(None, group=MULTIMODAL, kind="float")
    video_pruning_method: str = no_effect("evs", group=MULTIMODAL)
    mm_tensor_ipc: str = no_effect("direct_rpc", group=MULTIMODAL)
    mm_processor_device: str = no_effect("auto", group=MULTIMODAL)
    mm_ipc_gpu_memory_gb: float = no_effect(0, group=MULTIMODAL, kind="float")
    mm_device_do_normalize: bool | None = no_effect(True, group=MULTIMODAL, kind="bool")

    # ---- LoRAConfig (the tuning rows apply only with enable_lora) ---------------------------------------
    enable_lora: bool | None = arg(False, group=LORA, kind="bool",
                                   help="serve LoRA adapters (LLM: lora_request=; serve: --lora-modules, model=name)")
    max_loras: int = arg(1, group=LORA, help="adapters a batch may mix: the device slots kept for them")
    max_lora_rank: int = arg(16, group=LORA, help="the largest adapter rank the slots hold")
    default_mm_loras: dict | None = no_effect(None, group=LORA, kind="json")
    fully_sharded_loras: bool = no_effect(False, group=LORA)
    max_cpu_loras: int | None = arg(None, group=LORA, kind="int",
                                    help="adapters kept loaded in host memory (default: max_loras)")
    lora_dtype: str | None = no_effect("auto", group=LORA, kind="optional_str")
    lora_target_modules: list[str] | None = no_effect(None, group=LORA, kind="list")
    enable_tower_connector_lora: bool = no_effect(False, group=LORA)
    specialize_active_lora: bool = no_effect(False, group=LORA)
    enable_mixed_moe_lora_format: bool = no_effect(False, group=LORA)
    enable_moe_shared_loras: bool = no_effect(False, group=LORA)
    max_lora_cls_labels: int | None = no_effect(None, group=LORA, kind="int")

    # ---- LoggingConfig, ObservabilityConfig -------------------------------------------------------------
    logging_config: dict | None = no_effect(None, group=LOGGING, kind="json")
    log_level: str | None = no_effect(None, group=LOGGING, kind="optional_str",
                                      help="unused: set PAGELLM_LOGGING_LEVEL")
    log_config_file: str | None = no_effect(None, group=LOGGING, kind="optional_str")
    show_hidden_metrics_for_version: str | None = no_effect(None, group=OBSERVABILITY, kind="optional_str")
    otlp_traces_endpoint: str | None = no_effect(None, group=OBSERVABILITY, kind="optional_str")
    collect_detailed_traces: list[str] | None = no_effect(None, group=OBSERVABILITY, kind="list")
    per_request_spec_decode_metrics: str = no_effect("none", group=OBSERVABILITY)
    kv_cache_metrics: bool = no_effect(False, group=OBSERVABILITY)
    kv_cache_metrics_sample: float = no_effect(0.01, group=OBSERVABILITY)
    custom_histogram_buckets: dict | None = no_effect(None, group=OBSERVABILITY, kind="json")
    cudagraph_metrics: bool = no_effect(False, group=OBSERVABILITY)
    enable_layerwise_nvtx_tracing: bool = no_effect(False, group=OBSERVABILITY)
    enable_mfu_metrics: bool = no_effect(False, group=OBSERVABILITY)
    enable_logging_iteration_details: bool = no_effect(False, group=OBSERVABILITY)
    jit_monitor_mode: str = no_effect("warn", group=OBSERVABILITY)
    jit_monitor_verbose: bool = no_effect(False, group=OBSERVABILITY)
    enable_mm_processor_stats: bool = no_effect(False, group=OBSERVABILITY)

    # ---- SchedulerConfig -------------------------------------------------------------------------------
    max_num_batched_tokens: int | None = arg(None, group=SCHEDULER, kind="size",
                                             help="tokens one step may compute, e.g. 2048 or 8k (default: "
                                                  f"{DEFAULT_MAX_NUM_BATCHED_TOKENS['cpu']} on CPU, "
                                                  f"{DEFAULT_MAX_NUM_BATCHED_TOKENS['cuda']} on CUDA)")
    max_num_scheduled_tokens: int | None = default_only(None, group=SCHEDULER, kind="size",
                                                        why="pagellm schedules up to max_num_batched_tokens a step")
    max_num_seqs: int | None = arg(None, group=SCHEDULER, kind="int",
                                   help=f"sequences one step may run (default: {DEFAULT_MAX_NUM_SEQS})")
    max_num_active_seqs: int | None = default_only(None, group=SCHEDULER, kind="int",
                                                   why="pagellm bounds running sequences by max_num_seqs")
    max_num_queued_reqs: int | None = default_only(
        None, group=SCHEDULER, kind="int",
        why="pagellm bounds the requests that wait for a slot instead: max_num_queued_requests "
            "(--max-num-queued-requests, HTTP 429)")
    max_num_queued_tokens: int | None = default_only(None, group=SCHEDULER, kind="size",
                                                     why="pagellm bounds waiting requests by max_num_queued_requests")
    long_prefill_token_threshold: int = no_effect(0, group=SCHEDULER)
    long_prefill_token_threshold_adaptive: bool = no_effect(False, group=SCHEDULER)
    scheduling_policy: str = arg("fcfs", group=SCHEDULER, choices=SCHEDULING_POLICIES,
                                 help="fcfs: first come, first served; priority: by each request's priority "
                                      "(lower first), then arrival")
    enable_chunked_prefill: bool | None = arg(None, group=SCHEDULER, kind="bool",
                                              help="compute long prompts over several steps alongside running "
                                                   "decodes (default: on)")
    disable_chunked_mm_input: bool = no_effect(False, group=SCHEDULER)
    scheduler_cls: str | None = default_only(None, group=SCHEDULER, kind="optional_str",
                                             why="pagellm runs its own scheduler")
    scheduler_reserve_full_isl: bool = no_effect(True, group=SCHEDULER)
    watermark: float = no_effect(0.0, group=SCHEDULER)
    prefill_schedule_interval: int = no_effect(1, group=SCHEDULER)
    disable_hybrid_kv_cache_manager: bool | None = no_effect(None, group=SCHEDULER, kind="bool")
    async_scheduling: bool | None = no_effect(None, group=SCHEDULER, kind="bool")
    stream_interval: int = default_only(1, group=SCHEDULER, why="pagellm streams every token as it is made")

    # ---- CompilationConfig, KernelConfig (hints for vLLM's compiler and kernels) -----------------------
    cudagraph_capture_sizes: list[int] | None = no_effect(None, group=COMPILATION, kind="int_list")
    max_cudagraph_capture_size: int | None = no_effect(None, group=COMPILATION, kind="int")
    ir_op_priority: dict = no_effect(factory=dict, group=KERNEL, kind="json")
    enable_flashinfer_autotune: bool | None = no_effect(None, group=KERNEL, kind="bool")
    moe_backend: str = no_effect("auto", group=KERNEL)
    linear_backend: str = no_effect("auto", group=KERNEL)
    sparse_indexer_topk_backend: str = no_effect("auto", group=KERNEL)

    # ---- VllmConfig ------------------------------------------------------------------------------------
    speculative_config: dict | None = arg(None, group=VLLM, kind="json", flags=("-sc",),
                                          help='speculative decoding as JSON, e.g. {"method": "ngram", '
                                               '"num_speculative_tokens": 4, "prompt_lookup_max": 4} (methods: '
                                               'ngram, suffix, draft_model with "model": a draft path, mtp, '
                                               'eagle with "model": an EAGLE-1 head path)')
    spec_method: str | None = default_only(None, group=VLLM, kind="optional_str", why=_SPEC_CONFIG_ONLY)
    spec_model: str | None = default_only(None, group=VLLM, kind="optional_str", why=_SPEC_CONFIG_ONLY)
    spec_tokens: int | None = default_only(None, group=VLLM, kind="int", why=_SPEC_CONFIG_ONLY)
    watermark_config: dict | None = default_only(None, group=VLLM, kind="json",
                                                 why="pagellm does not watermark its outputs")
    diffusion_config: dict | None = default_only(None, group=VLLM, kind="json", flags=("-dc",),
                                                 why="pagellm runs autoregressive models")
    kv_transfer_config: dict | None = default_only(None, group=VLLM, kind="json", why=_NO_DISAGG)
    kv_events_config: dict | None = default_only(None, group=VLLM, kind="json",
                                                 why="pagellm publishes no KV cache events")
    ec_transfer_config: dict | None = default_only(None, group=VLLM, kind="json", why=_NO_DISAGG)
    ec_manager_config: dict = no_effect(factory=dict, group=VLLM, kind="json")
    compilation_config: dict | int = no_effect(factory=dict, group=VLLM, kind="json", flags=("-cc",))
    attention_config: dict = no_effect(factory=dict, group=VLLM, kind="json", flags=("-ac",))
    engram_config: dict | None = default_only(None, group=VLLM, kind="json", why="pagellm runs no Engram layers")
    reasoning_config: dict | None = default_only(None, group=VLLM, kind="json",
                                                 why="pagellm parses no reasoning sections")
    kernel_config: dict = no_effect(factory=dict, group=VLLM, kind="json")
    additional_config: dict = no_effect(factory=dict, group=VLLM, kind="json")
    structured_outputs_config: dict | None = arg(None, group=VLLM, kind="json",
                                          help='vLLM\'s StructuredOutputsConfig as JSON, e.g. {"backend": '
                                               '"xgrammar", "disable_any_whitespace": true}')
    aux_output_config: dict = default_only(factory=dict, group=VLLM, kind="json", accepted=(None,),
                                           why="pagellm returns no auxiliary outputs")
    profiler_config: dict = no_effect(factory=dict, group=VLLM, kind="json")
    optimization_level: int = no_effect(2, group=VLLM, flags=("-O",))
    performance_mode: str = no_effect("balanced", group=VLLM)
    weight_transfer_config: dict | None = default_only(None, group=VLLM, kind="json",
                                                       why="pagellm loads weights only from the checkpoint")

    # ---- Engine (the rest of vLLM's, and pagellm's own) ------------------------------------------------
    disable_log_stats: bool = no_effect(False, group=ENGINE)
    aggregate_engine_logging: bool = no_effect(False, group=ENGINE)
    fail_on_environ_validation: bool = no_effect(False, group=ENGINE)
    tokens_only: bool = default_only(False, group=ENGINE, why="pagellm serves text as well as tokens")
    # vLLM's default is 0 (abort at once); `pagellm serve` drains for 10 s unless told otherwise.
    shutdown_timeout: float = arg(0, group=ENGINE, kind="float",
                                  help="on SIGINT/SIGTERM, seconds that running requests may go on (new ones get "
                                       "503) before their streams are ended (pagellm serve's default: 10)")
    gdn_prefill_backend: str | None = no_effect(None, group=ENGINE, kind="optional_str")
    kda_prefill_backend: str | None = no_effect(None, group=ENGINE, kind="optional_str")
    kda_decode_backend: str | None = no_effect(None, group=ENGINE, kind="optional_str")
    device: str = arg("auto", group=ENGINE, choices=("auto", "cpu", "cuda"), vllm=False,
                      help="where the model runs (auto: CUDA if torch sees a GPU, else the CPU)")

    def __post_init__(self) -> None:
        self._normalize()
        self.validate()
        self._resolve_platform_defaults()
        _log_ignored(self)

    def _normalize(self) -> None:
        """Spellings vLLM also takes for the same thing: None for an empty config, a str for one name."""
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.override_generation_config is None:
            self.override_generation_config = {}
        config = self.structured_outputs_config
        if dataclasses.is_dataclass(config) and not isinstance(config, type):  # vLLM's StructuredOutputsConfig
            self.structured_outputs_config = dataclasses.asdict(config)
        elif config == {}:
            self.structured_outputs_config = None  # all of vLLM's defaults, as unset
        if self.load_format == "bitsandbytes" and self.quantization in (None, "bitsandbytes"):
            self.quantization, self.load_format = "bitsandbytes", "auto"  # vLLM's older spelling of the method

    def _resolve_platform_defaults(self) -> None:
        """vLLM leaves these None for its platform to choose; these are pagellm's choices."""
        if self.block_size is None:
            self.block_size = DEFAULT_BLOCK_SIZE
        if self.max_num_seqs is None:
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = True
        if self.enable_chunked_prefill is None:
            self.enable_chunked_prefill = True
        if self.distributed_timeout_seconds is None:
            self.distributed_timeout_seconds = DEFAULT_DISTRIBUTED_TIMEOUT_SECONDS

    def validate(self) -> None:
        try:  # first: its refusals of vLLM's online names say why, where check_supported's list what is taken
            online_quantization.resolve(self.quantization, self.quantization_config)
        except ValueError as exc:
            raise ArgumentValueError(str(exc)) from None
        check_supported(self)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ArgumentValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is out of range; "
                "allowed: 0 < gpu_memory_utilization <= 1 (the fraction of device memory the engine may take)."
            )
        if self.block_size is not None and self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ArgumentValueError(f"block_size={self.block_size} is not allowed; use a power of two from 1 to 128 "
                                     f"(default {DEFAULT_BLOCK_SIZE}).")
        if self.max_model_len == -1:
            raise ArgumentValueError("max_model_len=-1 (auto: the longest that fits in memory) is not supported; "
                                     "leave it unset for the model's max_position_embeddings, or pass a number.")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "kv_cache_memory_bytes",
                     "max_num_seqs"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        self._validate_parallel()
        self._validate_model_arguments()
        self._validate_lora()
        if self.dtype not in DTYPES:
            raise ArgumentValueError(f"dtype={self.dtype!r} is not supported; use one of {', '.join(DTYPES)}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ArgumentValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use one of "
                                     f"{', '.join(KV_CACHE_DTYPES)}.")
        if self.load_format == "bitsandbytes":  # (_normalize took it where quantization agrees)
            raise ArgumentValueError(f"load_format='bitsandbytes' loads bitsandbytes weights, but "
                                     f"quantization={self.quantization!r}; leave one of them unset")
        if self.load_format not in ("auto", "dummy"):
            raise ArgumentValueError(f"load_format={self.load_format!r} is not supported; use auto, dummy or "
                                     "bitsandbytes.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ArgumentValueError(f"device={self.device!r} is not supported; use auto, cpu or cuda.")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ArgumentValueError(f"scheduling_policy={self.scheduling_policy!r} is not supported; use fcfs or "
                                     "priority.")
        _validate_structured_outputs_config(self.structured_outputs_config)
        self._validate_speculative_config()
        timeout = self.structured_outputs_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ArgumentValueError(f"structured_outputs_timeout={timeout!r} is out of range; allowed: a finite "
                                     "number of seconds > 0.")
        timeout = self.shutdown_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ArgumentValueError(f"shutdown_timeout={timeout!r} is out of range; allowed: a number of "
                                     "seconds >= 0.")

    def _validate_speculative_config(self) -> None:
        if self.speculative_config is None:
            return
        from pagellm.spec_decode.config import SpeculativeConfig  # imports no torch

        try:
            SpeculativeConfig.from_dict(self.speculative_config)  # every method runs under tensor parallelism
        except ValueError as exc:
            raise ArgumentValueError(str(exc)) from None

    def _validate_model_arguments(self) -> None:
        for name in ("model", "tokenizer", "revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ArgumentValueError(f"{name}={value!r} must be a str (a path or hub id) or None.")
        names = self.served_model_name
        if names is not None and (not isinstance(names, list) or not names
                                  or not all(isinstance(n, str) and n for n in names)):
            raise ArgumentValueError(f"served_model_name={names!r} must be a name or a non-empty list of names.")
        if not isinstance(self.trust_remote_code, bool):
            raise ArgumentValueError(f"trust_remote_code={self.trust_remote_code!r} must be True or False.")
        source = self.generation_config
        if not isinstance(source, str) or source not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(os.path.expanduser(source), "generation_config.json")):
            raise ArgumentValueError(f"generation_config={source!r} is not 'auto' (the model's "
                                     "generation_config.json), 'vllm' (none) or a directory holding a "
                                     "generation_config.json.")
        if not isinstance(self.override_generation_config, dict):
            raise ArgumentValueError(f"override_generation_config={self.override_generation_config!r} must be a "
                                     'dict, e.g. {"temperature": 0.5}.')
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ArgumentValueError(f"max_logprobs={self.max_logprobs!r} is out of range; allowed: an int >= 0, "
                                     "or -1 for no limit.")

    def _validate_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentValueError(f"{name}={value!r} is out of range; allowed: an int >= 1.")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ArgumentValueError(f"max_cpu_loras={cpu!r} is out of range; allowed: an int >= max_loras="
                                     f"{self.max_loras} (every adapter in a device slot is also held in host memory).")

    def _validate_parallel(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            _positive(name, getattr(self, name))
        if self.tensor_parallel_size % self.nnodes:
            raise ArgumentValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} does not split evenly over nnodes={self.nnodes}; "
                "use a tensor_parallel_size that is a multiple of nnodes (the same number of ranks on every node)."
            )
        if self.node_rank != 0:
            raise ArgumentValueError(
                f"node_rank={self.node_rank}: the engine (with its server) runs on node 0; start the other nodes "
                "with `pagellm worker --node-rank K`."
            )
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int) \
                or not 0 < self.master_port < 65536:
            raise ArgumentValueError(f"master_port={self.master_port!r} is out of range; allowed: 1..65535.")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ArgumentValueError(f"master_addr={self.master_addr!r} must be a host name or address.")
        if not self.kv_prefault_seconds >= 0:
            raise ArgumentValueError(f"kv_prefault_seconds={self.kv_prefault_seconds!r} is out of range; allowed: "
                                     ">= 0 seconds (0: fault the KV pool in on first use, inf: all of it at start-up).")
        timeout = self.distributed_timeout_seconds
        if timeout is not None and not timeout > 0:
            raise ArgumentValueError(f"distributed_timeout_seconds={timeout!r} is out of range; allowed: > 0 seconds.")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


class ArgumentValueError(ValueError):
    """An engine argument pagellm refuses; the message names it, its value and what pagellm takes."""


def arg_spec(spec_field: dataclasses.Field) -> ArgSpec:
    return spec_field.metadata["arg"]


def field_default(spec_field: dataclasses.Field) -> object:
    if spec_field.default_factory is not MISSING:
        return spec_field.default_factory()
    return spec_field.default


def _is_default(value: object, default: object) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return value is default
    if isinstance(default, (set, list, tuple)) and isinstance(value, (set, list, tuple)):
        return list(value) == list(default) or set(value) == set(default)
    try:
        return value == default
    except Exception:  # an object whose comparison raises is not the default
        return False


def check_supported(args: object) -> None:
    """Refuses, all at once, every DEFAULT_ONLY argument of `args` (a dataclass of arg() rows) set to a value
    pagellm does not take."""
    refused = [message for spec_field in fields(args) if (message := _refusal(args, spec_field))]
    if len(refused) == 1:
        raise ArgumentValueError(refused[0])
    if refused:
        raise ArgumentValueError(f"{len(refused)} arguments ask for what pagellm does not do:\n- " + "\n- ".join(refused))


def _refusal(args: object, spec_field: dataclasses.Field) -> str | None:
    """Why a DEFAULT_ONLY argument's value is refused; None where pagellm takes it."""
    spec = arg_spec(spec_field)
    if spec.support is not Support.DEFAULT_ONLY:
        return None
    value, default = getattr(args, spec_field.name), field_default(spec_field)
    if _is_default(value, default) or any(_is_default(value, ok) for ok in spec.accepted):
        return None
    takes = ", ".join(repr(v) for v in (default, *spec.accepted))
    return (f"{spec_field.name}={value!r:.200} is not supported: {spec.why}. Leave {spec_field.name} unset "
            f"(pagellm takes {takes}).")


# Logging switches: vLLM's LLM sets disable_log_stats, and these need no word that they change nothing.
_QUIET = {"disable_log_stats", "aggregate_engine_logging", "enable_log_requests", "use_tqdm_on_load"}


def _log_ignored(args: EngineArgs) -> None:
    ignored = []
    for spec_field in fields(args):
        spec = arg_spec(spec_field)
        if spec.support is Support.NO_EFFECT and spec.group != LOGGING and spec_field.name not in _QUIET:
            value = getattr(args, spec_field.name)
            if not _is_default(value, field_default(spec_field)):
                ignored.append(f"{spec_field.name}={value!r:.60}")
    if ignored:
        logger.info("accepted without effect (they tune what pagellm does not run, or only logging): %s",
                    ", ".join(ignored))


def _validate_structured_outputs_config(config: object) -> None:
    if config is None:
        return
    if not isinstance(config, dict):
        raise ArgumentValueError(f"structured_outputs_config={config!r:.200} must be a dict of vLLM's "
                                 f"StructuredOutputsConfig fields ({', '.join(STRUCTURED_OUTPUTS_DEFAULTS)}) or None.")
    unknown = sorted(set(config) - set(STRUCTURED_OUTPUTS_DEFAULTS))
    if unknown:
        raise ArgumentValueError(f"structured_outputs_config has unknown fields {unknown}; allowed: "
                                 f"{', '.join(STRUCTURED_OUTPUTS_DEFAULTS)}.")
    for key in _STRUCTURED_OUTPUTS_FIXED:
        default = STRUCTURED_OUTPUTS_DEFAULTS[key]
        if key in config and config[key] != default:
            raise ArgumentValueError(f"structured_outputs_config.{key}={config[key]!r} is not supported: pagellm's "
                                     f"one backend is xgrammar, with no reasoning parser; leave it {default!r}.")
    backend = config.get("backend", "auto")
    if backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ArgumentValueError(f"structured_outputs_config.backend={backend!r} is not supported; pagellm's "
                                 f"structured outputs run on xgrammar: use one of {list(STRUCTURED_OUTPUTS_BACKENDS)}.")
    if not isinstance(config.get("disable_any_whitespace", False), bool):
        raise ArgumentValueError("structured_outputs_config.disable_any_whitespace="
                                 f"{config['disable_any_whitespace']!r} must be true or false.")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentValueError(f"{name}={value!r} is out of range; allowed: an int >= 1.")


def engine_arg_fields(cls: type = EngineArgs) -> list[dataclasses.Field]:
    """The table's rows, in order (AsyncEngineArgs adds its own after EngineArgs')."""
    return [f for f in fields(cls) if "arg" in f.metadata]
