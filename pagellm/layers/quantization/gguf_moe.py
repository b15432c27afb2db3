"""A GGUF's mixture-of-experts weights kept in their quantized blocks (issue 22's rule for GGUF weights).

llama.cpp stores a layer's experts as three stacked tensors, ffn_gate_exps / ffn_up_exps [E, I, H] and
ffn_down_exps [E, H, I], each in one GGML type. The loader (models/gguf_loader.py) hands them over one expert at
a time as GGUFWeight blocks; they are copied into one uint8 stack per shard, [E, rows, bytes per row], allocated at
the first expert, so each expert's blocks are one contiguous slice `stack[e]`, the layout ops/gguf_kernels.py and
ops/triton_gguf.py multiply on. Gate and up of one type are stacked together ([E, 2I, bytes]: one product per
expert for both); of different types each is its own product.

A step runs fused_moe.grouped_experts_together: the step's (token, expert) rows sorted by expert once, then per
expert that received tokens one gate_up and one down product on the expert's slice; on the C kernels, where every
expert's rows are few enough for the int8 row kernels (a decode step's), one gguf_matmul_experts call per
projection runs all of them (GGUFExpertsProduct: the same bits, one fork of the threads). The kernels' own switch
(GGUFKernels.dense_min_rows) decides per product between the int8 dot products and torch's GEMM on tiles of the
slice dequantized in turn: prefill rows of a busy expert take the tiles, decode rows the int8 products; only the
experts a step routes to are ever read, and no dequantized copy of all experts exists. On CUDA the same loop runs
the Triton GGUF kernels on the expert's slice (one launch per expert and product, not a single fused-MoE kernel
over sorted token blocks as the float experts have).

Float experts (F32/F16/BF16 files), and types for which the device has no kernel (the CPU without a compiler),
are held dense in the model's dtype and run as the unquantized experts do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.layers.fused_moe import ExpertProduct, FusedMoE, FusedMoEMethodBase, UnquantizedFusedMoEMethod, \
    grouped_experts_together, one_at_a_time, one_call_or_each
from pagellm.layers.quantization.gguf import FLOAT_TYPES, GGUFWeight
from pagellm.ops.gguf_kernels import GGUFExpertsProduct, gguf_ops, row_bytes

logger = logging.getLogger(__name__)

DENSE = "dense"  # the type name of a stack held as floats


@dataclass
class ExpertStack:
    """One shard's experts (w1 gate, w3 up or w2 down) as loaded: a uint8 tensor [E, rows, bytes per row] of
    GGML type `type_name`, or a float tensor [E, rows, cols] (type DENSE), on the host until processed."""

    type_name: str
    data: torch.Tensor
    rows: int
    cols: int
    loaded: int = 0


@dataclass
class QuantizedExperts:
    """What `apply` multiplies with: per product the stacked blocks, their type and the output rows."""

    gate_up: list[tuple[torch.Tensor, str, int]]  # one entry (w13) or two (w1, w3)
    down: tuple[torch.Tensor, str, int]


class GGUFFusedMoEMethod(FusedMoEMethodBase):
    cuda_graph_safe = False  # one product per used expert (grouped_experts)
    takes_biases = True  # gpt-oss's MXFP4 experts (layers/quantization/mxfp4.py)

    def __init__(self, ops=None) -> None:
        # The kernels for the device the model is built on, chosen at the first layer (as GGUFLinearMethod does);
        # `ops` fixes them (tests run the Triton kernels on the CPU under TRITON_INTERPRET=1).
        self.ops = ops
        self.dense = UnquantizedFusedMoEMethod()
        self._reported: set[str] = set()

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        # Placeholders filled at load with whatever type the file stores; FusedMoE gives them its loader, which
        # hands each expert's tensor to load_expert.
        w13 = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        if self.ops is None:
            self.ops = gguf_ops(device=w13.device)
        layer.gguf_stacks = {}
        layer.params_dtype = params_dtype
        layer.gguf_experts = None

    def load_expert(self, layer: FusedMoE, tensor: GGUFWeight | torch.Tensor, shard_id: str, expert_id: int) -> None:
        """Expert `expert_id`'s gate (w1), up (w3) [I, H] or down (w2) [H, I] as the file stores it: this rank's
        slice of the intermediate features (all of them under expert parallelism), copied into the shard's stack;
        nothing of an expert another rank holds."""
        name = f"{layer.prefix}.{expert_id}.{shard_id}"
        size, total = layer.intermediate_size, layer.intermediate_size * layer.feature_ranks
        rows_cols = (tensor.rows, tensor.cols) if isinstance(tensor, GGUFWeight) else tuple(tensor.shape)
        expected = (layer.hidden_size, total) if shard_id == "w2" else (total, layer.hidden_size)
        if len(rows_cols) != 2 or rows_cols != expected:
            raise ValueError(f"checkpoint tensor {name!r} has shape {rows_cols}; expected {expected}")
        local = layer.placement.local_index(expert_id)
        if local is None:
            return
        start = layer.feature_rank * size
        if isinstance(tensor, GGUFWeight):
            data, type_name = tensor.data, tensor.type_name
            if shard_id == "w2":
                width = _split_width(type_name, size, layer, name)
                data = data.narrow(1, layer.feature_rank * width, width)
            else:
                data = data.narrow(0, start, size)
        else:
            data, type_name = tensor, DENSE
            data = data.narrow(1, start, size) if shard_id == "w2" else data.narrow(0, start, size)
        rows, cols = (layer.hidden_size, size) if shard_id == "w2" else (size, layer.hidden_size)
        stack = layer.gguf_stacks.get(shard_id)
        if stack is None:
            dtype = torch.uint8 if type_name != DENSE else layer.params_dtype
            stack = ExpertStack(type_name, torch.empty(layer.local_num_experts, *data.shape, dtype=dtype), rows,
                                cols)
            layer.gguf_stacks[shard_id] = stack
        if stack.type_name != type_name:
            raise ValueError(f"checkpoint tensor {name!r} is {type_name} but the layer's other {shard_id} experts are "
                             f"{stack.type_name}; pagellm stacks one type per expert projection, as llama.cpp's "
                             "ffn_*_exps tensors have it. Fix: requantize the file with one type per projection")
        stack.data[local].copy_(data)
        stack.loaded += 1

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        stacks: dict[str, ExpertStack] = layer.gguf_stacks
        del layer.gguf_stacks
        missing = [shard for shard in ("w1", "w3", "w2") if shard not in stacks]
        if missing:
            raise ValueError(f"{layer.prefix}: no {missing} expert weights were loaded")
        device = layer.w13_weight.device
        if all(s.type_name != DENSE and self.ops.supports(s.type_name) for s in stacks.values()):
            self._keep_blocks(layer, stacks, device)
            return
        for stack in stacks.values():
            self._report(stack.type_name, layer.prefix)
        w1, w3, w2 = (self._dense(stacks[shard], layer.params_dtype) for shard in ("w1", "w3", "w2"))
        layer.w13_weight.data = torch.cat((w1, w3), dim=1).to(device)
        layer.w2_weight.data = w2.to(device)
        del w1, w3, w2
        self.dense.process_weights_after_loading(layer)

    def _keep_blocks(self, layer: FusedMoE, stacks: dict[str, ExpertStack], device: torch.device) -> None:
        w1, w3, w2 = stacks["w1"], stacks["w3"], stacks["w2"]
        if w1.type_name == w3.type_name:
            # Gate rows then up rows per expert, as the activation reads them: one product for both.
            layer.w13_weight.data = torch.cat((w1.data, w3.data), dim=1).to(device)
            gate_up = [(layer.w13_weight.data, w1.type_name, 2 * w1.rows)]
            layer.gguf_extra = []
        else:
            layer.w13_weight.data = w1.data.to(device)
            up = w3.data.to(device)
            gate_up = [(layer.w13_weight.data, w1.type_name, w1.rows), (up, w3.type_name, w3.rows)]
            layer.gguf_extra = [up]
        layer.w2_weight.data = w2.data.to(device)
        layer.gguf_experts = experts = QuantizedExperts(gate_up, (layer.w2_weight.data, w2.type_name, w2.rows))
        # What each step runs, made once: the products on each expert's slice, its biases added after them; where
        # the C kernels run every expert of the step in one call (no biases, one gate/up type), that call for the
        # steps it takes.
        gate_up_bias, down_bias = layer.expert_bias("gate_up"), layer.expert_bias("down")
        per_expert = (_biased(self._gate_up(experts, layer.hidden_size), gate_up_bias),
                      _biased(self._down(experts, layer.intermediate_size), down_bias))
        together = (None, None)
        if hasattr(self.ops, "prepare") and gate_up_bias is None and down_bias is None and len(gate_up) == 1:
            together = (self._one_call(gate_up[0], layer.hidden_size),
                        self._one_call(experts.down, layer.intermediate_size))
        layer.expert_products = tuple(one_call_or_each(call, one_at_a_time(product))
                                      for call, product in zip(together, per_expert))

    @staticmethod
    def _dense(stack: ExpertStack, dtype: torch.dtype) -> torch.Tensor:
        if stack.type_name == DENSE:
            return stack.data.to(dtype)
        experts = [GGUFWeight(blocks, stack.type_name, stack.rows, stack.cols).dequantize(dtype)
                   for blocks in stack.data]
        return torch.stack(experts)

    def _report(self, type_name: str, prefix: str) -> None:
        if type_name not in FLOAT_TYPES and type_name != DENSE and type_name not in self._reported:
            self._reported.add(type_name)
            logger.info("GGUF %s experts (first: %s) have no kernel here; they run dequantized to the model's dtype.",
                        type_name, prefix)

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if layer.gguf_experts is None:
            return self.dense.apply(layer, x, topk_weights, topk_ids)
        gate_up, down = layer.expert_products
        return grouped_experts_together(x, topk_weights, topk_ids, layer.local_num_experts, gate_up, down,
                                        2 * layer.intermediate_size, layer.act_fn)

    def _one_call(self, product: tuple[torch.Tensor, str, int], in_features: int) -> GGUFExpertsProduct | None:
        """gguf_matmul_experts over one stacked projection's experts (ops/gguf_kernels.GGUFExpertsProduct)."""
        stack, type_name, rows = product
        return GGUFExpertsProduct.of([self.ops.prepare(blocks, type_name, rows, in_features) for blocks in stack])

    def _gate_up(self, experts: QuantizedExperts, hidden: int) -> ExpertProduct:
        ops = self.ops
        if len(experts.gate_up) == 1:
            ((stack, type_name, rows),) = experts.gate_up
            return lambda expert, x, out: ops.matmul(x, stack[expert], type_name, rows, hidden, out=out)

        def separate(expert: int, x: torch.Tensor, out: torch.Tensor) -> None:
            halves = [ops.matmul(x, stack[expert], type_name, rows, hidden)
                      for stack, type_name, rows in experts.gate_up]
            torch.cat(halves, dim=1, out=out)

        return separate

    def _down(self, experts: QuantizedExperts, intermediate: int) -> ExpertProduct:
        ops, (stack, type_name, rows) = self.ops, experts.down
        return lambda expert, x, out: ops.matmul(x, stack[expert], type_name, rows, intermediate, out=out)

    def kernel_tensors(self, layer: FusedMoE) -> list[torch.Tensor]:
        if getattr(layer, "gguf_experts", None) is None:
            return self.dense.kernel_tensors(layer)
        return list(layer.gguf_extra)


def _biased(product: ExpertProduct, bias: torch.Tensor | None) -> ExpertProduct:
    """`product`, then expert e's row of the stacked `bias` added to its output rows."""
    if bias is None:
        return product

    def run(expert: int, x: torch.Tensor, out: torch.Tensor) -> None:
        product(expert, x, out)
        out.add_(bias[expert])

    return run


def _split_width(type_name: str, size: int, layer: FusedMoE, name: str) -> int:
    """Bytes of this rank's `size` input features in each row of a down projection's blocks."""
    try:
        return row_bytes(type_name, size)
    except ValueError:
        raise ValueError(f"{name}: tensor_parallel_size={layer.group.size} gives each rank {size} of the experts' "
                         f"{size * layer.feature_ranks} intermediate features, which splits {type_name}'s blocks; use a "
                         "size whose share is a multiple of the block") from None
