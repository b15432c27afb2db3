"""One model runner's adapters: the device slots of every adapted layer, and a host LRU of loaded adapters.

The scheduler decides which adapter occupies which slot (slot_table.py) and sends the loads with the step;
this class carries them out (from its host cache, reading the directory again if the adapter fell out of it),
and builds the step's token grouping that every layer reads.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagellm.layers.linear import LinearBase
from pagellm.lora.cpu_kernels import lora_kernel
from pagellm.lora.layers import LoRAContext, LoRALayerSlots, PackedSlot
from pagellm.lora.peft import LoRALoadError, load_adapter, target_layers
from pagellm.lora.punica import build_mapping
from pagellm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostAdapter:
    """An adapter in host memory, packed per layer as this rank's slots hold it."""

    request: LoRARequest
    layers: dict[str, PackedSlot]

    @property
    def nbytes(self) -> int:
        return sum(packed.nbytes for packed in self.layers.values())


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.context = LoRAContext()
        self.targets = target_layers(model)
        modules = dict(model.named_modules())
        cpu_kernel = lora_kernel() if device.type == "cpu" and dtype == torch.float32 else None
        self.layers: dict[str, LoRALayerSlots] = {}
        for name in self.targets:
            layer = modules[name]
            assert isinstance(layer, LinearBase)
            slots = LoRALayerSlots(layer, self.context, max_loras, max_lora_rank, dtype, device, cpu_kernel)
            layer.lora = slots
            self.layers[name] = slots
        for module in modules.values():  # a LlamaModel that runs its layers without module calls sees the slots
            if hasattr(module, "reset_direct_layers"):
                module.reset_direct_layers()
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()
        self.slot_adapters: list[int | None] = [None] * max_loras
        # The server checks adapters (load_lora_adapter) on a thread of its own, beside the engine thread.
        self._host_lock = threading.Lock()

    @property
    def slots_bytes(self) -> int:
        return sum(slots.nbytes for slots in self.layers.values())

    def load(self, request: LoRARequest) -> HostAdapter:
        """The adapter from the host cache, or read (and checked) from its directory into it."""
        with self._host_lock:
            return self._load(request)

    def _load(self, request: LoRARequest) -> HostAdapter:
        cached = self.host.get(request.lora_int_id)
        if cached is not None:
            if cached.request.lora_path != request.lora_path:
                raise LoRALoadError(
                    f"lora_int_id={request.lora_int_id} is already adapter {cached.request.lora_name!r} "
                    f"({cached.request.lora_path}); give {request.lora_name!r} ({request.lora_path}) an id of its own.")
            self.host.move_to_end(request.lora_int_id)
            return cached
        weights = load_adapter(request, self.targets, self.max_lora_rank, self.dtype)
        adapter = HostAdapter(request, {name: self.layers[name].pack(layer_weights)
                                        for name, layer_weights in weights.layers.items()})
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def activate(self, slot: int, request: LoRARequest) -> None:
        """Copies the adapter's weights into `slot` of every layer (clearing the layers it leaves alone)."""
        adapter = self.load(request)
        for name, slots in self.layers.items():
            slots.set_slot(slot, adapter.layers.get(name))
        self.slot_adapters[slot] = request.lora_int_id
        logger.debug("LoRA adapter %r (id %d) loaded into slot %d", request.lora_name, request.lora_int_id, slot)

    def prepare_step(self, token_slots: np.ndarray) -> None:
        """This step's token grouping, from each token's slot (-1: no adapter)."""
        self.context.mapping = build_mapping(token_slots, self.device)

    def clear_step(self) -> None:
        self.context.mapping = None
