"""Rotary position embeddings: cos/sin tables by position, looked up each step (or read whole by the fused CPU
kernel, which rotates q and k in place)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Positions a CPU model's tables cover before any step has needed more.
CPU_INITIAL_POSITIONS = 256


class RotaryEmbedding(nn.Module):
    """cos/sin [positions, head_dim] in float32. On a GPU they cover every position up to max_positions from the
    start (a captured graph holds their address). On the CPU they cover the positions steps have reached,
    doubling as longer sequences arrive: at 32,768 positions and head_dim 256, a pair of tables takes 64 MiB that
    a server of short requests never reads. A table's rows do not depend on how many it has."""

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.inv_freq, self.scaling = _rope_inv_freq(config, head_dim, layer_type)
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self._covered: torch.Tensor | None = None

    def reset_cache(self, device: torch.device) -> None:
        """Fill cos/sin (the model may be built on the meta device, which holds no values)."""
        self._fill(self.initial_positions(device), device)

    def initial_positions(self, device: torch.device) -> int:
        return self.max_positions if device.type != "cpu" else min(self.max_positions, CPU_INITIAL_POSITIONS)

    def trim(self) -> None:
        """Back to the tables a new model has: start-up's profiling steps reach positions no request has yet."""
        count = self.initial_positions(self.cos.device)
        if self.cos.shape[0] > count:
            self._fill(count, self.cos.device)

    def cover(self, positions: torch.Tensor) -> None:
        """Grow the tables to cover `positions` (a step's): every reader of cos/sin calls this first."""
        if positions is self._covered or self.cos.shape[0] >= self.max_positions or positions.numel() == 0:
            return
        last = int(positions.max())
        if last >= self.cos.shape[0]:
            if last >= self.max_positions:
                raise ValueError(f"position {last} is beyond the rotary tables' {self.max_positions} "
                                 "(max_model_len); raise max_model_len")
            self._fill(min(self.max_positions, max(last + 1, 2 * self.cos.shape[0])), self.cos.device)
        self._covered = positions

    def _fill(self, count: int, device: torch.device) -> None:
        positions = torch.arange(count, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # The old tables go first, so that the new ones never sit beside them.
        self.cos = self.sin = torch.empty(0)
        self.cos = (emb.cos() * self.scaling).to(device)
        self.sin = (emb.sin() * self.scaling).to(device)
        self._covered = None

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, 1, head_dim] of the step's positions: once per step, shared by all layers."""
        self.cover(positions)
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


@dataclass
class RopeInputs:
    positions: torch.Tensor
    # The torch path's cos/sin [tokens, 1, head_dim] (RotaryEmbedding.lookup); None when the native
    # kernel rotates in place, reading the whole tables by position.
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    tables: RotaryEmbedding

    def __post_init__(self) -> None:
        self.tables.cover(self.positions)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_inv_freq(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq and cos/sin scaling; `layer_type` picks one entry of a config whose rope_parameters are keyed
    by layer type (Gemma 3: "sliding_attention" and "full_attention" layers rotate with different bases)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type='dynamic' rescales with the sequence length, which a paged cache cannot do; "
            "use a model with default, linear, llama3 or yarn RoPE."
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    # These call transformers' config methods, which a GGUF's config (models/gguf_config.py) has not: they get
    # transformers' class of it.
    hf_config = config.to_transformers() if hasattr(config, "to_transformers") else config
    # Some of these create tensors without a device, which the model's meta-device construction would catch.
    with torch.device("cpu"):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)
