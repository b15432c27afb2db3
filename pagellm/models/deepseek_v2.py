"""DeepSeek-V2 and DeepSeek-V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM) over a paged latent cache.

The graph is Llama's (pre-norm residual blocks, final norm, LM head) with multi-head latent attention
(layers/mla.py: the cache holds one latent row per token and layer) and, from layer `first_k_dense_replace`
on, a mixture-of-experts MLP: routed experts plus `n_shared_experts` shared ones (an MLP of
moe_intermediate_size * n_shared_experts) added to every token; the routed experts are layers/fused_moe.py's
FusedMoE. V2's router is softmax top-k ("greedy" or "group_limited_greedy"); V3 is the same graph with sigmoid
router scores, an e_score_correction_bias and grouped top-k (fused_moe.Routing.deepseek_v2/_v3).

Under tensor parallelism the attention splits by heads with the latent replicated (layers/mla.py), the dense and
shared-expert MLPs by features, and the routed experts by features or, with expert parallelism, whole experts
per rank (layers/fused_moe.py).

Parameter names follow HuggingFace's; gate/up are fused as in Llama. Tensors of layers past num_hidden_layers
(DeepSeek-V3's multi-token-prediction layer) are skipped here: speculative_config's "mtp" method loads them into
a head of their own (spec_decode/mtp.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.layers.activation import SiluAndMul, gated_activation
from pagellm.layers.fused_moe import ExpertCheckpointMixin, FusedMoE, Routing
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagellm.layers.mla import MLAAttention
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.rotary import RopeInputs, RotaryEmbedding
from pagellm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from pagellm.ops.cpu_ops import CpuOps


class DeepseekMLP(nn.Module):
    """A gated MLP of `intermediate_size` features: the dense layers' (intermediate_size) and the shared
    experts' (moe_intermediate_size * n_shared_experts)."""

    def __init__(self, config, intermediate_size: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2, bias,
                                                       quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias, quant_config,
                                           f"{prefix}.down_proj")
        self.act_fn = gated_activation(getattr(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def is_moe_layer(config, layer_index: int) -> bool:
    """Whether layer `layer_index` has routed experts (transformers' rule: from first_k_dense_replace on)."""
    return layer_index >= (getattr(config, "first_k_dense_replace", 0) or 0) and bool(
        getattr(config, "n_routed_experts", None))


class DeepseekGate(nn.Module):
    """The router's weight [experts, hidden] in float32 whatever the model's dtype, and logits computed in
    float32: transformers keeps DeepSeek's gate.weight in float32 (_keep_in_fp32_modules_strict), and a
    bfloat16 product would choose other experts on near-ties."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.weight)


class DeepseekMoE(nn.Module):
    """The router (`gate`, float32 and replicated), the routed experts and the shared ones, which every token
    passes through beside its routed experts. DeepSeek-V3's gate scores by sigmoid and chooses with an
    e_score_correction_bias (checkpoint name mlp.gate.e_score_correction_bias; held by the experts' layer)."""

    def __init__(self, config, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        num_experts, top_k = config.n_routed_experts, config.num_experts_per_tok
        v3 = getattr(config, "model_type", "") == "deepseek_v3"
        routing = Routing.deepseek_v3(config) if v3 else Routing.deepseek_v2(config)
        self.gate = DeepseekGate(config.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, config.moe_intermediate_size,
                                getattr(config, "hidden_act", "silu"), quant_config, f"{prefix}.experts", routing,
                                has_correction_bias=v3)
        shared = getattr(config, "n_shared_experts", 0) or 0
        self.shared_experts = (DeepseekMLP(config, config.moe_intermediate_size * shared, quant_config,
                                           f"{prefix}.shared_experts") if shared else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        nn.Module.__init__(self)
        self.self_attn = MLAAttention(config, layer_index, quant_config, f"{prefix}.self_attn")
        if is_moe_layer(config, layer_index):
            self.mlp = DeepseekMoE(config, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = DeepseekMLP(config, config.intermediate_size, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2Model(LlamaModel):
    decoder_layer_class = DeepseekV2DecoderLayer

    def make_rotary(self, config, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(config, config.qk_rope_head_dim, max_positions)

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """The step's cos/sin, always: MLA rotates its rope parts in torch (they are not the leading heads of a
        fused q/k/v row that the in-place kernel rotates)."""
        return RopeInputs(positions, *self.rotary.lookup(positions, dtype), self.rotary)


class DeepseekV2ForCausalLM(ExpertCheckpointMixin, LlamaForCausalLM):
    model_class = DeepseekV2Model

    def use_cpu_ops(self, ops: CpuOps) -> None:
        """The fused norms and SiLU-and-multiply; rotary stays in torch (see DeepseekV2Model.forward)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, SiluAndMul)):
                module.ops = ops

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """Per-expert tensors into the stacked experts (ExpertCheckpointMixin), gate/up into the fused MLPs; MLA's
        q_proj is a projection of its own (not Llama's fused q/k/v)."""
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            return name.replace(".mlp.gate.", ".mlp.experts."), None
        if ".self_attn." in name:
            return name, None
        return super().checkpoint_target(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        num_layers = self.config.num_hidden_layers
        super().load_weights((name, tensor) for name, tensor in weights
                             if mtp_layer_index(name, num_layers) is None)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V2's graph; the differences (router, rope layout) are read from the config by the layers."""


def mtp_layer_index(name: str, num_layers: int) -> int | None:
    """Which multi-token-prediction layer (0 for the first) `name` belongs to: DeepSeek-V3 stores them as the
    layers past the model's; None for every other tensor. spec_decode/mtp.py loads the first one."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2]) - num_layers if int(parts[2]) >= num_layers else None
    return None
