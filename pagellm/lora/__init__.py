"""LoRA adapters served beside the base weights, many in one batch (S-LoRA / Punica, as vLLM does).

- request.py: `LoRARequest`, vLLM's handle naming an adapter (imports no torch: the scheduler reads it).
- peft.py: reads a PEFT adapter directory into per-layer A/B matrices, refusing what does not fit the model.
- slot_table.py: which adapter occupies which of the `max_loras` device slots (no torch; the scheduler's).
- layers.py: the stacked A/B slots of one linear layer and the delta it adds to the layer's output.
- punica.py: one step's token-to-slot grouping and the grouped shrink/expand products (torch, Triton).
- manager.py: one model runner's adapters: the slots of every layer and the host LRU of loaded adapters.
"""

from pagellm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
