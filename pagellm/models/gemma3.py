"""Gemma 3 text models (Gemma3ForCausalLM, model_type gemma3_text) over the paged KV cache.

Where Gemma 3 differs from Llama, following transformers' modeling_gemma3:
- RMSNorm scales by (1 + weight), computed in float32 and rounded back to the activations' dtype;
- "sandwich" norms: each of attention and MLP has a norm before and after it, and the residual adds
  the post-normed output;
- the embedding output is multiplied by sqrt(hidden_size), rounded to the model's dtype first;
- the MLP is GELU (tanh approximation) gated, `hidden_activation`;
- per-head RMSNorm on q and k before rotary, and scores scaled by query_pre_attn_scalar ** -0.5;
- layers alternate local (sliding-window) and global attention (`layer_types`; the window of each layer
  comes from models/sliding_window.py through LlamaAttention), each kind with its own rotary table:
  rope_local_base_freq for local layers, rope_theta with any rope scaling for global ones;
- the final logits are soft-capped, tanh(logits / cap) * cap, when final_logit_softcapping is set.

On the CPU its norms run on the fused Gemma RMSNorm kernel (given 1 + weight in float32, rounding once as
transformers does, in float32 or bfloat16), the residual add before the feed-forward norm folded into it, and
q/k rotate in place on the rotary kernel (Qwen3's path); the GELU runs on torch ops. Its linear layers are Llama's (packed on CPU, sharded under tensor parallelism the
same way).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagellm.layers.layernorm import GemmaRMSNorm
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.rotary import RopeInputs, RotaryEmbedding
from pagellm.layers.vocab_embedding import VocabEmbedding
from pagellm.models.llama import LlamaForCausalLM, LlamaMLP, _hook_registries, _hooked, head_dim_of
from pagellm.models.qwen3 import Qwen3Attention
from pagellm.ops.cpu_ops import CpuOps
from pagellm.ops.decode_stack import GemmaDecodeStack

# Where a multimodal checkpoint (Gemma3ForConditionalGeneration) keeps its language model: transformers 5's
# layout and the hub's older one. Its vision tower and projector are not used for text.
_LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def check_gemma3_config(config) -> None:
    """Settings of Gemma3TextConfig that this implementation does not compute, refused by name."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"attn_logit_softcapping={config.attn_logit_softcapping} is not supported: pagellm's attention kernels "
            "do not soft-cap scores (released Gemma 3 checkpoints leave it null; set it to null only if the "
            "checkpoint was trained without it)."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model's setting) is not supported: "
                         "pagellm generates with causal attention.")


def _language_model_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        yield name, tensor


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (per-head norms on q and k before rotary) with Gemma's norm and score scale."""

    norm_class = GemmaRMSNorm

    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__(config, layer_index, quant_config, prefix)
        self.scale = config.query_pre_attn_scalar**-0.5


class Gemma3MLP(LlamaMLP):
    activation_field = "hidden_activation"

    def activation_name(self, config) -> str | None:
        return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_index, quant_config, f"{prefix}.self_attn")
        self.mlp = Gemma3MLP(config, quant_config, f"{prefix}.mlp")
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        attended = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        # hidden + post_norm(attended), then the feed-forward norm of that sum (in one kernel on the CPU ops,
        # which add into a copy: `hidden` may be the caller's tensor)
        normed, hidden = self.pre_feedforward_layernorm(self.post_attention_layernorm(attended), hidden.clone())
        return hidden + self.post_feedforward_layernorm(self.mlp(normed))


class Gemma3Model(nn.Module):
    ops: CpuOps | None = None
    # decode_stack()'s: whether made since use_cpu_ops / reset_direct_layers, the stack, and the dicts a hook on
    # any of the layers' modules would be registered in.
    _stack_made = False
    _stack: GemmaDecodeStack | None = None
    _stack_hooks: list[dict] = []

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "model") -> None:
        super().__init__()
        check_gemma3_config(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                           f"{prefix}.embed_tokens")
        self.embed_scale = config.hidden_size**0.5
        head_dim = head_dim_of(config)
        self.layer_types = list(config.layer_types[: config.num_hidden_layers])
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(config, head_dim, max_positions, layer_type=kind)
                                     for kind in sorted(set(self.layer_types))})
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def decode_stack(self) -> GemmaDecodeStack | None:
        """The layers' decode steps as C calls (ops/decode_stack.py), made at the first call since use_cpu_ops or
        reset_direct_layers; None where it cannot be, or while a forward hook is registered on any module of the
        layers (or globally): the modules then run, and the hooks with them."""
        if not self._stack_made:
            self._stack = None if self.ops is None else GemmaDecodeStack.build(
                list(self.layers), [self.rotary[kind] for kind in self.layer_types], self.ops)
            self._stack_hooks = [] if self._stack is None else _hook_registries(list(self.layers.modules()))
            self._stack_made = True
        if self._stack is not None and _hooked(self._stack_hooks):
            return None
        return self._stack

    def reset_direct_layers(self) -> None:
        """Make the stack again at the next forward (LoRA slots attached to the layers: lora/manager.py)."""
        self._stack_made = False

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Runs as many layers as `kv_caches` has entries (all of them, except in profiling runs)."""
        embedded = self.embed_tokens(input_ids)
        # transformers rounds the scale to the weights' dtype before multiplying.
        hidden = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)
        for table in self.rotary.values():
            table.cover(positions)
        stack = self.decode_stack()
        if stack is not None and stack.serves(hidden, positions, kv_caches, meta):
            return self.norm(stack(hidden, positions, kv_caches, meta))
        # The rotary kernel reads the whole tables by position: no per-step cos/sin gather then.
        ropes = {kind: RopeInputs(positions, *((None, None) if self.ops is not None else
                                               table.lookup(positions, hidden.dtype)), table)
                 for kind, table in self.rotary.items()}
        for layer, kind, kv_cache in zip(self.layers, self.layer_types, kv_caches):
            hidden = layer(ropes[kind], hidden, kv_cache, meta)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, max_positions, quant_config)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_language_model_weights(weights))

    def use_cpu_ops(self, ops: CpuOps) -> None:
        """Norms on the fused Gemma RMSNorm kernel (float32 and bfloat16 activations; others keep the torch ops)
        and rotary in place; the GELU stays on torch ops (the fused kernel computes SiLU)."""
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.use_cpu_ops(ops)
            elif isinstance(module, (Gemma3Model, Gemma3Attention)):
                module.ops = ops
        self.model.reset_direct_layers()

    def finish_logits(self, output: torch.Tensor) -> torch.Tensor:
        logits = super().finish_logits(output)
        if self.final_logit_softcapping is None:
            return logits
        cap = self.final_logit_softcapping
        return logits.div_(cap).tanh_().mul_(cap)  # in place: no [rows, vocab] temporaries
