"""Qwen3 (Qwen3ForCausalLM): Llama's layout plus an RMSNorm over each query and key head before rotary,
with no q/k/v bias and head_dim taken from the config (it is not hidden_size / heads in Qwen3).

Everything else is Llama's, fused CPU kernels included: the per-head norms run on the same fused RMSNorm
(over [tokens * heads, head_dim] rows), and the normed q/k rotate in place with the same rotary kernel.
Tensor parallelism shards as Llama does: a rank holds whole heads, and the per-head norm weight is shared
by all heads, so every rank holds all of it.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.paged import AttentionMetadata
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.rotary import RopeInputs, apply_rotary
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagellm.ops.cpu_ops import CpuOps


class Qwen3Attention(LlamaAttention):
    # The per-head norm; Gemma 3, whose attention is this one with its own norm, swaps it.
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__(config, layer_index, quant_config, prefix)
        self.q_norm = self.norm_class(self.head_dim, config.rms_norm_eps)
        self.k_norm = self.norm_class(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        rope: RopeInputs,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.split_heads(self.qkv_proj(hidden))
        # Rows of one head each: the norm's weight spans one head.
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        if self.ops is None:
            q, k = apply_rotary(q, k, (rope.cos, rope.sin))
        else:
            # The kernel rotates the query and key heads leading each row: put the normed heads in such rows.
            tokens = q.shape[0]
            qk = torch.cat((q.view(tokens, self.q_size), k.view(tokens, self.kv_size)), dim=-1)
            self.ops.rotary_inplace(qk, self.num_heads + self.num_kv_heads, self.head_dim, rope.tables.cos,
                                    rope.tables.sin, rope.positions)
            rotated_q, rotated_k = qk.split([self.q_size, self.kv_size], dim=-1)
            q, k = rotated_q.view(q.shape), rotated_k.view(k.shape)
        return self.attend(q, k, v, kv_cache, meta)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_class = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_class = Qwen3Model

    def use_cpu_ops(self, ops: CpuOps) -> None:
        super().use_cpu_ops(ops)
        head_dim = self.model.layers[0].self_attn.head_dim
        if not CpuOps.supports(head_dim, head_dim):
            # The fused norm takes rows whose width is a multiple of 8; the per-head norms then run in torch.
            for layer in self.model.layers:
                layer.self_attn.q_norm.ops = layer.self_attn.k_norm.ops = None
