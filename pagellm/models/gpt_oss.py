"""gpt-oss (GptOssForCausalLM): Llama's layout with biased q/k/v/o projections, layers that alternate between a
sliding window and full attention (`layer_types`), a learned per-head attention sink, yarn rope, and in every
layer a mixture of `num_local_experts` biased experts with a clamped SwiGLU.

- Attention sinks: each head's `sinks` logit joins every query's softmax denominator and carries no value, so
  a query may give part of its attention to nothing. The attention backends take it as an optional per-layer
  tensor (attention/paged.py); under tensor parallelism a rank holds the sinks of its query heads.
- Router: a linear layer with a bias; each token takes the top-k logits, and the softmax runs over those k only.
- Experts: transformers stores gate and up interleaved in one [E, hidden, 2 * intermediate] tensor (gate at even
  columns, up at odd); they load de-interleaved into FusedMoE's w13 [E, 2 * intermediate, hidden] (gate rows then
  up rows) and down into w2 [E, hidden, intermediate], with their biases, so tensor and expert parallelism split
  them as Mixtral's experts. The activation is (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
  g = clamp(gate, max=limit) (fused_moe.ClampedSwiGLU).

Released gpt-oss checkpoints keep their experts in MXFP4 (quantization_config.quant_method "mxfp4":
`gate_up_proj_blocks`/`_scales` and `down_proj_blocks`/`_scales`, each [E, out, ...] where the float tensors are
[E, in, out], gate_up's rows interleaved as its columns are). Each expert's projections load as MXFP4_F16 blocks
of the GGUF kernels (layers/quantization/mxfp4.py), so the experts stay at 4.5 bits a weight.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.attention.paged import AttentionMetadata, paged_attention
from pagellm.layers.fused_moe import ExpertCheckpointMixin, FusedMoE, Routing, num_experts_of
from pagellm.layers.linear import ReplicatedLinear
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.quantization.gguf import GGUFWeight
from pagellm.layers.quantization.mxfp4 import mxfp4_weight
from pagellm.layers.weights import copy_checked
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# transformers' GptOssConfig defaults, for configs written before the fields existed.
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class TopKThenSoftmax(Routing):
    """gpt-oss's router: the top-k logits (transformers' sorted torch.topk, so ties fall the same way), then a
    softmax over those k."""

    def select(self, router_logits: torch.Tensor,
               correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = torch.topk(router_logits, self.top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=torch.float32), ids


class GptOssAttention(LlamaAttention):
    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__(config, layer_index, quant_config, prefix)
        # float32 whatever the model's dtype: the kernels add it to float32 softmax sums.
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        self.first_head, self.total_heads = self.qkv_proj.heads.q_start, config.num_attention_heads

    def _load_sinks(self, param: nn.Parameter, tensor: torch.Tensor, shard: object = None) -> None:
        name = getattr(param, "checkpoint_name", "sinks")
        if tuple(tensor.shape) != (self.total_heads,):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"({self.total_heads},): one sink per attention head")
        copy_checked(param.data, tensor.narrow(0, self.first_head, self.num_heads), name)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                              sliding_window=self.sliding_window, sinks=self.sinks)
        return self.o_proj(out.reshape(-1, self.q_size))


class GptOssMoeBlock(nn.Module):
    """The router (`router`, with a bias; replicated and unquantized) and the biased experts it routes to."""

    def __init__(self, config, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        num_experts, top_k = num_experts_of(config), config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, num_experts, True, None, f"{prefix}.router")
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, config.intermediate_size, "swigluoai",
                                quant_config, f"{prefix}.experts", TopKThenSoftmax(top_k), has_bias=True,
                                swiglu_alpha=float(getattr(config, "swiglu_alpha", DEFAULT_SWIGLU_ALPHA)),
                                swiglu_limit=float(getattr(config, "swiglu_limit", DEFAULT_SWIGLU_LIMIT)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router(hidden))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention

    def make_mlp(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        return GptOssMoeBlock(config, quant_config, prefix)


class GptOssModel(LlamaModel):
    decoder_layer_class = GptOssDecoderLayer


# transformers' stacked expert tensors: name suffix -> per expert, (projection, tensor kind) and how to take it
# from expert e's slice. gate_up holds gate at even and up at odd columns of [hidden, 2 * intermediate].
_STACKED_EXPERTS = {
    "gate_up_proj": (("gate_proj", "weight", lambda t: t[:, 0::2].t()),
                     ("up_proj", "weight", lambda t: t[:, 1::2].t())),
    "gate_up_proj_bias": (("gate_proj", "bias", lambda t: t[0::2]), ("up_proj", "bias", lambda t: t[1::2])),
    "down_proj": (("down_proj", "weight", lambda t: t.t()),),
    "down_proj_bias": (("down_proj", "bias", lambda t: t),),
}


_MXFP4_PARTS = ("blocks", "scales")
# An MXFP4 projection's rows [out] per expert: (projection, rows) to take, gate at even and up at odd rows.
_MXFP4_EXPERTS = {"gate_up_proj": (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))),
                  "down_proj": (("down_proj", slice(None)),)}


def per_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each stacked `...experts.gate_up_proj[_bias]` / `down_proj[_bias]` split into
    one tensor per expert and projection (`...experts.3.up_proj.weight` [intermediate, hidden]), as FusedMoE
    loads them: views of the stacked tensor, no copies. An MXFP4 projection's blocks and scales (which may come
    apart in the file) become each expert's MXFP4_F16 blocks once both have been read."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        layer, _, suffix = name.rpartition(".")
        proj, _, part = suffix.rpartition("_")
        if not layer.endswith(".experts"):
            yield name, tensor
        elif suffix in _STACKED_EXPERTS:
            for expert in range(tensor.shape[0]):
                yield from _expert_tensors(layer, suffix, expert, tensor[expert])
        elif proj in _MXFP4_EXPERTS and part in _MXFP4_PARTS:
            parts = pending.setdefault(f"{layer}.{proj}", {})
            parts[part] = tensor
            if len(parts) == len(_MXFP4_PARTS):
                del pending[f"{layer}.{proj}"]
                yield from _mxfp4_expert_tensors(layer, proj, parts["blocks"], parts["scales"])
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"MXFP4 checkpoint: {sorted(pending)} have blocks or scales but not both "
                         f"({[sorted(parts) for parts in pending.values()]} found)")


def _mxfp4_expert_tensors(layer: str, proj: str, blocks: torch.Tensor,
                          scales: torch.Tensor) -> Iterator[tuple[str, GGUFWeight]]:
    """Each expert's projections of stacked MXFP4 `proj` (blocks [E, out, groups, 16], scales [E, out, groups])
    as MXFP4_F16 blocks, converted one expert at a time."""
    if blocks.dim() != 4 or scales.dim() != 3:
        raise ValueError(f"{layer}.{proj}_blocks {tuple(blocks.shape)} and _scales {tuple(scales.shape)}: expected "
                         "[experts, out, groups, 16] and [experts, out, groups]")
    for expert in range(blocks.shape[0]):
        for target, rows in _MXFP4_EXPERTS[proj]:
            name = f"{layer}.{expert}.{target}.weight"
            yield name, mxfp4_weight(blocks[expert, rows], scales[expert, rows], name)


def _expert_tensors(layer: str, suffix: str, expert: int, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert `expert`'s tensors of stacked `suffix`, from its slice `tensor` in the float checkpoint's layout."""
    for proj, kind, take in _STACKED_EXPERTS[suffix]:
        yield f"{layer}.{expert}.{proj}.{kind}", take(tensor)


class GptOssForCausalLM(ExpertCheckpointMixin, LlamaForCausalLM):
    model_class = GptOssModel

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(per_expert_tensors(weights))
