"""Phi-3 (Phi3ForCausalLM; Phi-3, Phi-3.5 and Phi-4-mini checkpoints): Llama's maths, with
- q/k/v and gate/up stored fused in the checkpoint (`qkv_proj`, `gate_up_proj`): the fused layers load them
  whole, each rank taking its heads and MLP share as for Llama;
- partial rotary (`partial_rotary_factor` < 1): only the first rotary_dim features of each head rotate;
- LongRoPE (`rope_type` "longrope"): two sets of frequency factors, short and long.

Which LongRoPE set: transformers rotates a sequence with the short factors while it is at most
original_max_position_embeddings long, and with the long ones from then on, for all of its positions: when
generation crosses that length, its Phi-3 drops the KV cache and recomputes the whole sequence with the long
factors. A paged cache cannot re-rotate keys it holds, so, as vLLM does, the set is fixed per engine by
max_model_len: the short factors when max_model_len <= original_max_position_embeddings (then every sequence
equals transformers'), the long ones otherwise (then every sequence longer than original_max_position_embeddings
equals transformers', and shorter ones see the long factors where transformers uses the short). Serve with
max_model_len=original_max_position_embeddings (4096 for Phi-3.5-mini) for short-context fidelity.

Runs on the fused CPU kernels as Llama does, except with partial rotary, where q/k rotate in torch.
"""

from __future__ import annotations

import torch

from pagellm.attention.paged import AttentionMetadata
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.rotary import RopeInputs, RotaryEmbedding, apply_rotary
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, head_dim_of
from pagellm.ops.cpu_ops import CpuOps


def _rope_parameters(config) -> dict:
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def rotary_dim_of(config) -> int:
    factor = _rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim_of(config) * factor)


class Phi3RotaryEmbedding(RotaryEmbedding):
    """cos/sin of the first rotary_dim features; with LongRoPE, from the factor set that max_positions
    (max_model_len) calls for (see the module docstring)."""

    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, rotary_dim_of(config), max_positions)
        params = _rope_parameters(config)
        if params.get("rope_type", params.get("type")) == "longrope":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            # What transformers computes for a sequence of max_positions tokens (the short factors up to
            # original_max_position_embeddings); the attention factor is the same for both sets.
            with torch.device("cpu"):
                inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=max_positions)
            self.inv_freq = inv_freq.float()


class Phi3Attention(LlamaAttention):
    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__(config, layer_index, quant_config, prefix)
        self.rotary_dim = rotary_dim_of(config)

    def forward(
        self,
        rope: RopeInputs,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return super().forward(rope, hidden, kv_cache, meta)
        q, k, v = self.split_heads(self.qkv_proj(hidden))
        rotated_q, rotated_k = apply_rotary(q[..., : self.rotary_dim], k[..., : self.rotary_dim], (rope.cos, rope.sin))
        q = torch.cat((rotated_q, q[..., self.rotary_dim:]), dim=-1)
        k = torch.cat((rotated_k, k[..., self.rotary_dim:]), dim=-1)
        return self.attend(q, k, v, kv_cache, meta)


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_class = Phi3Attention


class Phi3Model(LlamaModel):
    decoder_layer_class = Phi3DecoderLayer

    def make_rotary(self, config, max_positions: int) -> RotaryEmbedding:
        return Phi3RotaryEmbedding(config, max_positions)


class Phi3ForCausalLM(LlamaForCausalLM):
    model_class = Phi3Model

    def use_cpu_ops(self, ops: CpuOps) -> None:
        super().use_cpu_ops(ops)
        if rotary_dim_of(self.config) != head_dim_of(self.config):
            # The fused rotary turns whole heads; partial rotary runs in torch, which needs the per-step cos/sin.
            self.model.ops = None
            for layer in self.model.layers:
                layer.self_attn.ops = None
