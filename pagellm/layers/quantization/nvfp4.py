"""NVFP4 checkpoints' linear weights kept in 4 bits: llm-compressor's compressed-tensors "nvfp4-pack-quantized"
(schemes NVFP4A16 and NVFP4) and NVIDIA ModelOpt's NVFP4 / W4A16_NVFP4 exports, run weight-only (W4A16) as vLLM runs
them on GPUs without FP4 units (its Marlin path): activations stay in the model's dtype, and a W4A4 checkpoint's input
scales are read and not applied.

Per linear module, as compressed-tensors / ModelOpt name them:
  weight_packed / weight     uint8 [N, K / 2]: e2m1 codes (sign in bit 3; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6),
                             weight 2i in byte i's low nibble and 2i + 1 in its high one;
  weight_scale               float8_e4m3fn [N, K / 16]: each 16 weights' scale;
  weight_global_scale        float32 [1], a divisor: w = e2m1 * weight_scale / weight_global_scale;
  / weight_scale_2           float32 scalar, a factor: w = e2m1 * weight_scale * weight_scale_2;
  input_global_scale / input_scale   (W4A4 only) passed over.
A layer's weights are kept as the GGUF kernels' NVFP4_F16 blocks (models/gguf_quants.py, nvfp4_f16_blocks): two
16-weight halves per 32-weight block, each with its own f16 scale into which the global scale is folded, so the
shards of a fused layer (q/k/v, gate/up), each with its own global scale, need no common one; 5 bits a weight where
the checkpoint has 4.5. The one rounding is the scale's to f16 (2^-11 of it). The layers run as a GGUF file's do
(ops/gguf_kernels.py: C on the CPU, Triton on CUDA).
A weight whose input features are not a multiple of 32, and a quantized module of a layer the format does not build
(a router made unquantized), arrive dequantized in float32 and run in the model's dtype, the former said in the log.
Mixture-of-experts experts are the format's linear layers (layers/fused_moe.py, ExpertLinearsMoEMethod).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pagellm.layers.quantization.base import grouped_pieces
from pagellm.layers.quantization.gguf import GGUFLinearMethod, GGUFWeight
from pagellm.layers.quantization.group_quant import checkpoint_modules
from pagellm.models.gguf_quants import nvfp4_f16_blocks

logger = logging.getLogger(__name__)

GROUP_SIZE = 16  # weights per NVFP4 scale
KEPT_BLOCK = 32  # weights per NVFP4_F16 block
KEPT_TYPE = "NVFP4_F16"
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES))  # by code: bit 3 the sign
REQUIRED = frozenset({"packed", "scales", "global"})


@dataclass(frozen=True)
class Flavour:
    """How one producer names a module's NVFP4 tensors, and which way its global scale goes."""

    name: str
    packed: str
    global_scale: str
    input_scale: str
    divides: bool  # w = e2m1 * scale / global (compressed-tensors), or * global (ModelOpt)

    def piece(self, suffix: str) -> str | None:
        return {self.packed: "packed", "weight_scale": "scales", self.global_scale: "global",
                self.input_scale: "input"}.get(suffix)


COMPRESSED_TENSORS = Flavour("compressed-tensors", "weight_packed", "weight_global_scale", "input_global_scale", True)
MODELOPT = Flavour("modelopt", "weight", "weight_scale_2", "input_scale", False)


@dataclass
class NVFP4Weight:
    """One weight as an NVFP4 checkpoint stores it."""

    packed: torch.Tensor  # uint8 [N, K / 2]
    block_scales: torch.Tensor  # float8_e4m3fn [N, K / 16]
    global_scale: torch.Tensor  # float32 scalar
    divides: bool

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    def group_scales(self) -> torch.Tensor:
        """float32 [N, K / 16]: each group's scale with the global one applied, as the producer's own
        dequantization computes it (in float32)."""
        scales = self.block_scales.float()
        return scales / self.global_scale if self.divides else scales * self.global_scale

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return e2m1_values(self.packed) * self.group_scales().repeat_interleave(GROUP_SIZE, dim=1)

    def factor(self) -> float:
        """The global scale as the factor multiplying the block scales, in double precision."""
        value = float(self.global_scale)
        if not self.divides:
            return value
        return 1.0 / value if value else math.inf  # refused by the conversion, naming the tensor


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] of e2m1 codes (low nibble first) -> float32 [N, K]."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return E2M1_VALUES[codes.long()]


def read_weight(name: str, parts: dict[str, torch.Tensor], flavour: Flavour) -> NVFP4Weight:
    """A weight's checkpoint tensors (`parts`: packed, scales, global) as an NVFP4Weight, or a ValueError naming
    what does not fit the format."""
    packed, scales, global_scale = parts["packed"], parts["scales"], parts["global"]
    rows, half = packed.shape if packed.dim() == 2 else (0, 0)
    if packed.dim() != 2 or scales.shape != (rows, 2 * half // GROUP_SIZE) or (2 * half) % GROUP_SIZE:
        raise ValueError(f"{name}: {flavour.name} NVFP4 codes {tuple(packed.shape)} and weight_scale "
                         f"{tuple(scales.shape)} do not make a weight [N, K] of groups of {GROUP_SIZE}: expected "
                         f"[N, K / 2] and [N, K / {GROUP_SIZE}]")
    if scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: {flavour.name} NVFP4 weight_scale is {scales.dtype}; NVFP4 stores "
                         "float8_e4m3fn group scales (another scale type is another format, such as MXFP4)")
    if global_scale.numel() != 1:
        raise ValueError(f"{name}: {flavour.name}'s {flavour.global_scale} has shape {tuple(global_scale.shape)}; "
                         "it is one per-tensor value")
    return NVFP4Weight(packed, scales, global_scale.float().reshape(()), flavour.divides)


def kept_blocks(name: str, weight: NVFP4Weight) -> GGUFWeight | None:
    """The kernels' NVFP4_F16 blocks of a weight, or None (said in the log) where its input features are not a
    multiple of their 32."""
    rows, cols = weight.shape
    if cols % KEPT_BLOCK:
        logger.info("NVFP4: %s runs dequantized to the model's dtype: %d input features, where the kernels' "
                    "blocks take multiples of %d", name, cols, KEPT_BLOCK)
        return None
    blocks = nvfp4_f16_blocks(weight.packed.numpy(), weight.block_scales.float().numpy(), weight.factor(), name)
    return GGUFWeight(torch.from_numpy(blocks), KEPT_TYPE, rows, cols)


class NVFP4LinearMethod(GGUFLinearMethod):
    """The GGUF method on NVFP4_F16 blocks (or on the dense tensor of a weight the blocks cannot hold)."""


class NVFP4Pieces:
    """A config's NVFP4 tensors gathered per module (`quantized(module)`: whether the config stores the checkpoint
    module in NVFP4) and handed to the layers as one weight: kept blocks for a module a layer on the NVFP4 method
    takes (`serve`), its float32 dequantization for any other."""

    def __init__(self, flavour: Flavour, quantized: Callable[[str], bool], quantized_activations: bool) -> None:
        self.flavour = flavour
        self.quantized = quantized
        self.quantized_activations = quantized_activations
        self.served: set[str] = set()

    def serve(self, prefix: str) -> None:
        self.served.update({prefix, *checkpoint_modules(prefix)})

    def checkpoint_tensors(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        # Said here, once a load: the config is made more than once (checked, then built).
        inputs = "; its 4-bit activation quantization (input scales) is not applied" \
            if self.quantized_activations else ""
        logger.info("%s NVFP4: weights kept in 4 bits (NVFP4_F16 blocks on the GGUF kernels), activations in the "
                    "model's dtype%s", self.flavour.name, inputs)
        return grouped_pieces(weights, self._piece_of, lambda parts: REQUIRED <= parts.keys(), self._kept,
                              f"{self.flavour.name} NVFP4 weight")

    def _piece_of(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        module, _, suffix = name.rpartition(".")
        piece = self.flavour.piece(suffix)
        if piece is None or (piece == "packed" and tensor.dtype != torch.uint8) or not self.quantized(module):
            return None
        return module, piece

    def _kept(self, module: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, object]]:
        name = f"{module}.weight"
        weight = read_weight(name, parts, self.flavour)
        kept = kept_blocks(name, weight) if module in self.served else None
        yield name, kept if kept is not None else weight.dequantize()


def kernels_in_use(method: GGUFLinearMethod) -> str:
    """For a config's describe(): the kernels the method's layers run on."""
    return method.ops.isa if method.ops is not None else "none built"
