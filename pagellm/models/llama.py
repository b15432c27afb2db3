"""The Llama architecture (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Parameter names follow HuggingFace's, except that q/k/v and gate/up are fused into one matmul each;
`load_weights` maps the checkpoint's separate tensors onto the fused ones.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.native import CpuOps, LinearBF16, linear_bf16
from pagellm.attention.paged import AttentionMetadata, paged_attention
from pagellm.cpu_features import cpu_flags, cpu_has_native
from pagellm.distributed.parallel_state import TensorParallelGroup, current_group, tp_rank, tp_size
from pagellm.models.sliding_window import layer_sliding_window

# (fused parameter, checkpoint shard name, shard index)
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class Linear(nn.Linear):
    """nn.Linear that, on CPU in float32 or (where the CPU has bf16 instructions) bfloat16, also keeps its
    weight packed into oneDNN's blocked layout.

    float32 on AVX2 CPUs: no one CPU GEMM wins at every row count on this model's shapes. On a 2-core AMD
    EPYC with avx2 only (no avx512f), one thread, oneDNN on a pre-packed weight beat F.linear (MKL) 2.6x at
    4 rows, 1.6x at 16 and 1.25x at 64 (decode batches); MKL on the plain weight beat oneDNN by 7% at 1024
    rows and 12% at 2048 (prefill). So both are kept, at the cost of holding the linear weights twice, and
    each call takes the faster one for its row count.
    float32 on AVX-512 CPUs, and bfloat16: on a 2-core AMD EPYC with avx2 avx512f avx512_bf16, the packed
    weight won at every shape and row count from 1 to 2048 (benchmarks/cpu_gemm.py), so only it is kept and
    the plain copy is freed (where no other module shares it: a tied LM head's weight is the embedding table).
    bfloat16 where the native kernels have avx512_bf16's dot product: the weight is packed for pagellm's own
    kernel (linear_bf16.c), which beat oneDNN's packed weight at every row count there; oneDNN elsewhere.
    """

    # Row count from which MKL on the plain weight is at least as fast as oneDNN (they tie at 512), in
    # float32 on CPUs without AVX-512; None where the packed weight is the only copy.
    plain_min_rows: int | None = None
    FLOAT32_PLAIN_MIN_ROWS = 512
    packed_weight: torch.Tensor | None = None
    # Set where packed_weight is in pagellm's own bfloat16 layout (linear_bf16.c), not oneDNN's.
    packed_kernel: LinearBF16 | None = None
    # Set on CPUs without instructions for the model's half type, where torch emulates half matmuls (~20
    # GFLOP/s against ~170 in float32 on a 2-core AMD EPYC with avx2 only): operands are widened to float32
    # per call and the result rounded back, the arithmetic of a half GEMM with float32 accumulation, while
    # the weights stay half in memory.
    upcast_to: torch.dtype | None = None
    # Shared by all layers of a model (they run one at a time): widening into a fresh tensor each call
    # would fault in new pages every time (113 MB for this model's lm_head).
    upcast_buffer: torch.Tensor | None = None

    def pack_for_cpu(self, free_plain: bool) -> None:
        """Pack the weight for pagellm's bf16 kernel where it has one for this shape, else for oneDNN; with
        `free_plain` (the weight is not shared), drop the plain copy where the packed one serves every row count."""
        kernel = linear_bf16() if self.weight.dtype == torch.bfloat16 else None
        if kernel is not None and kernel.supports(self.in_features, self.out_features):
            self.packed_weight, self.packed_kernel = kernel.pack(self.weight.detach()), kernel
        else:
            # The layout oneDNN picks depends a little on the row count it is told to expect; 64 did best
            # across 4..2048 rows in a sweep.
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64)
        if self.weight.dtype == torch.float32 and "avx512f" not in cpu_flags():
            self.plain_min_rows = self.FLOAT32_PLAIN_MIN_ROWS
        elif free_plain:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast_to is not None:
            weight = self.upcast_buffer[: self.weight.numel()].view(self.weight.shape)
            weight.copy_(self.weight)
            bias = self.bias.to(self.upcast_to) if self.bias is not None else None
            return F.linear(x.to(self.upcast_to), weight, bias).to(x.dtype)
        if self.packed_weight is None or (self.plain_min_rows is not None and x.shape[0] >= self.plain_min_rows):
            return F.linear(x, self.weight, self.bias)
        if self.packed_kernel is not None:
            return self.packed_kernel(x, self.packed_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class RowParallelLinear(Linear):
    """A linear layer whose input features are split across the tensor-parallel ranks: each computes a
    partial product over its slice, and one all-reduce sums them. Only rank 0 holds the real bias (the
    others hold zeros), so that the sum adds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


def can_pack_for_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN-packed weights in float32 everywhere, and in bfloat16 where the CPU has bf16 instructions
    (elsewhere Linear.upcast_to widens half weights to float32 instead)."""
    packable = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native(dtype))
    return device.type == "cpu" and packable and torch.backends.mkldnn.is_available()


class RMSNorm(nn.Module):
    # The fused kernels (CPU, float32 or bfloat16) when the model runs on them; else torch ops.
    ops: CpuOps | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(x + residual), x + residual)."""
        if self.ops is not None:
            out = self.ops.add_rms_norm(x, residual, self.weight, self.eps)  # adds into residual in place
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics whatever the weights' dtype, as the reference implementation computes them.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_positions, computed once; looked up by position."""

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.inv_freq, self.scaling = _rope_inv_freq(config, head_dim, layer_type)
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)

    def reset_cache(self, device: torch.device) -> None:
        """Fill cos/sin in fp32 (the model may be built on the meta device, which holds no values)."""
        positions = torch.arange(self.max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.scaling).to(device)
        self.sin = (emb.sin() * self.scaling).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, 1, head_dim] of the step's positions: once per step, shared by all layers."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


@dataclass
class RopeInputs:
    positions: torch.Tensor
    # The torch path's cos/sin [tokens, 1, head_dim] (RotaryEmbedding.lookup); None when the native
    # kernel rotates in place, reading the whole tables by position.
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    tables: RotaryEmbedding


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_inv_freq(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq and cos/sin scaling; `layer_type` picks one entry of a config whose rope_parameters are keyed
    by layer type (Gemma 3: "sliding_attention" and "full_attention" layers rotate with different bases)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type='dynamic' rescales with the sequence length, which a paged cache cannot do; "
            "use a model with default, linear, llama3 or yarn RoPE."
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    # Some of these create tensors without a device, which the model's meta-device construction would catch.
    with torch.device("cpu"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one tensor-parallel rank holds: query heads [q_start, q_start + num_q) and
    KV heads [kv_start, kv_start + num_kv). With more ranks than KV heads, each KV head is held by
    size // num_key_value_heads ranks (replicated, as vLLM does), each rank holding one."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def head_shard(config, rank: int, size: int) -> HeadShard:
    num_q = config.num_attention_heads // size
    total_kv = config.num_key_value_heads
    if total_kv >= size:
        num_kv = total_kv // size
        return HeadShard(rank * num_q, num_q, rank * num_kv, num_kv)
    return HeadShard(rank * num_q, num_q, rank // (size // total_kv), 1)


def allowed_tensor_parallel_sizes(config) -> list[int]:
    """Sizes that split query heads and the MLP evenly, and KV heads evenly or by whole replication."""
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    return [n for n in range(1, heads + 1)
            if heads % n == 0 and inter % n == 0 and (kv % n == 0 or n % kv == 0)]


def check_tensor_parallel_size(config, size: int) -> None:
    allowed = allowed_tensor_parallel_sizes(config)
    if size not in allowed:
        raise ValueError(
            f"tensor_parallel_size={size} cannot split this model (num_attention_heads="
            f"{config.num_attention_heads}, num_key_value_heads={config.num_key_value_heads}, intermediate_size="
            f"{config.intermediate_size}): each rank needs whole query heads, an equal share of the MLP, and KV "
            f"heads split evenly or replicated whole; allowed sizes: {allowed}."
        )


class LlamaAttention(nn.Module):
    ops: CpuOps | None = None

    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        # Column-parallel q/k/v (this rank's heads), row-parallel o_proj (Megatron's split).
        self.shard = head_shard(config, tp_rank(), tp_size())
        self.num_heads = self.shard.num_q
        self.num_kv_heads = self.shard.num_kv
        self.head_dim = head_dim_of(config)
        self.layer_index = layer_index
        bias = bool(getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False))
        if getattr(config, "model_type", "") == "qwen2":
            bias = True
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, o_bias, current_group())
        self.scale = self.head_dim**-0.5
        self.sliding_window = layer_sliding_window(config, layer_index)

    def forward(
        self,
        rope: RopeInputs,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.ops is not None:
            # Query and key heads lead each row of qkv: rotate them where they are.
            self.ops.rotary_inplace(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope.tables.cos,
                                    rope.tables.sin, rope.positions)
        q, k, v = self.split_heads(qkv)
        if self.ops is None:
            q, k = apply_rotary(q, k, (rope.cos, rope.sin))
        return self.attend(q, k, v, kv_cache, meta)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q + 2 kv] -> views q [T, heads, head_dim], k and v [T, kv_heads, head_dim]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """Paged attention of this step's rotated q/k and v, through this layer's window, then o_proj."""
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                              sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    ops: CpuOps | None = None
    # What `hidden_act` this MLP computes; a family with another activation subclasses with its own.
    activations: tuple[str, ...] = ("silu",)

    def __init__(self, config) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        # This rank's share of the intermediate features: gate/up split by columns, down_proj by rows.
        self.intermediate_size = config.intermediate_size // tp_size()
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(self.intermediate_size, config.hidden_size, bias, current_group())
        self.check_activation(config)

    def check_activation(self, config) -> None:
        if getattr(config, "hidden_act", "silu") not in self.activations:
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; {type(self).__name__} computes "
                             f"{' or '.join(self.activations)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    # Families whose attention or MLP differ (pagellm/models/qwen3.py, ...) swap these in a subclass.
    attention_class: type[LlamaAttention] = LlamaAttention
    mlp_class: type[LlamaMLP] = LlamaMLP

    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_index)
        self.mlp = self.mlp_class(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, residual, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels beside the layer's output, so each norm can add it in (fused)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    # With the fused kernels, rotary runs in place per layer and needs no per-step cos/sin gather.
    ops: CpuOps | None = None
    decoder_layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = self.make_rotary(config, max_positions)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_rotary(self, config, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(config, head_dim_of(config), max_positions)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Runs as many layers as `kv_caches` has entries (all of them, except in profiling runs)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        cos, sin = (None, None) if self.ops is not None else self.rotary.lookup(positions, hidden.dtype)
        rope = RopeInputs(positions, cos, sin, self.rotary)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


LM_HEAD_MODES = ("replicated", "vocab_parallel")


def lm_head_mode() -> str:
    """How the LM head runs under tensor parallelism (PAGELLM_TP_LM_HEAD): "vocab_parallel", each rank
    computing the logits of its slice of the vocabulary and rank 0 gathering them, or "replicated", rank 0
    alone running the whole head. README ("Tensor parallelism") has the measurement behind the default."""
    mode = os.environ.get("PAGELLM_TP_LM_HEAD", "replicated")
    if mode not in LM_HEAD_MODES:
        raise ValueError(f"PAGELLM_TP_LM_HEAD={mode!r} is not a mode; use one of {LM_HEAD_MODES}.")
    return mode


class LlamaForCausalLM(nn.Module):
    """Built for the tensor-parallel group current at construction (see parallel_state.building_with):
    this rank's heads and MLP share; the embedding replicated; the LM head replicated or split by vocab.
    Other families subclass it (pagellm/models/registry.py lists them) and swap `model_class`."""

    model_class: type[nn.Module] = LlamaModel

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.group = current_group()
        self.model = self.model_class(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.split_lm_head = self.group.size > 1 and lm_head_mode() == "vocab_parallel"
        # Rows of the LM head on this rank: a ceil share of the vocabulary (the last rank's tail is padding);
        # replicated, only rank 0 holds it (the others compute no logits and hold an empty head).
        if self.split_lm_head:
            self.vocab_shard = -(-config.vocab_size // self.group.size)
        else:
            self.vocab_shard = config.vocab_size if self.group.rank == 0 else 0
        self.lm_head = Linear(config.hidden_size, self.vocab_shard, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the LM head the embedding where they are one tensor (a vocab-split head holds a copy of its slice)."""
        if self.tie_word_embeddings and not self.split_lm_head and self.vocab_shard:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.num_heads

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def use_cpu_ops(self, ops: CpuOps) -> None:
        """Run norms, rotary and SiLU-and-multiply on the fused CPU kernels (float32 or bfloat16)."""
        for module in self.modules():
            if isinstance(module, (LlamaModel, RMSNorm, LlamaAttention, LlamaMLP)):
                module.ops = ops

    def pack_for_cpu(self) -> None:
        """Run every linear layer on oneDNN-packed weights (call after load_weights; see Linear)."""
        uses = collections.Counter(id(param) for _, param in self.named_parameters(remove_duplicate=False))
        for module in self.modules():
            if isinstance(module, Linear) and module.weight.numel():
                module.pack_for_cpu(free_plain=uses[id(module.weight)] == 1)

    def upcast_linear_layers(self, dtype: torch.dtype) -> None:
        """Run linear layers in `dtype` (float32) on half weights; see Linear.upcast_to."""
        layers = [module for module in self.modules() if isinstance(module, Linear)]
        buffer = torch.empty(max(layer.weight.numel() for layer in layers), dtype=dtype,
                             device=layers[0].weight.device)
        for layer in layers:
            layer.upcast_to, layer.upcast_buffer = dtype, buffer

    def weights_bytes(self) -> int:
        packed = [m.packed_weight for m in self.modules() if isinstance(m, Linear) and m.packed_weight is not None]
        tensors = list(self.parameters()) + packed
        return sum(t.numel() * t.element_size() for t in tensors)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] in float32 on rank 0; None on the other tensor-parallel ranks."""
        if self.split_lm_head:
            logits = self.group.gather_to_first(self.lm_head(hidden))
            return None if logits is None else logits[:, : self.config.vocab_size].float()
        if self.group.rank != 0:
            return None
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in; every parameter must be covered, no tensor may be left over."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, shard = _fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if self.split_lm_head and self.tie_word_embeddings and target == "model.embed_tokens.weight":
                self._load_lm_head_shard(params["lm_head.weight"], tensor, name)
            if target == "lm_head.weight" and (self.split_lm_head or not self.vocab_shard):
                if self.vocab_shard:
                    self._load_lm_head_shard(params[target], tensor, name)
                loaded.add(target)
                continue
            param = params[target]
            tensor = self._rank_slice(target, shard, tensor)
            if shard is None:
                _copy_checked(param, tensor, name)
            else:
                _copy_checked(param.narrow(0, *self._shard_range(target, shard)), tensor, name)
            loaded.add(f"{target}#{shard}" if shard is not None else target)
        expected = self._expected_loads(params)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _rank_slice(self, target: str, shard: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a full checkpoint tensor that this tensor-parallel rank holds."""
        if self.group.size == 1:
            return tensor
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        head_dim, rank = attn.head_dim, self.group.rank
        if "qkv_proj" in target:
            heads = attn.shard
            start, count = (heads.q_start, heads.num_q) if shard == 0 else (heads.kv_start, heads.num_kv)
            return tensor.narrow(0, start * head_dim, count * head_dim)
        if "gate_up_proj" in target:
            return tensor.narrow(0, rank * mlp.intermediate_size, mlp.intermediate_size)
        if target.endswith("o_proj.weight"):
            return tensor.narrow(1, attn.shard.q_start * head_dim, attn.q_size)
        if target.endswith("down_proj.weight"):
            return tensor.narrow(1, rank * mlp.intermediate_size, mlp.intermediate_size)
        if target.endswith(("o_proj.bias", "down_proj.bias")) and rank != 0:
            return torch.zeros_like(tensor)  # the all-reduce adds rank 0's bias once
        return tensor

    def _load_lm_head_shard(self, param: torch.Tensor, full: torch.Tensor, name: str) -> None:
        start = self.group.rank * self.vocab_shard
        rows = max(0, min(self.vocab_shard, full.shape[0] - start))
        param.zero_()  # padding rows past the vocabulary give logits that the gather trims off
        _copy_checked(param.narrow(0, 0, rows), full.narrow(0, start, rows), name)

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        layer = self.model.layers[0]
        if "qkv_proj" in target:
            attn = layer.self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [layer.mlp.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]

    def _expected_loads(self, params: dict[str, nn.Parameter]) -> set[str]:
        expected = set()
        for name in params:
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            if "qkv_proj" in name:
                expected.update(f"{name}#{i}" for i in range(3))
            elif "gate_up_proj" in name:
                expected.update(f"{name}#{i}" for i in range(2))
            else:
                expected.add(name)
        return expected


def _fused_target(name: str) -> tuple[str, int | None]:
    for fused, shard_name, shard in _STACKED_PARAMS:
        if f".{shard_name}." in name:
            return name.replace(f".{shard_name}.", f".{fused}."), shard
    return name, None


def _copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.copy_(tensor)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
