"""Mixture-of-experts layers: the router that picks each token's experts, and `FusedMoE`, which holds every
expert's gate/up and down weights stacked and runs them grouped by expert.

Routing follows transformers' gates exactly (the same torch.topk calls on the same scores, so ties fall the same
way): softmax top-k with or without renormalisation (Mixtral, Qwen3-MoE, OLMoE), DeepSeek-V2's softmax with
"greedy" or "group_limited_greedy" selection, and DeepSeek-V3's sigmoid scores with `e_score_correction_bias`
(used to choose experts, not to weigh them), grouped top-k over `n_group`/`topk_group`, and
`routed_scaling_factor`.

On the CPU a step's (token, expert) pairs are sorted by expert once; each expert that received tokens runs its
gate_up and down products once over all of them, and the weighted rows are summed back into their tokens.
Experts that received no token cost nothing. Gated-SiLU experts in float32 or bfloat16 do all of it in one native
call per step (ops/cpu_moe.py), which reads each used expert's weights once whatever its row count (on CPUs with
avx512_bf16, bfloat16 experts in linear_bf16's layout; where AMX serves it, a step with many rows per expert
runs each expert through linear_bf16's tiles on that same layout instead); elsewhere (no C compiler, other
activations, biases, float16, bfloat16 sizes the dot layout cannot take) each expert runs torch.mm on its slice
(float32) or the dense layers' kernel choice of ops/dense_linear.py (half types), with one index_add_ summing
back. On CUDA the same grouping runs in one Triton kernel per product (ops/triton_moe.py).

Experts in a quantized format (AWQ, GPTQ, compressed-tensors, fp8, online int8 / fp8) are each two of the layer
library's linear layers in that format (ExpertLinearsMoEMethod): the same grouping, one product per used expert
on the format's own kernels. GGUF keeps its experts' blocks stacked (layers/quantization/gguf_moe.py).

Tensor parallelism splits each expert's intermediate features as LlamaMLP splits its own: a rank holds rows
[r * I/n, (r + 1) * I/n) of w1 and w3 and the same columns of w2, and one all-reduce sums the ranks' outputs.

Expert parallelism (the group's `expert_parallel`, vLLM's enable_expert_parallel) instead places whole experts
on the ranks, contiguous as vLLM's "linear" placement puts them: with E experts on n ranks, rank r holds
E // n of them, one more for the first E % n ranks. The router runs replicated on every rank; each rank runs
its own experts' (token, expert) pairs for all tokens, and the same one all-reduce sums the ranks' outputs.
Every rank already holds every token (the ranks are tensor-parallel), so no all-to-all dispatch is needed:
it would move the same activations to fewer ranks but add a second collective per layer.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.distributed.parallel_state import SINGLE, building_with, current_group
from pagellm.layers.activation import SiluAndMul
from pagellm.layers.linear import LinearBase, MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.quantization.unquantized import Unquantized
from pagellm.layers.weights import copy_checked, set_weight_attrs
from pagellm.ops.cpu_moe import CpuMoEKernel, cpu_moe_kernel
from pagellm.ops.dense_linear import DenseKernel, UpcastScratch, choose_dense_kernel
from pagellm.ops.gguf_kernels import GGUFExpertsProduct
from pagellm.ops.linear_bf16 import LinearBF16, linear_bf16
from pagellm.ops.w8a8_kernels import ExpertsFp8Product, ExpertsInt8Product, NativeFp8Linear, NativeInt8Linear
from pagellm.ops.wna16 import CpuGroupQuant, ExpertsPackedProduct

SCORING_FUNCTIONS = ("softmax", "sigmoid")
# What the experts apply between gate_up and down: SiLU(gate) * up, or gpt-oss's clamped SwiGLU (vLLM's name).
EXPERT_ACTIVATIONS = ("silu", "swigluoai")
# How a group of experts is scored for group-limited routing: DeepSeek-V2 by its best expert, DeepSeek-V3 by
# the sum of its best two (bias-corrected) scores.
GROUP_SCORES = ("max", "top2_sum")


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert activation on [gate | up] halves (as w13 stacks them): the gate clamped above at `limit`,
    the up projection on both sides, then (up + 1) * gate * sigmoid(alpha * gate), in transformers' order."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


@dataclass(frozen=True)
class Routing:
    """How a token's experts are chosen from its router logits, and how their outputs are weighted."""

    top_k: int
    scoring: str = "softmax"
    # Divide the chosen experts' weights by their sum.
    renormalize: bool = True
    # Group-limited routing: experts fall into `num_expert_group` equal groups, and a token chooses among the
    # experts of its `topk_group` best groups only.
    num_expert_group: int | None = None
    topk_group: int | None = None
    group_score: str = "max"
    routed_scaling_factor: float = 1.0
    # transformers' DeepSeek gates take the chosen set from an unsorted torch.topk (ties may fall otherwise
    # than in a sorted one), the others from a sorted one.
    sorted_choice: bool = True

    @classmethod
    def softmax_top_k(cls, top_k: int, renormalize: bool) -> Routing:
        """Mixtral (renormalised), Qwen3-MoE and OLMoE (as their `norm_topk_prob` says)."""
        return cls(top_k, "softmax", renormalize)

    @classmethod
    def deepseek_v2(cls, config) -> Routing:
        """DeepSeek-V2's gate as transformers runs it: softmax scores, `topk_method` "greedy" or
        "group_limited_greedy", weights scaled by routed_scaling_factor and not renormalised."""
        method = getattr(config, "topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method={method!r} is not supported for DeepSeek-V2; supported: 'greedy', "
                             "'group_limited_greedy'")
        grouped = method == "group_limited_greedy"
        return cls(config.num_experts_per_tok, "softmax", False,
                   config.n_group if grouped else None, config.topk_group if grouped else None, "max",
                   float(getattr(config, "routed_scaling_factor", 1.0)), sorted_choice=False)

    @classmethod
    def deepseek_v3(cls, config) -> Routing:
        """DeepSeek-V3's gate: sigmoid scores, the correction bias added to choose (groups by their two best
        experts), weights from the plain scores, renormalised if `norm_topk_prob`, then scaled."""
        return cls(config.num_experts_per_tok, "sigmoid", bool(getattr(config, "norm_topk_prob", True)),
                   config.n_group, config.topk_group, "top2_sum", float(config.routed_scaling_factor),
                   sorted_choice=False)

    @property
    def grouped(self) -> bool:
        return self.num_expert_group is not None

    def check(self, num_experts: int) -> None:
        """Refuses, naming the value, a setting the kernels cannot take for `num_experts` experts."""
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts}: a mixture-of-experts layer needs at least one expert")
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} with {num_experts} experts: each token must choose "
                             f"between 1 and {num_experts} experts")
        if self.scoring not in SCORING_FUNCTIONS:
            raise ValueError(f"scoring_func={self.scoring!r} is not supported; supported: {SCORING_FUNCTIONS}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group score {self.group_score!r} is not supported; supported: {GROUP_SCORES}")
        if not self.grouped:
            return
        groups, chosen = self.num_expert_group, self.topk_group
        if groups is None or groups < 1 or num_experts % groups:
            raise ValueError(f"n_group={groups} does not split {num_experts} experts into equal groups; it must "
                             f"divide the expert count")
        if chosen is None or not 1 <= chosen <= groups:
            raise ValueError(f"topk_group={chosen} must be between 1 and n_group={groups}")
        per_group = num_experts // groups
        if self.group_score == "top2_sum" and per_group < 2:
            raise ValueError(f"n_group={groups} leaves {per_group} expert per group; DeepSeek-V3's routing scores a "
                             "group by its two best experts, so each group needs at least 2")
        if chosen * per_group < self.top_k:
            raise ValueError(f"topk_group={chosen} groups of {per_group} experts hold fewer than "
                             f"num_experts_per_tok={self.top_k} experts; raise topk_group or lower the top-k")

    def select(self, router_logits: torch.Tensor,
               correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] float32, topk_ids [T, k] int64) for router_logits [T, num_experts]."""
        if self.scoring == "softmax":
            scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        else:
            scores = router_logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if self.grouped:
            choice = self._mask_groups(choice)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=self.sorted_choice)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + 1e-20 if self.scoring == "sigmoid" else total)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights, ids

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with every expert outside each token's topk_group best groups masked out."""
        tokens, num_experts = choice.shape
        grouped = choice.view(tokens, self.num_expert_group, num_experts // self.num_expert_group)
        if self.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_ids = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_ids, 1).bool()
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, num_experts)
        # DeepSeek-V2 zeroes the softmax scores it drops, V3 sets its biased scores to -inf.
        return choice.masked_fill(~keep, 0.0 if self.group_score == "max" else float("-inf"))


# A checkpoint's per-expert tensor: Mixtral's experts.N.w1/w2/w3, or Qwen-MoE's / DeepSeek's / OLMoE's
# experts.N.gate_proj/up_proj/down_proj, and their biases where the experts have them (gpt-oss). Shared experts
# (`shared_experts.gate_proj`) carry no number.
_EXPERT_TENSOR = re.compile(r"^(?P<layer>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)"
                            r"\.(?P<kind>weight|bias)$")
# Any tensor of an expert's module, for experts kept as linear layers of a quantized format (qweight, scales,
# weight_scale, ...).
_EXPERT_MODULE_TENSOR = re.compile(r"^(?P<layer>.*\.experts)\.(?P<expert>\d+)\."
                                   r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.(?P<kind>\w+)$")
_SHARD_OF_PROJ = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2", "down_proj": "w2"}
SHARD_IDS = ("w1", "w3", "w2")


@dataclass(frozen=True)
class ExpertCheckpointNames:
    """How a family's checkpoints name one expert's modules: the MoE block (which pagellm calls `mlp`), and the
    gate/up projections fused (vLLM's name for them) and the down projection. A quantized format's per-module
    rules (ignore lists, modules left unconverted, GPTQ's dynamic rules) are matched against these names."""

    block: str = "mlp"
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"

    def experts_prefix(self, layer_prefix: str) -> str:
        """The checkpoint's name for the experts of pagellm's FusedMoE `layer_prefix` (model.layers.0.mlp.experts)."""
        if self.block == "mlp":
            return layer_prefix
        parent, _, experts = layer_prefix.rpartition(".")
        return f"{parent.rpartition('.')[0]}.{self.block}.{experts}"


MIXTRAL_EXPERT_NAMES = ExpertCheckpointNames("block_sparse_moe", "w13", "w2")


@dataclass(frozen=True)
class ExpertPlacement:
    """The experts one rank holds: [start, start + count) of the layer's `total`."""

    start: int
    count: int
    total: int

    @classmethod
    def whole(cls, num_experts: int) -> ExpertPlacement:
        return cls(0, num_experts, num_experts)

    @classmethod
    def for_rank(cls, num_experts: int, rank: int, size: int) -> ExpertPlacement:
        """vLLM's linear placement (determine_expert_map): E // size each, one more on the first E % size ranks."""
        base, extra = divmod(num_experts, size)
        return cls(rank * base + min(rank, extra), base + (rank < extra), num_experts)

    @property
    def holds_all(self) -> bool:
        return self.count == self.total

    def local_index(self, expert_id: int) -> int | None:
        """Where global expert `expert_id` sits in this rank's stacked weights, or None if another rank holds it."""
        local = expert_id - self.start
        return local if 0 <= local < self.count else None


@dataclass(frozen=True)
class ExpertTarget:
    """Where one checkpoint expert tensor goes: parameter `param` (w13_/w2_ weight or bias) of a FusedMoE,
    expert `expert_id`, shard `shard_id` (w1 gate, w3 up, w2 down)."""

    param: str
    expert_id: int
    shard_id: str


class FusedMoEMethodBase(ABC):
    """How the experts' weights are stored and run (unquantized here; quantized formats plug in with their own
    parameters, loaders and kernels)."""

    # Whether a CUDA graph can hold `apply`: not where it reads the step's expert counts back to the host to run
    # one product per used expert (grouped_experts); such models decode eagerly on CUDA.
    cuda_graph_safe = True
    # Whether `apply` adds the layer's expert biases (FusedMoE.expert_bias) after each product (gpt-oss's).
    takes_biases = False

    @abstractmethod
    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        """Register w13 (gate and up stacked, [E, 2 * intermediate, hidden] in this rank's share) and w2
        ([E, hidden, intermediate]) or their quantized equivalents. E is `num_experts`, the experts this rank
        holds (all, or its own under expert parallelism), and `apply` gets ids local to them."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Turn the loaded parameters into what `apply` runs on."""

    @abstractmethod
    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * down(act(gate_up(x))), this rank's partial sum."""

    def kernel_tensors(self, layer: FusedMoE) -> list[torch.Tensor]:
        """Tensors kept beside the parameters (packed copies), counted as weights."""
        return []


def moe_method_for(quant_config: QuantizationConfig | None, prefix: str) -> FusedMoEMethodBase:
    """The experts' method for the checkpoint's format; a ValueError naming a format whose experts no kernel
    takes."""
    if quant_config is None or isinstance(quant_config, Unquantized):
        return UnquantizedFusedMoEMethod()
    make_method = getattr(quant_config, "fused_moe_method", None)
    if make_method is None:
        return ExpertLinearsMoEMethod(quant_config)
    return make_method(prefix)


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    takes_biases = True

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=params_dtype),
                           requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=params_dtype),
                          requires_grad=False)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        layer.gate_up_kernels = layer.down_kernels = None
        layer.native_experts = layer.tile_experts = None
        if layer.w13_weight.device.type != "cpu":
            return
        kernel = cpu_moe_kernel() if _takes_native_experts(layer) else None
        if kernel is not None and (layer.w13_weight.dtype != torch.bfloat16 or linear_bf16() is None
                                   or kernel.takes_dot_layout(layer.w13_weight, layer.w2_weight)):
            # One native call per step for all the experts (ops/cpu_moe.py), on the weights packed for it here:
            # the parameters hold the packed layout from now on (moe_experts.c's panels, or linear_bf16's per
            # expert), which only that kernel and linear_bf16 read.
            dot = kernel.takes_dot_layout(layer.w13_weight, layer.w2_weight)
            layer.native_experts = kernel
            w13p, w2p = kernel.pack(layer.w13_weight.data, layer.w2_weight.data)
            layer.w13_weight.data, layer.w2_weight.data = w13p, w2p
            tiles = linear_bf16() if dot else None
            layer.tile_experts = tiles if tiles is not None and tiles.amx else None
            return
        if layer.w13_weight.dtype == torch.float32:
            # Without the native kernels float32 experts multiply with torch.mm on their slice of the stacked
            # weights: a packed copy per expert (oneDNN, as dense layers keep one) would double their memory.
            return
        # Half types: the dense layers' kernel choice per expert product (widened to float32 per call where the
        # CPU has no instructions for the type, pagellm's bf16 kernel where it has).
        scratch = UpcastScratch()
        layer.gate_up_kernels = [choose_dense_kernel(w, True, scratch)[0] for w in layer.w13_weight.data]
        layer.down_kernels = [choose_dense_kernel(w, True, scratch)[0] for w in layer.w2_weight.data]

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            from pagellm.ops.triton_moe import fused_experts

            return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                 layer.expert_bias("gate_up"), layer.expert_bias("down"),
                                 None if layer.activation == "silu" else layer.act_fn)
        if layer.tile_experts is not None and takes_tiles(topk_ids, layer.local_num_experts, layer.tile_experts):
            return linear_bf16_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                       layer.tile_experts, layer.act_fn)
        if layer.native_experts is not None:
            return layer.native_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        return grouped_experts(x, topk_weights, topk_ids, layer.local_num_experts, self._product(layer, "gate_up"),
                               self._product(layer, "down"), 2 * layer.intermediate_size, layer.act_fn)

    @staticmethod
    def _product(layer: FusedMoE, which: str) -> ExpertProduct:
        kernels: list[DenseKernel] | None = layer.gate_up_kernels if which == "gate_up" else layer.down_kernels
        bias = layer.expert_bias(which)
        if kernels is not None:
            return lambda expert, rows, out: out.copy_(kernels[expert](rows, None if bias is None else bias[expert]))
        stacked = layer.w13_weight if which == "gate_up" else layer.w2_weight
        # Straight into the caller's rows: no temporary, no copy.
        if bias is not None:
            return lambda expert, rows, out: torch.mm(rows, stacked[expert].t(), out=out).add_(bias[expert])
        return lambda expert, rows, out: torch.mm(rows, stacked[expert].t(), out=out)

    def kernel_tensors(self, layer: FusedMoE) -> list[torch.Tensor]:
        kernels = (layer.gate_up_kernels or []) + (layer.down_kernels or [])
        return [tensor for kernel in kernels for tensor in kernel.tensors()]


class ExpertLinearsMoEMethod(FusedMoEMethodBase):
    """Each expert as two of the layer library's linear layers in the checkpoint's format, its gate/up fused and
    its down: every format a dense layer takes (AWQ, GPTQ, compressed-tensors, fp8, online int8 / fp8) holds and
    runs experts too, on that format's kernels (C on the CPU, Triton on CUDA) and at its bytes, with its loaders,
    tensor-parallel slicing and refusals. A step runs one product per used expert and projection over the rows
    routed to it (grouped_experts), as the unquantized experts do without their native kernel.

    The layers' names follow the checkpoint's (ExpertCheckpointNames), so that the format's per-module rules
    (ignore lists, modules left unconverted, GPTQ's dynamic rules) read the expert modules they name."""

    cuda_graph_safe = False

    def __init__(self, quant_config: QuantizationConfig) -> None:
        self.quant_config = quant_config

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        features = intermediate_size * layer.feature_ranks
        names = layer.checkpoint_names
        experts = names.experts_prefix(layer.prefix)
        ids = range(layer.placement.start, layer.placement.start + num_experts)
        # Under expert parallelism a rank holds whole experts: their layers split nothing.
        with building_with(SINGLE if layer.expert_parallel else current_group()):
            layer.expert_gate_up = nn.ModuleList(
                MergedColumnParallelLinear(hidden_size, [features, features], False, self.quant_config,
                                           f"{experts}.{expert}.{names.gate_up}") for expert in ids)
            layer.expert_down = nn.ModuleList(
                RowParallelLinear(features, hidden_size, False, self.quant_config, f"{experts}.{expert}.{names.down}",
                                  reduce_results=False) for expert in ids)
        layer.expert_products = None

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        if layer.expert_products is None:
            # After every layer has prepared its weights (the expert layers are processed after this one).
            layer.expert_products = (_experts_product(layer.expert_gate_up), _experts_product(layer.expert_down))
        gate_up, down = layer.expert_products
        return grouped_experts_together(x, topk_weights, topk_ids, layer.local_num_experts, gate_up, down,
                                        2 * layer.intermediate_size, layer.act_fn)


def _expert_product(linear: LinearBase) -> Callable[[torch.Tensor], torch.Tensor]:
    """rows -> rows @ W^T of an expert's layer: its method's prepared product where it has one, else its matmul
    (this rank's partial product: FusedMoE sums the ranks once for all experts)."""
    return linear.direct_product() or (lambda rows: linear.matmul(rows))


def _experts_product(linears: nn.ModuleList) -> ExpertsProduct:
    """One projection of the experts: where the CPU kernels of their format have a call for many experts, a
    step whose experts all have rows few enough for it (a decode step's) in one call for all of them; otherwise
    each expert's product in turn."""
    together = _one_call_for_experts([linear.quant_method.loaded_kernel(linear) for linear in linears])
    products = (together.expert_products() if isinstance(together, ExpertsPackedProduct)
                else [_expert_product(linear) for linear in linears])
    one_by_one = one_at_a_time(lambda expert, rows, out: out.copy_(products[expert](rows)))
    return one_call_or_each(together, one_by_one)


def one_call_or_each(together, one_by_one: ExpertsProduct) -> ExpertsProduct:
    """`together` (a C call for all of a step's experts, or None) for the steps it takes, else `one_by_one`."""
    if together is None:
        return one_by_one

    def run(experts: list[int], sizes: list[int], rows: torch.Tensor, out: torch.Tensor) -> None:
        if (together.takes(sizes, rows.dtype) and rows.dtype is out.dtype and rows.is_contiguous()
                and out.is_contiguous()):
            together(experts, sizes, rows, out)
        else:
            one_by_one(experts, sizes, rows, out)

    return run


def _one_call_for_experts(kernels: list[object]):
    """The C call running every expert of a projection at once for the experts' kernels (group-quantized 4/8-bit
    on the packed path, int8 W8A8, fp8, the GGUF kernels' blocks: NVFP4, NF4), or None where their kernels have
    none (other devices, formats)."""
    if all(isinstance(kernel, CpuGroupQuant) and len(kernel.layouts) == 1 for kernel in kernels):
        return ExpertsPackedProduct(kernels[0].kernels, [kernel.layouts[0][1] for kernel in kernels])
    if all(type(kernel) is NativeInt8Linear for kernel in kernels):
        return ExpertsInt8Product(kernels)
    if all(type(kernel) is NativeFp8Linear for kernel in kernels):
        return ExpertsFp8Product(kernels)
    return GGUFExpertsProduct.of(kernels)


def _takes_native_experts(layer: FusedMoE) -> bool:
    """Gated-SiLU experts without biases, float32 or bfloat16."""
    if layer.activation != "silu" or any(layer.expert_bias(which) is not None for which in ("gate_up", "down")):
        return False
    return CpuMoEKernel.supports(layer.w13_weight, layer.w2_weight)


def takes_tiles(topk_ids: torch.Tensor, num_experts: int, tiles: LinearBF16) -> bool:
    """Whether a step's experts go through linear_bf16's AMX tiles one at a time rather than the fused vector
    kernel: when its (token, expert) pairs give the average expert as many rows as the tiles want."""
    return topk_ids.numel() >= tiles.amx_min_rows * num_experts


def linear_bf16_experts(x: torch.Tensor, w13d: torch.Tensor, w2d: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, linear: LinearBF16,
                        act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The grouped experts with each product one linear_bf16 call on the expert's slice of the stacked packed
    weights (CpuMoEKernel.pack's linear_bf16 layout): the AMX tiles take an expert's rows from their threshold
    on. The same roundings as the fused kernel, which makes the same sums."""
    return grouped_experts(x, topk_weights, topk_ids, w13d.shape[0],
                           lambda expert, rows, out: out.copy_(linear(rows, w13d[expert], None)),
                           lambda expert, rows, out: out.copy_(linear(rows, w2d[expert], None)),
                           w13d.shape[1] * LinearBF16.PANEL, act_fn)


# (expert, rows [n, in], out [n, out]): writes rows @ W_expert^T into out.
ExpertProduct = Callable[[int, torch.Tensor, torch.Tensor], None]
# (experts, their row counts, rows [sum, in], out [sum, out]): each expert's product over its rows, which follow
# one another in the order of `experts`.
ExpertsProduct = Callable[[list[int], list[int], torch.Tensor, torch.Tensor], None]


def one_at_a_time(product: ExpertProduct) -> ExpertsProduct:
    """An ExpertsProduct calling `product` per expert, on views of its rows made by one split each (slicing them
    one by one in Python cost more than a decode step's small products)."""
    def run(experts: list[int], sizes: list[int], rows: torch.Tensor, out: torch.Tensor) -> None:
        for expert, expert_rows, expert_out in zip(experts, rows.split(sizes), out.split(sizes)):
            product(expert, expert_rows, expert_out)

    return run


def grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                    gate_up: ExpertProduct, down: ExpertProduct, gate_up_width: int,
                    act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The experts' weighted sum per token [T, H]: the T * k (token, expert) pairs sorted by expert once; each
    expert with tokens runs gate_up once over its rows, the gated activation runs once over all rows, each
    expert's down once over its rows; the weighted rows are summed back into their tokens with one index_add_."""
    return grouped_experts_together(x, topk_weights, topk_ids, num_experts, one_at_a_time(gate_up),
                                    one_at_a_time(down), gate_up_width, act_fn)


def grouped_experts_together(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                             gate_up: ExpertsProduct, down: ExpertsProduct, gate_up_width: int,
                             act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """grouped_experts with products that take all of a step's experts at once (ExpertsProduct)."""
    tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    # Stable: an expert's rows keep token order, so each token's sum adds its experts in ascending order.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    experts = [expert for expert, count in enumerate(counts) if count]
    sizes = [counts[expert] for expert in experts]
    token_of_row = order // top_k
    rows_in = x.index_select(0, token_of_row)
    gate_up_rows = rows_in.new_empty(rows_in.shape[0], gate_up_width)
    gate_up(experts, sizes, rows_in, gate_up_rows)
    activated = act_fn(gate_up_rows)
    rows_out = torch.empty_like(rows_in)
    down(experts, sizes, activated, rows_out)
    rows_out.mul_(topk_weights.reshape(-1).index_select(0, order).unsqueeze(1).to(rows_out.dtype))
    return torch.zeros_like(x).index_add_(0, token_of_row, rows_out)


class FusedMoE(nn.Module):
    """`num_experts` gated-SiLU experts of `intermediate_size` features each, each token weighted over the `top_k`
    experts its router logits choose. Under tensor parallelism a rank holds a slice of every expert's features;
    with the group's expert parallelism, whole experts (`placement`).

    gpt-oss's experts (`activation` "swigluoai", `has_bias`) apply ClampedSwiGLU and add a bias after each
    product: gate/up's split with the features, down's added by the rank holding feature slice 0 only (the
    methods whose `takes_biases` says so: unquantized, and GGUF / MXFP4 blocks)."""

    # What the unquantized method's process_weights_after_loading chose for the CPU: the native experts kernel
    # (weights packed for it), or per-expert dense kernels of half types; neither: torch.mm per expert.
    native_experts: CpuMoEKernel | None = None
    # Where AMX serves linear_bf16 and the experts are in its layout: the steps `takes_tiles` gives to it.
    tile_experts: LinearBF16 | None = None
    gate_up_kernels: list[DenseKernel] | None = None
    down_kernels: list[DenseKernel] | None = None

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 activation: str = "silu", quant_config: QuantizationConfig | None = None, prefix: str = "",
                 routing: Routing | None = None, reduce_results: bool = True,
                 has_correction_bias: bool = False, has_bias: bool = False, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, checkpoint_names: ExpertCheckpointNames = ExpertCheckpointNames()) -> None:
        super().__init__()
        self.group = current_group()
        self.prefix = prefix
        self.checkpoint_names = checkpoint_names
        self.routing = routing or Routing.softmax_top_k(top_k, renormalize=True)
        if self.routing.top_k != top_k:
            raise ValueError(f"{prefix}: top_k={top_k} but the routing chooses {self.routing.top_k} experts")
        self.routing.check(num_experts)
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"{prefix}: hidden_act={activation!r} is not supported for experts; supported: "
                             f"{EXPERT_ACTIVATIONS}")
        self.expert_parallel = self.group.expert_parallel and self.group.size > 1
        self.placement = self._place_experts(num_experts, prefix)
        # The ranks the intermediate features are split over: none under expert parallelism.
        self.feature_rank, self.feature_ranks = (0, 1) if self.expert_parallel else (self.group.rank, self.group.size)
        if intermediate_size < 1 or intermediate_size % self.feature_ranks:
            raise ValueError(
                f"{prefix}: tensor_parallel_size={self.group.size} does not divide the experts' intermediate size "
                f"({intermediate_size}); each rank needs an equal share of every expert: use a size dividing "
                f"{intermediate_size}, or enable_expert_parallel to give each rank whole experts")
        self.num_experts = num_experts
        self.local_num_experts = self.placement.count
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size // self.feature_ranks
        self.reduce_results = reduce_results
        self.activation = activation
        self.act_fn = SiluAndMul() if activation == "silu" else ClampedSwiGLU(swiglu_alpha, swiglu_limit)
        # DeepSeek-V3's per-expert bias (float32, as its checkpoints store it), added to the scores only to
        # choose experts; its checkpoint name is the model's to map (`mlp.gate.e_score_correction_bias`).
        if has_correction_bias:
            bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            self.register_parameter("e_score_correction_bias", bias)
        else:
            self.register_parameter("e_score_correction_bias", None)
        # Experts kept as linear layers of a quantized format (ExpertLinearsMoEMethod): this rank's experts'
        # gate/up and down layers (set as instance attributes: a class default would hide the registered modules).
        self.expert_gate_up: nn.ModuleList | None = None
        self.expert_down: nn.ModuleList | None = None
        self.quant_method = moe_method_for(quant_config, prefix)
        self.quant_method.create_weights(self, self.local_num_experts, hidden_size, self.intermediate_size,
                                         torch.get_default_dtype())
        self._create_biases(has_bias, prefix)
        shards = {"w13_weight": ("w1", "w3"), "w2_weight": ("w2",), "w13_bias": ("w1", "w3"), "w2_bias": ("w2",)}
        for name, param in self.named_parameters(recurse=False):
            if name not in shards:
                continue  # the correction bias loads whole
            # (expert, shard) pairs a complete checkpoint fills, as the model's loader counts them: every expert's,
            # those another rank holds included (this rank's loader passes over them).
            set_weight_attrs(param, weight_loader=self._checkpoint_loader,
                             shard_ids=tuple((e, s) for e in range(num_experts) for s in shards[name]))

    def _create_biases(self, has_bias: bool, prefix: str) -> None:
        """w13_bias [E, 2 * intermediate] (this rank's gate then up features, as w13 stacks them) and w2_bias
        [E, hidden], or None for experts without biases."""
        if not has_bias:
            self.register_parameter("w13_bias", None)
            self.register_parameter("w2_bias", None)
            return
        if not self.quant_method.takes_biases:
            raise ValueError(f"{prefix}: experts with biases run unquantized or in MXFP4 / GGUF blocks, not in the "
                             f"{type(self.quant_method).__name__} format; use the float checkpoint")
        dtype = torch.get_default_dtype()
        self.w13_bias = nn.Parameter(torch.empty(self.local_num_experts, 2 * self.intermediate_size, dtype=dtype),
                                     requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(self.local_num_experts, self.hidden_size, dtype=dtype),
                                    requires_grad=False)

    def expert_bias(self, which: str) -> torch.Tensor | None:
        """The stacked bias added after the `which` ("gate_up" or "down") product, or None. Down's is added by the
        rank holding feature slice 0 alone: the ranks' partial outputs are summed, and it must count once."""
        if which == "gate_up":
            return self.w13_bias
        return self.w2_bias if self.feature_rank == 0 else None

    def _place_experts(self, num_experts: int, prefix: str) -> ExpertPlacement:
        if not self.expert_parallel:
            return ExpertPlacement.whole(num_experts)
        if num_experts < self.group.size:
            experts = f"{num_experts} expert" + ("" if num_experts == 1 else "s")
            raise ValueError(
                f"{prefix}: enable_expert_parallel places whole experts on the tensor_parallel_size="
                f"{self.group.size} ranks, but this layer has {experts}, so a rank would hold none; use "
                f"tensor_parallel_size <= {num_experts}, or leave expert parallelism off to split every expert")
        return ExpertPlacement.for_rank(num_experts, self.group.rank, self.group.size)

    @staticmethod
    def checkpoint_target(name: str) -> tuple[str, ExpertTarget] | None:
        """(parameter name, where in it) of a checkpoint expert tensor name, or None for any other tensor:
        `model.layers.3.block_sparse_moe.experts.5.w1.weight` -> (`...experts.w13_weight`, expert 5, "w1")."""
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            return None
        shard = _SHARD_OF_PROJ[match["proj"]]
        param = ("w2_" if shard == "w2" else "w13_") + match["kind"]
        return f"{match['layer']}.{param}", ExpertTarget(param, int(match["expert"]), shard)

    def expert_layer_target(self, expert_id: int, proj: str, kind: str) -> tuple[str, object] | None:
        """Where tensor `kind` (qweight, weight_scale, ...) of expert `expert_id`'s checkpoint module `proj` loads
        when the experts are linear layers: (parameter name under this layer, shard of the layer), or None where
        another rank holds the expert."""
        name = f"{self.prefix}.{expert_id}.{proj}.{kind}"
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{name}: expert {expert_id} is out of range; this layer has {self.num_experts}")
        local = self.placement.local_index(expert_id)
        if local is None:
            return None
        shard = _SHARD_OF_PROJ[proj]
        if shard == "w2":
            return f"expert_down.{local}.{kind}", None
        return f"expert_gate_up.{local}.{kind}", 0 if shard == "w1" else 1

    @staticmethod
    def make_expert_params_mapping(num_experts: int, gate: str = "gate_proj", up: str = "up_proj",
                                   down: str = "down_proj") -> list[tuple[str, str, int, str]]:
        """vLLM's table: (parameter prefix, checkpoint name prefix, expert_id, shard_id) per expert tensor."""
        return [(("experts.w2_weight" if shard == "w2" else "experts.w13_weight"), f"experts.{expert}.{proj}.",
                 expert, shard)
                for expert in range(num_experts) for shard, proj in (("w1", gate), ("w2", down), ("w3", up))]

    def _checkpoint_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: tuple[int, str]) -> None:
        expert_id, shard_id = shard
        self.weight_loader(param, tensor, shard_id, expert_id)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str, expert_id: int) -> None:
        """One expert's w1 (gate) or w3 (up) [I, H], or w2 (down) [H, I], as the checkpoint stores it: this
        rank's slice of the intermediate features goes to its place in the stacked parameter; under expert
        parallelism the whole tensor of an expert this rank holds, and nothing of the others'."""
        name = f"{self.prefix}.experts.{expert_id}.{shard_id}"
        if shard_id not in SHARD_IDS:
            raise ValueError(f"{name}: unknown expert shard {shard_id!r}; shards are {SHARD_IDS}")
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{name}: expert {expert_id} is out of range; this layer has {self.num_experts}")
        if param is self.w13_bias or param is self.w2_bias:
            self._load_bias(param, loaded_weight, shard_id, expert_id, name)
            return
        load_expert = getattr(self.quant_method, "load_expert", None)
        if load_expert is not None:  # a method that keeps the file's own blocks (GGUF) stacks them itself
            load_expert(self, loaded_weight, shard_id, expert_id)
            return
        # w1/w3 hold the intermediate features along rows, w2 along columns: this rank takes its slice.
        dim = 1 if shard_id == "w2" else 0
        size, total = self.intermediate_size, self.intermediate_size * self.feature_ranks
        if loaded_weight.dim() != 2 or loaded_weight.shape[dim] != total:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(loaded_weight.shape)}; expected "
                             f"{total} intermediate features along dimension {dim}")
        local = self.placement.local_index(expert_id)
        if local is None:
            return
        rank_slice = loaded_weight.narrow(dim, self.feature_rank * size, size)
        expert = param.data[local]
        if shard_id != "w2":
            expert = expert.narrow(0, 0 if shard_id == "w1" else size, size)
        copy_checked(expert, rank_slice, name)

    def _load_bias(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str, expert_id: int,
                   name: str) -> None:
        """One expert's gate (w1) or up (w3) bias [intermediate], this rank's slice into its half of w13_bias, or
        its down (w2) bias [hidden], whole."""
        total = self.hidden_size if shard_id == "w2" else self.intermediate_size * self.feature_ranks
        if tuple(loaded_weight.shape) != (total,):
            raise ValueError(f"checkpoint tensor {name!r} (bias) has shape {tuple(loaded_weight.shape)}; "
                             f"expected ({total},)")
        local = self.placement.local_index(expert_id)
        if local is None:
            return
        if shard_id == "w2":
            copy_checked(param.data[local], loaded_weight, name)
            return
        size = self.intermediate_size
        copy_checked(param.data[local].narrow(0, 0 if shard_id == "w1" else size, size),
                     loaded_weight.narrow(0, self.feature_rank * size, size), name)

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.routing.select(router_logits, self.e_score_correction_bias)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], router_logits [T, num_experts] -> [T, H], summed over the ranks."""
        topk_weights, topk_ids = self.select_experts(router_logits)
        if self.placement.holds_all:
            out = self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        else:
            out = self._apply_local_experts(hidden, topk_weights, topk_ids)
        return self.group.all_reduce(out) if self.reduce_results else out

    def _apply_local_experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                             topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's part under expert parallelism: the (token, expert) pairs routed to its experts, run by the
        experts' method as one choice per row (ids local to the rank), summed back into their tokens; tokens with
        no pair here get zeros."""
        local_ids = topk_ids.reshape(-1) - self.placement.start
        pairs = ((local_ids >= 0) & (local_ids < self.placement.count)).nonzero().squeeze(1)
        out = torch.zeros_like(hidden)
        if pairs.numel() == 0:
            return out
        tokens = pairs // topk_ids.shape[1]
        rows = self.quant_method.apply(self, hidden.index_select(0, tokens),
                                       topk_weights.reshape(-1).index_select(0, pairs).unsqueeze(1),
                                       local_ids.index_select(0, pairs).unsqueeze(1))
        return out.index_add_(0, tokens, rows)

    def extra_repr(self) -> str:
        held = "" if self.placement.holds_all else \
            f" (this rank: {self.placement.start}..{self.placement.start + self.placement.count - 1})"
        return (f"experts={self.num_experts}{held}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, routing={self.routing}, activation={self.activation}, "
                f"bias={self.w13_bias is not None}, method={type(self.quant_method).__name__}")


def num_experts_of(config) -> int:
    """The expert count, whichever name the config gives it (Mixtral's num_local_experts, Qwen's and OLMoE's
    num_experts)."""
    count = getattr(config, "num_experts", None)
    return int(count if count is not None else config.num_local_experts)


class SparseMoeBlock(nn.Module):
    """A router (`gate`, kept unquantized and replicated, as vLLM keeps it) and the experts it routes to: the MLP
    of Mixtral, Qwen3-MoE and OLMoE layers."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, routing: Routing,
                 quant_config: QuantizationConfig | None, prefix: str, activation: str = "silu",
                 checkpoint_names: ExpertCheckpointNames = ExpertCheckpointNames()) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, None, f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, activation, quant_config,
                                f"{prefix}.experts", routing, checkpoint_names=checkpoint_names)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))

    @classmethod
    def from_config(cls, config, intermediate_size: int, quant_config: QuantizationConfig | None, prefix: str,
                    renormalize: bool | None = None,
                    checkpoint_names: ExpertCheckpointNames = ExpertCheckpointNames()) -> SparseMoeBlock:
        """The softmax top-k block of an HF config: `num_experts_per_tok` of its experts, renormalised as
        `renormalize` says, or as the config's `norm_topk_prob` does where not given."""
        top_k = config.num_experts_per_tok
        if renormalize is None:
            renormalize = bool(getattr(config, "norm_topk_prob", False))
        return cls(num_experts_of(config), top_k, config.hidden_size, intermediate_size,
                   Routing.softmax_top_k(top_k, renormalize), quant_config, prefix,
                   getattr(config, "hidden_act", "silu"), checkpoint_names)


class ExpertCheckpointMixin:
    """For a causal LM built on LlamaForCausalLM: per-expert checkpoint tensors load into their FusedMoE's stacked
    parameters. `moe_block_names` are the names a family's checkpoints give the MoE block (Mixtral's
    `block_sparse_moe`), which pagellm calls `mlp`."""

    moe_block_names: tuple[str, ...] = ()

    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        for block in self.moe_block_names:
            name = name.replace(f".{block}.", ".mlp.")
        in_layers = expert_layers_target(self, name)
        if in_layers is not None:
            return in_layers
        expert = FusedMoE.checkpoint_target(name)
        if expert is not None:
            param, target = expert
            return param, (target.expert_id, target.shard_id)
        return super().checkpoint_target(name)


def expert_layers_target(model: nn.Module, name: str) -> tuple[str | None, object] | None:
    """For a tensor of an expert's module (model.layers.0.mlp.experts.5.gate_proj.qweight) whose FusedMoE keeps
    its experts as linear layers: (parameter name, shard), or (None, None) where another rank holds the expert;
    None for any other tensor."""
    match = _EXPERT_MODULE_TENSOR.match(name)
    if match is None:
        return None
    try:
        layer = model.get_submodule(match["layer"])
    except AttributeError:
        return None
    if not isinstance(layer, FusedMoE) or layer.expert_gate_up is None:
        return None
    target = layer.expert_layer_target(int(match["expert"]), match["proj"], match["kind"])
    return (None, None) if target is None else (f"{match['layer']}.{target[0]}", target[1])


def cuda_graph_safe(model: nn.Module) -> bool:
    """Whether every mixture-of-experts layer of `model` can run inside a CUDA graph."""
    return all(module.quant_method.cuda_graph_safe for module in model.modules() if isinstance(module, FusedMoE))
