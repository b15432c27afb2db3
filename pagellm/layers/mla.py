"""Multi-head latent attention (DeepSeek-V2/V3) as a layer: projections, rotary on the rope parts, the latent
written to the paged cache, prefill over expanded K/V and decode over the latent (attention/mla.py has the
cache side and the kernels).

Parameter names follow HuggingFace's DeepseekV2Attention/DeepseekV3Attention: q_proj (q_lora_rank None, as in
DeepSeek-V2-Lite) or q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj.

Rotary: DeepSeek's checkpoints lay each rope part out in interleaved pairs (x0, x1), (x2, x3), ... each
rotated by one frequency (V2 always, V3 where `rope_interleave`, its default). The layer takes the even then
the odd elements and rotates those halves as rotate-half does: V3's own formulation, and for V2 a fixed
permutation of the rotated pairs, applied to queries and keys alike, so every dot product is the same. The
cached k_pe is in that de-interleaved order.

Tensor parallelism splits the heads: a rank holds its heads' rows of q_proj / q_b_proj and of kv_b_proj
(their W_UK and W_UV) and the same input columns of o_proj (row-parallel, one all-reduce), as vLLM's MLA does.
The latent side (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm) is replicated: every rank
computes the same latent row and its pool holds it whole (the cache does not shrink with more ranks), and
decode absorbs W_UK and W_UV per rank over its own heads.

Softmax scale: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared where the config's rope is
scaled (yarn) with an `mscale_all_dim`, as DeepSeek's configs set it and transformers computes it; the cos/sin
tables carry yarn's own attention factor (transformers' rope init).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagellm.attention.mla import (
    MLAMetadata,
    chunk_context,
    expanded_attention,
    torch_latent_decode,
    write_latent,
)
from pagellm.distributed.parallel_state import current_group
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.rotary import RopeInputs, apply_rotary


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config) -> float:
    """qk_head_dim ** -0.5, adjusted by yarn's mscale_all_dim where the rope is scaled."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def rope_interleaved(config) -> bool:
    """Whether the checkpoint's rope parts are in interleaved pairs: DeepSeek-V2 always, V3 unless it says not."""
    return getattr(config, "model_type", "") != "deepseek_v3" or bool(getattr(config, "rope_interleave", True))


class MLAAttention(nn.Module):
    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.layer_index = layer_index
        group = current_group()
        total_heads = config.num_attention_heads
        if total_heads % group.size:
            raise ValueError(f"tensor_parallel_size={group.size} does not divide num_attention_heads={total_heads}: "
                             "multi-head latent attention gives each rank whole heads; use a size dividing "
                             f"{total_heads}")
        self.num_heads = total_heads // group.size  # this rank's
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * self.qk_dim, False, quant_config,
                                               f"{prefix}.q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias, quant_config, f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * self.qk_dim, False, quant_config,
                                                 f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.rope_dim, bias, quant_config,
                                                   f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        # In the checkpoint's format (DeepSeek-V3's fp8 blocks) for the prefill's expansions; decode absorbs its
        # two halves, as floats, into the query and output. A GGUF file's kv_b is read as floats
        # (gguf_loader's _FLOAT_ONLY_STEMS) into an unquantized layer.
        kv_b_format = None if quant_config is None or quant_config.name == "gguf" else quant_config
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, total_heads * (self.nope_dim + self.v_dim), False,
                                              kv_b_format, f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, hidden, bias, quant_config, f"{prefix}.o_proj")
        self.scale = mla_softmax_scale(config)
        self.interleaved = rope_interleaved(config)
        # W_UK [heads, nope, rank] and W_UV transposed [heads, rank, v], from kv_b_proj once it is loaded.
        self.register_buffer("w_uk", torch.empty(0), persistent=False)
        self.register_buffer("w_uv_t", torch.empty(0), persistent=False)

    def _kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight [heads * (nope + v), rank] as floats: the parameter itself where unquantized (read
        before kv_b_proj's own method may pack it away: the loader visits a module before its children), else the
        layer's product with the identity, its format's own dequantization (as vLLM dequantizes it)."""
        layer = self.kv_b_proj
        if isinstance(layer.quant_method, UnquantizedLinearMethod):
            if layer.weight.numel() == 0:
                raise RuntimeError(f"layer {self.layer_index}: kv_b_proj's weight was packed before MLA absorbed it")
            return layer.weight.detach()
        layer.process_weights_after_loading()
        identity = torch.eye(self.kv_lora_rank, dtype=self.kv_a_layernorm.weight.dtype,
                             device=self.kv_a_layernorm.weight.device)
        return layer.matmul(identity).t().contiguous()

    @property
    def num_kv_heads(self) -> int:
        """The cache holds one latent row per token: one "head"."""
        return 1

    def process_weights_after_loading(self) -> None:
        """Splits kv_b_proj's weight into the absorbed W_UK and W_UV."""
        per_head = self._kv_b_weight().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = per_head[:, : self.nope_dim].contiguous()
        self.w_uv_t = per_head[:, self.nope_dim :].transpose(1, 2).contiguous()

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: MLAMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(tokens, self.num_heads, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden)
        latent_part, k_pe = compressed.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent_part.contiguous())
        q_pe, k_pe = self.rotate(q_pe, k_pe.unsqueeze(1), rope)
        rows = torch.cat((latent, k_pe.squeeze(1)), dim=-1)  # what the cache holds per token
        cache = kv_cache[0]
        step = meta.step
        write_latent(rows, cache, step.kv_write_index, step.kv_format)
        out = hidden.new_empty(tokens, self.num_heads, self.v_dim)
        num_decodes = step.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = self.decode(q_nope[:num_decodes], q_pe[:num_decodes], cache, meta)
        for chunk in step.prefill_chunks:
            start, end = num_decodes + chunk.start, num_decodes + chunk.end
            context, mask = chunk_context(chunk, rows[start:end], cache, step.kv_format)
            out[start:end] = self.prefill(q_nope[start:end], q_pe[start:end], context.to(hidden.dtype), mask)
        return self.o_proj(out.view(tokens, self.num_heads * self.v_dim))

    def rotate(self, q_pe: torch.Tensor, k_pe: torch.Tensor, rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [tokens, heads, rope], k_pe [tokens, 1, rope], rotated (de-interleaved first where the checkpoint
        interleaves)."""
        if self.interleaved:
            q_pe = torch.cat((q_pe[..., 0::2], q_pe[..., 1::2]), dim=-1)
            k_pe = torch.cat((k_pe[..., 0::2], k_pe[..., 1::2]), dim=-1)
        return apply_rotary(q_pe, k_pe, (rope.cos, rope.sin))

    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
               meta: MLAMetadata) -> torch.Tensor:
        """Attention over the cached latents with W_UK absorbed into the query and W_UV into the output:
        [decodes, heads, v]."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk.to(q_nope.dtype)).transpose(0, 1)
        q = torch.cat((q_latent, q_pe), dim=-1)
        if meta.latent_decode is not None:
            out_latent = meta.latent_decode(q, cache, meta.step.decode, self.scale, self.kv_lora_rank)
        else:
            out_latent = torch_latent_decode(q, cache, meta.step.decode, self.scale, self.kv_lora_rank,
                                             meta.step.kv_format, meta.step.block_size)
        return torch.bmm(out_latent.to(q.dtype).transpose(0, 1), self.w_uv_t.to(q.dtype)).transpose(0, 1)

    def prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, context: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """A chunk's queries over its context's latents [keys, rank + rope], expanded through kv_b_proj."""
        keys = context.shape[0]
        latent, k_pe = context.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent.contiguous()).view(keys, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(keys, self.num_heads, self.rope_dim)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return expanded_attention(q, k, v, mask, self.scale)
