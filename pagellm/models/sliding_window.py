"""Which layers attend through a sliding window, and how wide it is, read from a Hugging Face config.

Semantics are transformers': a query at position p attends to keys at positions in (p - window, p].

Three config shapes name the window:
- `layer_types` (Gemma 2/3, and Qwen2 in recent transformers): a "sliding_attention" entry slides by
  `sliding_window`, any other entry ("full_attention") attends to everything.
- Qwen2 configs without `layer_types`: layers from `max_window_layers` on slide, when `use_sliding_window`.
- Otherwise (Mistral, Phi-3): every layer slides by `sliding_window` where it is set, unless
  `use_sliding_window` is false.
"""

from __future__ import annotations

SLIDING_LAYER_TYPE = "sliding_attention"


def layer_sliding_window(config, layer_index: int) -> int | None:
    """The window of layer `layer_index` in tokens, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    if window < 1:
        raise ValueError(f"sliding_window={window} in the model config: a window must hold at least one token")
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        if layer_index >= len(layer_types):
            raise ValueError(f"layer {layer_index} has no entry in the config's layer_types ({len(layer_types)} "
                             "entries); the config's num_hidden_layers and layer_types disagree")
        return int(window) if layer_types[layer_index] == SLIDING_LAYER_TYPE else None
    if getattr(config, "model_type", "") == "qwen2":
        first_sliding = getattr(config, "max_window_layers", 0)
        return int(window) if layer_index >= first_sliding else None
    return int(window)


def model_sliding_window(config) -> int | None:
    """The window past which no layer reads a key: the widest layer window, or None when any layer attends
    to everything. Blocks wholly before it can be given back while a sequence runs."""
    windows = [layer_sliding_window(config, index) for index in range(getattr(config, "num_hidden_layers", 0))]
    if not windows or any(window is None for window in windows):
        return None
    return max(windows)
