"""Mixtral (MixtralForCausalLM): Llama's (Mistral's) attention, and in every layer a mixture of
`num_local_experts` gated-SiLU experts of `intermediate_size` features, each token routed to
`num_experts_per_tok` of them by softmax top-k with the chosen weights renormalised.

Checkpoints name the block `block_sparse_moe` and its experts' tensors `experts.N.w1/w2/w3`; they load into the
layer's FusedMoE (pagellm/layers/fused_moe.py), which also says how tensor parallelism splits the experts.
"""

from __future__ import annotations

from torch import nn

from pagellm.layers.fused_moe import MIXTRAL_EXPERT_NAMES, ExpertCheckpointMixin, SparseMoeBlock
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        return SparseMoeBlock.from_config(config, config.intermediate_size, quant_config, prefix, renormalize=True,
                                          checkpoint_names=MIXTRAL_EXPERT_NAMES)


class MixtralModel(LlamaModel):
    decoder_layer_class = MixtralDecoderLayer


class MixtralForCausalLM(ExpertCheckpointMixin, LlamaForCausalLM):
    model_class = MixtralModel
    moe_block_names = ("block_sparse_moe",)
