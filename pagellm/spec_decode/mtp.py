"""DeepSeek-V3's multi-token-prediction (MTP) layer as a drafting head (method "mtp", vLLM's "deepseek_mtp").

The checkpoint keeps it as layer `num_hidden_layers` (model.layers.{L}.*): at position i it combines the target's
hidden state h_i with the embedding of token i + 1,

    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]),  out = decoder_layer(x) (MLA + MoE, its own paged cache),

and shared_head (norm, head) turns `out` into logits for token i + 2. `out` stands for h_{i+1} when the layer
drafts the token after its own draft. As in vLLM: h_i is the target's hidden state after its final norm (what
the target's forward returns), the embedding at position 0 is zeroed, and the first MTP layer drafts every
token (DeepSeek-V3 has one; further layers' tensors are left unread). The embedding and the LM head are the
layer's own where the checkpoint stores them (DeepSeek-V3 stores copies of the target's), else the target's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.distributed.parallel_state import current_group
from pagellm.layers.fused_moe import expert_layers_target
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import ReplicatedLinear
from pagellm.layers.vocab_embedding import ParallelLMHead, VocabEmbedding, compute_logits
from pagellm.layers.weights import weights_bytes
from pagellm.models.deepseek_v2 import DeepseekV2DecoderLayer, mtp_layer_index
from pagellm.models.llama import LlamaForCausalLM, head_dim_of


class HeadError(ValueError):
    """A head pagellm refuses for this target; the message names the value and the fix."""


# The checkpoint's tensors of the MTP layer that are not its decoder layer's.
_OWN_TENSORS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


@dataclass(frozen=True)
class TargetParts:
    """What a head borrows from the target: not registered as the head's modules, so that neither its weights
    nor its loading counts them."""

    embed_tokens: nn.Module
    lm_head: nn.Module
    rope_inputs: object  # the target's model.rope_inputs (positions, dtype) -> RopeInputs


def mtp_layer_count(config) -> int:
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def check_mtp_target(config, name: str) -> None:
    """Refuses, before anything loads, a target whose checkpoint has no MTP layer pagellm can run."""
    model_type = getattr(config, "model_type", None)
    count = getattr(config, "num_nextn_predict_layers", None)
    if model_type not in ("deepseek_v3", "deepseek_v2") or mtp_layer_count(config) < 1:
        raise HeadError(f"speculative_config method 'mtp': model {name!r} (model_type {model_type!r}) has "
                        f"num_nextn_predict_layers={count!r}, no multi-token-prediction layer pagellm runs; use a "
                        "DeepSeek-V3 checkpoint with num_nextn_predict_layers >= 1, or method ngram, suffix or "
                        "draft_model.")


class MTPHead(nn.Module):
    """The first MTP layer of `config` (the target's), over the target's parts."""

    # Loaded as the target's tensors are (LlamaForCausalLM.load_weights), with the names mtp_tensors gives.
    tied_to_embedding = False
    loads_embedding_into_head = False
    load_weights = LlamaForCausalLM.load_weights

    def __init__(self, config, target: LlamaForCausalLM, quant_config, own_embedding: bool,
                 own_head: bool) -> None:
        super().__init__()
        self.config = config
        self.group = current_group()
        self.activation_dtype = torch.get_default_dtype()
        self.target_checkpoint_target = target.checkpoint_target
        self.quant_config = quant_config
        hidden = config.hidden_size
        layer = config.num_hidden_layers
        prefix = f"model.layers.{layer}"
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        # Unquantized, as in vLLM: DeepSeek-V3's FP8 checkpoint keeps eh_proj in bfloat16.
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, False, None, f"{prefix}.eh_proj")
        self.mtp_block = DeepseekV2DecoderLayer(config, layer, quant_config, prefix)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, config.rms_norm_eps)
        if own_head:
            self.shared_head.head = ParallelLMHead(config.vocab_size, hidden, quant_config,
                                                   f"{prefix}.shared_head.head", False)
        if own_embedding:
            self.embed_tokens = VocabEmbedding(config.vocab_size, hidden, quant_config, f"{prefix}.embed_tokens")
        self.target = TargetParts(target.model.embed_tokens, target.lm_head, target.model.rope_inputs)

    @property
    def num_heads_per_rank(self) -> int:
        return self.mtp_block.self_attn.num_heads

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.mtp_block.self_attn.num_kv_heads

    weight_format = LlamaForCausalLM.weight_format

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    num_cache_layers = 1

    @property
    def lm_head(self) -> nn.Module:
        head = getattr(self.shared_head, "head", None)
        return head if head is not None else self.target.lm_head

    def forward(self, input_ids, positions, kv_caches, meta, hidden_states: torch.Tensor | None = None):
        """hidden_states: the target's (or this head's previous output) at each position; None only in start-up's
        profiling forwards, which measure the activation peak (zeros then)."""
        embed = getattr(self, "embed_tokens", None)
        embeds = (embed if embed is not None else self.target.embed_tokens)(input_ids)
        if hidden_states is None:
            hidden_states = torch.zeros_like(embeds)
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden_states)], dim=-1))
        rope = self.target.rope_inputs(positions, x.dtype)
        out, residual = self.mtp_block(rope, x, None, kv_caches[0], meta)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return compute_logits(self.lm_head, self.shared_head.norm(hidden), self.config.vocab_size)

    def weights_bytes(self) -> int:
        return weights_bytes(self)

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        """The block's tensors map as the target's layers do (fused gate/up, stacked experts or this head's own
        expert layers)."""
        if name.startswith("mtp_block."):
            return expert_layers_target(self, name) or self.target_checkpoint_target(name)
        return name, None


def mtp_tensors(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The first MTP layer's checkpoint tensors, renamed to MTPHead's parameters."""
    prefix = f"model.layers.{num_layers}."
    for name, tensor in weights:
        if mtp_layer_index(name, num_layers) != 0 or "rotary_emb.inv_freq" in name:
            continue
        rest = name[len(prefix):]
        yield (rest if rest.startswith(_OWN_TENSORS) else f"mtp_block.{rest}"), tensor


def mtp_tensor_names(names: Iterable[str], num_layers: int) -> set[str]:
    """The MTPHead parameter names of the checkpoint's first MTP layer (its tensors unread)."""
    return {name for name, _ in mtp_tensors(((n, None) for n in names), num_layers)}
