"""Qwen3-MoE (Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B): Qwen3's attention (an RMSNorm over each query and key
head), and mixture-of-experts MLPs: `num_experts` experts of `moe_intermediate_size` features, each token
routed to `num_experts_per_tok` by softmax top-k, renormalised when `norm_topk_prob`.

Layer i holds experts when it is not in `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`
(transformers' rule); the other layers hold a dense MLP of `intermediate_size` features.
"""

from __future__ import annotations

from torch import nn

from pagellm.layers.fused_moe import ExpertCheckpointMixin, SparseMoeBlock, num_experts_of
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model


def is_sparse_layer(config, layer_index: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts_of(config) > 0 and (layer_index + 1) % step == 0)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return super().make_mlp(config, layer_index, quant_config, prefix)
        return SparseMoeBlock.from_config(config, config.moe_intermediate_size, quant_config, prefix)


class Qwen3MoeModel(Qwen3Model):
    decoder_layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(ExpertCheckpointMixin, Qwen3ForCausalLM):
    model_class = Qwen3MoeModel
