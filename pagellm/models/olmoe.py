"""OLMoE (OlmoeForCausalLM): Llama's layout with an RMSNorm over the whole query and the whole key projection
(all heads together, not per head), optional clipping of q/k/v to [-clip_qkv, clip_qkv], and in every layer
`num_experts` experts routed by softmax top-k (renormalised when `norm_topk_prob`).

Under tensor parallelism a rank holds some heads, so the norms' mean square is summed over the ranks (one small
all-reduce each) and each rank scales its own heads by its slice of the norm weight. Where KV heads are
replicated, each is counted once per rank holding it, on both sides of the mean, which leaves it exact.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.paged import AttentionMetadata
from pagellm.distributed.parallel_state import TensorParallelGroup, current_group
from pagellm.layers.fused_moe import ExpertCheckpointMixin, SparseMoeBlock
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.rotary import RopeInputs, apply_rotary
from pagellm.layers.weights import copy_checked
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class ShardedRMSNorm(nn.Module):
    """RMSNorm over features split across the tensor-parallel ranks: this rank holds `size` of them, from
    `start` of the checkpoint's `total`."""

    def __init__(self, size: int, start: int, total: int, eps: float, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = self._load
        self.start, self.total, self.eps, self.group = start, total, eps, group

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard: object = None) -> None:
        if tensor.shape != (self.total,):
            raise ValueError(f"checkpoint tensor {getattr(param, 'checkpoint_name', '?')!r} has shape "
                             f"{tuple(tensor.shape)}, expected ({self.total},)")
        copy_checked(param.data, tensor.narrow(0, self.start, param.shape[0]), param.checkpoint_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        square_sum = x32.pow(2).sum(-1, keepdim=True)
        if self.group.size > 1:
            square_sum = self.group.all_reduce(square_sum)
        mean = square_sum / (x.shape[-1] * self.group.size)
        return self.weight * (x32 * torch.rsqrt(mean + self.eps)).to(x.dtype)


class OlmoeAttention(LlamaAttention):
    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__(config, layer_index, quant_config, prefix)
        group, heads = current_group(), self.qkv_proj.heads
        eps = config.rms_norm_eps
        self.q_norm = ShardedRMSNorm(self.q_size, heads.q_start * self.head_dim,
                                     config.num_attention_heads * self.head_dim, eps, group)
        self.k_norm = ShardedRMSNorm(self.kv_size, heads.kv_start * self.head_dim,
                                     config.num_key_value_heads * self.head_dim, eps, group)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        tokens = q.shape[0]
        if self.ops is None:
            q, k = apply_rotary(q.view(tokens, self.num_heads, self.head_dim),
                                k.view(tokens, self.num_kv_heads, self.head_dim), (rope.cos, rope.sin))
        else:
            # The kernel rotates the heads leading each row of a contiguous buffer.
            qk = torch.cat((q, k), dim=-1)
            self.ops.rotary_inplace(qk, self.num_heads + self.num_kv_heads, self.head_dim, rope.tables.cos,
                                    rope.tables.sin, rope.positions)
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q, k = q.view(tokens, self.num_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        return self.attend(q, k, v, kv_cache, meta)


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = OlmoeAttention

    def make_mlp(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        return SparseMoeBlock.from_config(config, config.intermediate_size, quant_config, prefix)


class OlmoeModel(LlamaModel):
    decoder_layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(ExpertCheckpointMixin, LlamaForCausalLM):
    model_class = OlmoeModel
