"""Engine arguments, as vLLM names them, and their validation. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagellm.structured_output.config import structured_outputs_options

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# CPU memory is shared with the OS and every other process, so by default the CPU pool takes at most
# this much (vLLM's CPU backend also defaults to a 4 GiB KV space); kv_cache_memory_bytes overrides it.
CPU_DEFAULT_KV_CACHE_BYTES = 4 * 1024**3
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


@dataclass
class EngineArgs:
    """Everything that shapes an engine. Field names and meanings follow vLLM's."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    # Across hosts (tensor_parallel_size ranks split evenly over nnodes): this engine is node 0 and hosts
    # the rendezvous at master_addr:master_port; the other nodes run `pagellm worker`. On one host the
    # defaults (127.0.0.1, a free port) need no setting.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # How long the ranks wait for each other: at the rendezvous, and inside a step's collectives.
    distributed_timeout_seconds: float = 300.0
    disable_log_stats: bool = True
    # "dummy": random weights of the model's shape and dtype, made on the device (benchmarks with no checkpoint).
    load_format: str = "auto"
    # Run every step eagerly: no CUDA graphs for decode steps.
    enforce_eager: bool = False
    # CPU only: seconds of start-up spent faulting in the KV pool's first blocks, so that the first requests
    # do not pay for fresh pages (the rest is faulted in while the engine is idle); 0 leaves all of it to
    # first use, inf faults in the whole pool before the engine is ready.
    kv_prefault_seconds: float = 1.0
    # Seconds a request waits for its structured-output grammar to be parsed (past it: refused, HTTP 400), and
    # then again to be compiled against the vocabulary (past it: the request ends, saying why).
    structured_outputs_timeout: float = 10.0
    # vLLM's StructuredOutputsConfig as a dict: backend "auto" or "xgrammar", disable_any_whitespace.
    structured_outputs_config: dict | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} is out of range; "
                "allowed: 0 < gpu_memory_utilization <= 1 (the fraction of device memory the engine may take)."
            )
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size={self.block_size} is not allowed; use a power of two from 1 to 128 (default 16).")
        _positive("max_num_seqs", self.max_num_seqs)
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        self._validate_parallel()
        if self.dtype not in ("auto", "float32", "float", "float16", "half", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} is not supported; use auto, float32, float16 or bfloat16.")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} is not supported; use auto or dummy.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not supported; use auto, cpu or cuda.")
        timeout = self.structured_outputs_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"structured_outputs_timeout={self.structured_outputs_timeout!r} is out of range; "
                             "allowed: a finite number of seconds > 0.")
        structured_outputs_options(self.structured_outputs_config)

    def _validate_parallel(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            _positive(name, getattr(self, name))
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} does not split evenly over nnodes={self.nnodes}; "
                "use a tensor_parallel_size that is a multiple of nnodes (the same number of ranks on every node)."
            )
        if self.node_rank != 0:
            raise ValueError(
                f"node_rank={self.node_rank}: the engine (with its server) runs on node 0; start the other nodes "
                "with `pagellm worker --node-rank K`."
            )
        if self.master_port is not None and not (isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            raise ValueError(f"master_port={self.master_port!r} is out of range; allowed: 1..65535.")
        if self.nnodes > 1 and (self.master_addr is None or self.master_port is None):
            raise ValueError(
                f"nnodes={self.nnodes} needs master_addr and master_port: the address of this host that the other "
                "nodes can reach, and a free port on it."
            )
        if not self.kv_prefault_seconds >= 0:
            raise ValueError(f"kv_prefault_seconds={self.kv_prefault_seconds!r} is out of range; allowed: >= 0 seconds "
                             "(0: fault the KV pool in on first use, inf: all of it at start-up).")
        if not self.distributed_timeout_seconds > 0:
            raise ValueError(f"distributed_timeout_seconds={self.distributed_timeout_seconds!r} is out of range; "
                             "allowed: > 0 seconds.")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is out of range; allowed: an int >= 1.")
