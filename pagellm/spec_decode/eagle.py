"""An EAGLE-1 head over a Llama-family target (method "eagle", vLLM's EagleLlamaForCausalLM).

The head's checkpoint is a directory with a Llama config (num_hidden_layers: its decoder layers, one usually) and
tensors `fc.weight` [hidden, 2 * hidden] (and `fc.bias` where the head was trained with one), `layers.{i}.*`,
with or without a `model.` prefix. At position i it reads the target's hidden state h_i and token i + 1:

    x = fc([embed(t_{i+1}); h_i]),  out = layers(x) (its own paged cache),  logits = lm_head(out)

with the target's embedding and LM head (a copy in the head's checkpoint is left unread, as vLLM does), no input
norm in its first layer and no final norm (EAGLE's cnets.py). `out` stands for h_{i+1} when the head drafts the
token after its own draft. h_i is the target's hidden state after its final norm, as vLLM hands it over.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagellm.distributed.parallel_state import current_group
from pagellm.layers.linear import ReplicatedLinear
from pagellm.layers.rotary import RopeInputs, RotaryEmbedding
from pagellm.layers.vocab_embedding import compute_logits
from pagellm.layers.weights import weights_bytes
from pagellm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, head_dim_of
from pagellm.spec_decode.mtp import HeadError, TargetParts


def check_eagle_config(head_config, target_config, name: str) -> None:
    """Refuses, before the head's weights load, a head that cannot read this target's hidden states."""
    model_type = getattr(head_config, "model_type", None)
    if model_type != "llama":
        raise HeadError(f"speculative_config.model={name!r} has model_type={model_type!r}; method 'eagle' runs "
                        "EAGLE-1 heads of Llama decoder layers (model_type 'llama').")
    for field in ("hidden_size", "vocab_size"):
        head, target = getattr(head_config, field), getattr(target_config, field)
        if head != target:
            raise HeadError(f"speculative_config.model={name!r} has {field}={head}, the target has {field}="
                            f"{target}: an EAGLE head must be trained for this target.")
    if getattr(head_config, "add_para_norm", False):
        raise HeadError(f"speculative_config.model={name!r} sets add_para_norm (a HASS head), which pagellm does "
                        "not run; use an EAGLE-1 head.")


class EagleHead(nn.Module):
    """fc and the decoder layers of an EAGLE-1 head, over the target's embedding and LM head."""

    tied_to_embedding = False
    loads_embedding_into_head = False
    load_weights = LlamaForCausalLM.load_weights
    checkpoint_target = LlamaForCausalLM.checkpoint_target  # q/k/v and gate/up fused as in the target

    def __init__(self, config, target: LlamaForCausalLM, max_positions: int, quant_config, fc_bias: bool) -> None:
        super().__init__()
        self.config = config
        self.group = current_group()
        self.activation_dtype = torch.get_default_dtype()
        self.quant_config = quant_config
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, fc_bias, None, "fc")
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, quant_config, f"layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.target = TargetParts(target.model.embed_tokens, target.lm_head, None)

    @property
    def num_heads_per_rank(self) -> int:
        return self.layers[0].self_attn.num_heads

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    weight_format = LlamaForCausalLM.weight_format

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    @property
    def num_cache_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids, positions, kv_caches, meta, hidden_states: torch.Tensor | None = None):
        """hidden_states: the target's (or this head's previous output) at each position; None only in start-up's
        profiling forwards, which measure the activation peak (zeros then)."""
        embeds = self.target.embed_tokens(input_ids)
        if hidden_states is None:
            hidden_states = torch.zeros_like(embeds)
        x = self.fc(torch.cat([embeds, hidden_states], dim=-1))
        rope = RopeInputs(positions, *self.rotary.lookup(positions, x.dtype), self.rotary)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return compute_logits(self.target.lm_head, hidden, self.config.vocab_size)

    def weights_bytes(self) -> int:
        return weights_bytes(self)


def eagle_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The head's checkpoint tensors, named as EagleHead's parameters; its copies of the target's embedding and LM
    head, and a first-layer input norm it does not apply, left unread."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if name.startswith(("embed_tokens.", "lm_head.", "layers.0.input_layernorm.")) \
                or "rotary_emb.inv_freq" in name:
            continue
        yield name, tensor
