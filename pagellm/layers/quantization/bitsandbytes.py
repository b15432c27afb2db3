"""bitsandbytes checkpoints (transformers' load_in_4bit / load_in_8bit models saved with save_pretrained, such
as unsloth's "-bnb-4bit" ones) and vLLM's in-flight `quantization="bitsandbytes"` of a float checkpoint, on
pagellm's own kernels: bitsandbytes itself is not needed.

4-bit. Per linear module the checkpoint stores (bitsandbytes' QuantState.as_dict(packed=True)):
  weight                                   the flattened weight's 4-bit codes, two per byte, the first in the high
                                           nibble: uint8 [N * K / 2, 1] (or those bytes in bnb_4bit_quant_storage's
                                           dtype);
  weight.absmax                            float32, each block's max |w| (blocksize weights of the flattened
                                           weight); with double quantization uint8 codes of it, with
  weight.nested_absmax / nested_quant_map  absmax = nested_quant_map[code] * nested_absmax[i // nested_blocksize]
                                           + nested_offset;
  weight.quant_map                         float32 [16], the code book (NF4 or bitsandbytes' FP4);
  weight.quant_state.bitsandbytes__nf4     uint8 bytes of JSON: quant_type, blocksize, shape, nested_blocksize,
                                           nested_offset.
  W.flat[i] = quant_map[code i] * absmax[i // blocksize].
A layer's weights are kept as the GGUF kernels' NF4 / BNB_FP4 blocks (models/gguf_quants.py: IQ4_NL's 32-weight
blocks with the code book times 127 for a grid and absmax / 127 as the block's f16 scale; bitsandbytes' blocksizes,
powers of two, divide into them from 32 on) and run as a GGUF file's do, decode stack included: 4.5 bits a weight
where the file has 4.13-4.5. Two roundings are the kernels': the grid's (within 0.4% of a block's absmax) and the
scale's to f16.
A layer whose input features are not a multiple of 32, or whose code book is not bitsandbytes' own, runs
dequantized in the model's dtype, said in the log.

8-bit (LLM.int8). weight int8 [N, K], SCB float32 [N] (each row's max |w|), weight_format (0: rows):
W = q * SCB / 127, kept as the group-quantized kernels' 8-bit weights with one scale per output channel (the
compressed-tensors W8A16 method), activations in the model's dtype: where bitsandbytes quantizes activations to
int8 but for outlier columns, pagellm does not quantize them at all.

In flight (a float checkpoint with quantization="bitsandbytes", vLLM's 4-bit NF4): every linear layer but the
embedding and the LM head becomes NF4 blocks of 32 weights, each block scaled by its own max |w| (vLLM's takes
bitsandbytes' blocks of 64 with double-quantized scales).

Weights go to pagellm's layers as whole tensors of their format (`checkpoint_tensors` groups a weight's pieces,
which the checkpoint stores as several tensors); a quantized module of a layer this format does not build (a
router made unquantized) arrives dequantized.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.layers.quantization.base import LinearMethod, QuantizationConfig, grouped_pieces, stored_text
from pagellm.layers.quantization.compressed_tensors_wna16 import CompressedTensorsWNA16Method
from pagellm.layers.quantization.experts_int8 import INT8_MAX, ZERO_POINT
from pagellm.layers.quantization.gguf import GGUFLinearMethod, GGUFWeight
from pagellm.layers.quantization.group_quant import checkpoint_modules
from pagellm.layers.quantization.unquantized import UnquantizedLinearMethod
from pagellm.layers.quantization.w8a8 import is_embedding_or_head
from pagellm.models.gguf_quants import BNB_FP4_CODES, GRID_SCALE, NF4_CODES, NF4_VALUES, ggml_nibbles

logger = logging.getLogger(__name__)

GRID_BLOCK = 32  # weights per kept block (IQ4_NL's)
# quant_type -> (the kernels' block type, bitsandbytes' code book)
CODE_BOOKS = {"nf4": ("NF4", NF4_CODES), "fp4": ("BNB_FP4", BNB_FP4_CODES)}
STATS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
QUANT_STATE = ".quant_state.bitsandbytes__"


@dataclass
class Packed4bit:
    """One weight as a 4-bit checkpoint stores it, double quantization undone."""

    codes: torch.Tensor  # uint8 [N, K]: index into the code book
    absmax: torch.Tensor  # float32 [ceil(N * K / blocksize)]
    code_book: torch.Tensor  # float32 [16]
    quant_type: str
    blocksize: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as bitsandbytes' dequantize_4bit computes it."""
        rows, cols = self.shape
        scales = self.absmax.repeat_interleave(self.blocksize)[: rows * cols].view(rows, cols)
        return self.code_book[self.codes.long()] * scales


def unpack_4bit(name: str, parts: dict[str, torch.Tensor]) -> Packed4bit:
    """A weight's checkpoint tensors (`parts`: weight, quant_state, absmax, quant_map and the nested ones) as
    codes and float32 block scales."""
    state = json.loads(stored_text(parts["quant_state"]))
    quant_type, blocksize, shape = state["quant_type"], int(state["blocksize"]), state["shape"]
    if quant_type not in CODE_BOOKS or len(shape) != 2:
        raise ValueError(f"{name}: bitsandbytes quant_type={quant_type!r} with shape {shape}; pagellm reads nf4 and "
                         "fp4 weights of two dimensions")
    rows, cols = shape
    packed = parts["weight"].contiguous().view(torch.uint8).flatten()
    if packed.numel() != (rows * cols + 1) // 2:
        raise ValueError(f"{name}: {packed.numel()} bytes of 4-bit codes for a {rows} x {cols} weight")
    codes = torch.stack([packed >> 4, packed & 15], dim=1).flatten()[: rows * cols].view(rows, cols)
    absmax = parts["absmax"]
    if "nested_blocksize" in state:
        nested = int(state["nested_blocksize"])
        blocks = torch.arange(absmax.numel()) // nested
        absmax = (parts["nested_quant_map"].float()[absmax.long()] * parts["nested_absmax"].float()[blocks]
                  + float(state["nested_offset"]))
    return Packed4bit(codes, absmax.float().flatten(), parts["quant_map"].float().flatten(), quant_type, blocksize)


def grid_blocks(codes: torch.Tensor, block_absmax: torch.Tensor, type_name: str) -> GGUFWeight:
    """codes uint8 [N, K] (K a multiple of 32) and each 32 weights' absmax [N, K / 32] as the kernels' grid-type
    blocks: f16 absmax / 127, then 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31."""
    rows, cols = codes.shape
    nibbles = ggml_nibbles(codes)
    scales = (block_absmax.float() / GRID_SCALE).to(torch.float16).view(torch.uint8).view(rows, -1, 2)
    blocks = torch.cat([scales, nibbles], dim=-1).reshape(rows, -1).contiguous()
    return GGUFWeight(blocks, type_name, rows, cols)


def kept_4bit(name: str, weight: Packed4bit) -> GGUFWeight | None:
    """The kernels' blocks of a checkpoint's 4-bit weight, or None (said why in the log) where its blocks do not
    divide into theirs or its code book is not bitsandbytes'."""
    type_name, code_book = CODE_BOOKS[weight.quant_type]
    rows, cols = weight.shape
    if cols % GRID_BLOCK or weight.blocksize % GRID_BLOCK:
        why = f"{cols} input features and blocks of {weight.blocksize}, where the kernels take multiples of 32"
    elif not torch.allclose(weight.code_book, torch.from_numpy(code_book), rtol=0, atol=1e-6):
        why = f"its code book is not bitsandbytes' {weight.quant_type}"
    else:
        per_block = weight.absmax.repeat_interleave(weight.blocksize // GRID_BLOCK)[: rows * cols // GRID_BLOCK]
        return grid_blocks(weight.codes, per_block.view(rows, -1), type_name)
    logger.info("bitsandbytes: %s runs dequantized to the model's dtype: %s", name, why)
    return None


def quantize_nf4(weight: torch.Tensor) -> GGUFWeight:
    """A float weight [N, K] (K a multiple of 32) as NF4 blocks: each 32 weights scaled by their max |w| / 127 (f16),
    each weight the grid value nearest to it at that scale."""
    rows, cols = weight.shape
    grouped = weight.detach().float().cpu().view(rows, cols // GRID_BLOCK, GRID_BLOCK)
    absmax = grouped.abs().amax(dim=-1)
    scale = (absmax / GRID_SCALE).to(torch.float16).float()
    scaled = grouped / torch.where(scale > 0, scale, 1.0)[..., None]
    grid = torch.from_numpy(NF4_VALUES).float()  # ascending
    codes = torch.bucketize(scaled, (grid[1:] + grid[:-1]) / 2).to(torch.uint8).view(rows, cols)
    return grid_blocks(codes, absmax, "NF4")


class BitsAndBytes4bitMethod(GGUFLinearMethod):
    """The GGUF method on a checkpoint's 4-bit weights (kept_4bit's blocks, or dense tensors); `in_flight` also
    quantizes the float weights it is given (quantize_nf4)."""

    def __init__(self, in_flight: bool) -> None:
        super().__init__()
        self.in_flight = in_flight

    def load(self, layer: nn.Module, tensor: GGUFWeight | torch.Tensor, shard) -> None:
        if self.in_flight and isinstance(tensor, torch.Tensor) and tensor.dim() == 2 \
                and tensor.shape[1] % GRID_BLOCK == 0:
            tensor = quantize_nf4(tensor)
        super().load(layer, tensor, shard)


class BitsAndBytes8bitMethod(CompressedTensorsWNA16Method):
    """LLM.int8 weights as compressed-tensors' W8A16 per channel (`_kept_8bit` writes its tensors)."""

    format_name = "bitsandbytes 8-bit"

    def __init__(self) -> None:
        super().__init__(8, None, True, False)


class BitsAndBytesConfig(QuantizationConfig):
    name = "bitsandbytes"

    def __init__(self, bits: int, in_flight: bool = False, skip_modules: Iterable[str] = ()) -> None:
        self.bits = bits
        self.in_flight = in_flight
        self.skip_modules = tuple(skip_modules)
        self.dense = UnquantizedLinearMethod()
        self.method: LinearMethod = BitsAndBytes4bitMethod(in_flight) if bits == 4 else BitsAndBytes8bitMethod()
        # The checkpoint modules whose layers take self.method: a quantized tensor of any other module (a layer
        # built without this config) is handed over dequantized.
        self.served: set[str] = set()

    def linear_method(self, prefix: str) -> LinearMethod:
        if (self.in_flight and is_embedding_or_head(prefix)) or (self.bits == 8 and self._skipped(prefix)):
            return self.dense
        self.served.update({prefix, *checkpoint_modules(prefix)})
        return self.method

    def _skipped(self, prefix: str) -> bool:
        """8-bit checkpoints store float weights for the LM head, the embedding and llm_int8_skip_modules (matched
        as transformers matches them: contained in the module's name)."""
        return is_embedding_or_head(prefix) or any(key in prefix for key in self.skip_modules)

    def checkpoint_tensors(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        if self.in_flight:
            return weights
        return self._grouped_4bit(weights) if self.bits == 4 else self._grouped_8bit(weights)

    def _grouped_4bit(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        return grouped_pieces(weights, _part_of_4bit, _complete_4bit, self._kept_4bit, "4-bit bitsandbytes weight")

    def _kept_4bit(self, weight_name: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, object]]:
        """The kernels' blocks, or the dense weight where they cannot hold it or a layer built otherwise takes it."""
        packed = unpack_4bit(weight_name, parts)
        kept = kept_4bit(weight_name, packed) if weight_name.removesuffix(".weight") in self.served else None
        yield weight_name, kept if kept is not None else packed.dequantize()

    def _grouped_8bit(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
        return grouped_pieces(weights, _part_of_8bit, lambda parts: {"weight", "SCB"} <= parts.keys(),
                              self._kept_8bit, "8-bit bitsandbytes weight")

    def _kept_8bit(self, weight_name: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The W8A16 method's tensors (compressed_tensors_wna16: q + 128 in bytes along the inputs, four to an int32
        word, and a scale per output channel), or the dense weight for a module served otherwise."""
        module = weight_name.removesuffix(".weight")
        q = parts["weight"]
        scale = parts["SCB"].float().flatten() / INT8_MAX
        rows, cols = q.shape
        if module not in self.served:
            yield weight_name, q.float() * scale[:, None]
            return
        if cols % 4:
            raise ValueError(f"{weight_name}: {cols} input features are not a multiple of 4, which pagellm's 8-bit "
                             "kernels pack")
        unsigned = (q.to(torch.int16) + ZERO_POINT).to(torch.uint8).contiguous()
        yield f"{module}.weight_packed", unsigned.view(torch.int32)
        yield f"{module}.weight_scale", scale[:, None]
        yield f"{module}.weight_shape", torch.tensor([rows, cols], dtype=torch.int64)

    def describe(self) -> str:
        if self.bits == 8:
            return "bitsandbytes (8-bit LLM.int8 weights, a scale per output channel; activations in the model dtype)"
        kept = "quantized to NF4 blocks of 32 as it loads" if self.in_flight else "4-bit, kept as NF4 / FP4 blocks"
        kernels = self.method.ops.isa if self.method.ops is not None else "none built"
        return f"bitsandbytes ({kept}; the GGUF kernels: {kernels})"


def _part_of_4bit(name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
    """(the weight's name, which piece of it) for a 4-bit checkpoint's tensor; None for a plain one."""
    for stat in STATS:
        if name.endswith(f".weight.{stat}"):
            return name.removesuffix(f".{stat}"), stat
    weight_name, found, _ = name.partition(QUANT_STATE)
    if found:
        return weight_name, "quant_state"
    if name.endswith(".weight") and tensor.dim() == 2 and tensor.shape[1] == 1:
        return name, "weight"  # packed codes: no linear weight has one input feature
    return None


def _part_of_8bit(name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
    """(the weight's name, which piece of it) for an 8-bit checkpoint's int8 rows, SCB and weight_format."""
    if name.endswith(".weight_format"):
        if tensor.numel() != 1 or int(tensor.flatten()[0]) != 0:
            raise ValueError(f"{name}={tensor.tolist()}: bitsandbytes 8-bit weights are read in its row format (0) "
                             "only; save the model again with a recent bitsandbytes")
        return name.removesuffix("_format"), "weight_format"
    if name.endswith(".SCB"):
        return name.removesuffix(".SCB") + ".weight", "SCB"
    if name.endswith(".weight") and tensor.dtype == torch.int8:
        return name, "weight"
    return None


def _complete_4bit(parts: dict[str, torch.Tensor]) -> bool:
    if not {"weight", "quant_state", "absmax", "quant_map"} <= parts.keys():
        return False
    nested = "nested_blocksize" in stored_text(parts["quant_state"])
    return not nested or {"nested_absmax", "nested_quant_map"} <= parts.keys()


def bitsandbytes_config(checkpoint_config: dict | None, requested: str | None) -> BitsAndBytesConfig:
    if checkpoint_config is None:
        return BitsAndBytesConfig(4, in_flight=True)
    if checkpoint_config.get("load_in_4bit"):
        bits = 4
    elif checkpoint_config.get("load_in_8bit"):
        bits = 8
    else:
        raise ValueError("the checkpoint's bitsandbytes quantization_config has neither load_in_4bit nor "
                         "load_in_8bit set; pagellm reads 4-bit (NF4 / FP4) and 8-bit (LLM.int8) checkpoints")
    return BitsAndBytesConfig(bits, skip_modules=checkpoint_config.get("llm_int8_skip_modules") or ())
