"""One step's grouping of tokens by adapter slot, and the grouped (segmented) shrink/expand products.

The runner builds a `LoRAStepMapping` once per step from each token's slot (-1: no adapter): the tokens that
have an adapter, sorted by slot, and the segment of each active slot. Every adapted layer then adds its delta
with one call: gather the adapted tokens' rows, shrink each segment by its slot's A, expand by its B, scatter-add
into the layer's output (Punica's SGMV, S-LoRA). On CPU in float32 one C call does it all (cpu_kernels.py);
the torch path here (bfloat16, no compiler) runs one GEMM pair per active slot (at most max_loras, never one
per request); on GPU one Triton launch per product covers every segment (triton_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoRAStepMapping:
    # Indices of the tokens with an adapter, grouped by slot; None when that is every token, in order.
    order: torch.Tensor | None
    # (slot, start, end): rows [start, end) of the grouped tokens use `slot`.
    segments: list[tuple[int, int, int]]
    num_grouped: int
    # The same for the C kernel: token index per grouped row, and the segments as an int64 [n, 3] array.
    rows: np.ndarray
    segment_array: np.ndarray
    # For the Triton kernels (triton_kernels.py), made at their first layer of the step: the segments cut
    # into tiles, and `rows` on the device.
    tiles: torch.Tensor | None = None
    rows_tensor: torch.Tensor | None = None


def build_mapping(token_slots: np.ndarray, device: torch.device) -> LoRAStepMapping | None:
    """None when no token of the step has an adapter: the layers then add nothing and cost nothing."""
    adapted = np.nonzero(token_slots >= 0)[0]
    if len(adapted) == 0:
        return None
    slots = token_slots[adapted]
    order = adapted[np.argsort(slots, kind="stable")]
    sorted_slots = token_slots[order]
    starts = np.concatenate([[0], np.nonzero(np.diff(sorted_slots))[0] + 1])
    ends = np.concatenate([starts[1:], [len(order)]])
    segments = [(int(sorted_slots[s]), int(s), int(e)) for s, e in zip(starts, ends)]
    identity = len(order) == len(token_slots) and len(segments) == 1
    order_tensor = None if identity else torch.from_numpy(order).to(device)
    segment_array = np.array(segments, dtype=np.int64).reshape(-1, 3)
    return LoRAStepMapping(order_tensor, segments, len(order), order, segment_array)


def add_lora_torch(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, widths: np.ndarray,
                   mapping: LoRAStepMapping) -> torch.Tensor:
    """out[t] += (x[t] @ A[s]^T) @ B[s]^T for each adapted token t of slot s. a: [slots, cap, in],
    b_t: [slots, cap, out] (B transposed, the scaling folded in); widths[s]: the columns of slot s in use."""
    grouped = x if mapping.order is None else x.index_select(0, mapping.order)
    delta = None
    for slot, start, end in mapping.segments:
        width = int(widths[slot])
        if width == 0:
            continue  # the slot's adapter leaves this layer alone
        if delta is None:
            delta = (torch.zeros if len(mapping.segments) > 1 else torch.empty)(
                mapping.num_grouped, out.shape[1], dtype=out.dtype, device=out.device)
        shrunk = torch.mm(grouped[start:end], a[slot, :width].t())
        torch.mm(shrunk, b_t[slot, :width], out=delta[start:end])
    if delta is None:
        return out
    if mapping.order is None:
        return out.add_(delta)
    return out.index_add_(0, mapping.order, delta)
