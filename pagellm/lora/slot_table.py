"""Which adapter occupies each of the `max_loras` device slots: the scheduler's bookkeeping (no torch).

A slot is in use while a running request holds it; only an unused slot is given to another adapter (the
least recently used one first), so a running request's adapter is never evicted. A request whose adapter is
not resident is admitted only when a slot is free or can be freed; otherwise it waits.
"""

from __future__ import annotations

from collections import OrderedDict

from pagellm.lora.request import LoRARequest

NO_SLOT = -1


class LoRASlotTable:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self.adapter_in: dict[int, int] = {}  # slot -> lora_int_id
        self.users: dict[int, set[str]] = {slot: set() for slot in range(max_loras)}
        # Slots no running request uses, least recently used first: empty ones, then resident adapters.
        self.idle: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))
        self._loads: list[tuple[int, LoRARequest]] = []

    def can_admit(self, lora: LoRARequest | None) -> bool:
        return lora is None or lora.lora_int_id in self.slot_of or bool(self.idle)

    def acquire(self, request_id: str, lora: LoRARequest | None) -> int:
        """The slot `request_id` runs in (loading its adapter into one if needed); call can_admit first."""
        if lora is None:
            return NO_SLOT
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is None:
            slot, _ = self.idle.popitem(last=False)
            evicted = self.adapter_in.pop(slot, None)
            if evicted is not None:
                del self.slot_of[evicted]
            self.slot_of[lora.lora_int_id] = slot
            self.adapter_in[slot] = lora.lora_int_id
            self._loads.append((slot, lora))
        else:
            self.idle.pop(slot, None)
        self.users[slot].add(request_id)
        return slot

    def release(self, request_id: str, slot: int) -> None:
        if slot == NO_SLOT:
            return
        users = self.users[slot]
        users.discard(request_id)
        if not users:
            self.idle[slot] = None  # most recently used: evicted last

    def drop(self, lora_int_id: int) -> None:
        """Forget a removed adapter: its slot is reused first (now, if no request uses it)."""
        slot = self.slot_of.get(lora_int_id)
        if slot is not None and not self.users[slot]:
            del self.slot_of[lora_int_id]
            del self.adapter_in[slot]
            self.idle[slot] = None
            self.idle.move_to_end(slot, last=False)

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        loads, self._loads = self._loads, []
        return loads
