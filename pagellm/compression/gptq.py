"""Rounding a linear layer's weights onto a quantization grid: round-to-nearest, or GPTQ (Frantar et al., 2022),
which rounds the input columns one at a time and moves each column's rounding error onto the columns not yet
rounded, weighted by the inverse Hessian of the layer's squared output error, H = E[x x^T] over calibration
inputs. Where inputs are correlated, most of the error cancels in the product; round-to-nearest cannot do that.

The grids are compressed-tensors' (its calculate_qparams and _quantize), so that what is rounded here is what its
checkpoints hold: symmetric int scale = max|w| / ((2^bits - 1) / 2), code = clamp(round(w / scale), -2^(bits-1),
2^(bits-1) - 1); asymmetric int below (WeightGrid); fp8 e4m3 scale = max|w| / 448, code = clamp(w / scale, +-448)
cast to e4m3; NVFP4 (groups of 16 e2m1 values) a per-tensor global scale g = 448 * 6 / max|W| (generate_gparam),
each group's fp8 scale s = e4m3(g * max|w| / 6) (0 taken as e4m3's eps, 0.125), code = e2m1(clamp(w / (s / g),
+-6)), rounded to nearest, ties to even (its cast_to_fp4).
A scale is rounded to the dtype it is stored in before the codes are taken, so the checkpoint's products are
the ones GPTQ compensated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_EPS = 0.125  # torch.finfo(torch.float8_e4m3fn).eps: compressed-tensors' scale for an all-zero group


@dataclass(frozen=True)
class WeightGrid:
    """Where a scheme's weights may lie: `kind` "int", "float" (fp8 e4m3) or "nvfp4" (e2m1 in groups of 16, fp8
    group scales under the weight's `global_scale`: with_global_scale), `bits`, `group_size` inputs per scale
    (None: one scale per output channel), and for int grids whether a zero point shifts the codes (`symmetric`
    False: the range spans [min, max] of the weights, 0 included, as compressed-tensors' asymmetric grid: scale =
    (max - min) / (2^bits - 1), zero = clamp(round(qmin - min / scale)), code = clamp(round(w / scale + zero))).
    An NVFP4 grid's scales are s / g, as compressed-tensors multiplies by them (the fp8 s is e4m3(scale * g))."""

    kind: str
    bits: int
    group_size: int | None
    scale_dtype: torch.dtype = torch.float32
    symmetric: bool = True
    global_scale: float | None = None

    @property
    def code_range(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1

    def params_of(self, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero point) per row of `columns` [rows, n]: the scale as stored, widened to float32; the zero
        point 0 on symmetric grids."""
        if self.kind == "nvfp4":
            if self.global_scale is None:
                raise ValueError("an NVFP4 grid needs the weight's global scale (WeightGrid.with_global_scale)")
            fp8 = (columns.abs().amax(dim=1) / FP4_MAX * self.global_scale).to(torch.float8_e4m3fn).float()
            fp8 = torch.where(fp8 == 0, torch.full_like(fp8, FP8_EPS), fp8)
            return fp8 / torch.tensor(self.global_scale, dtype=torch.float32), torch.zeros_like(fp8)
        if self.kind == "float" or self.symmetric:
            half_range = FP8_MAX if self.kind == "float" else (2 ** self.bits - 1) / 2
            scale = (columns.abs().amax(dim=1) / half_range).to(self.scale_dtype).float()
            return torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(scale)
        low, high = self.code_range
        smallest, largest = columns.amin(dim=1).clamp(max=0), columns.amax(dim=1).clamp(min=0)
        scale = ((largest - smallest) / (high - low)).to(self.scale_dtype).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return scale, (low - smallest / scale).round().clamp(low, high)

    def codes(self, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """values [rows, n] onto the grid of scale and zero [rows], in units of the scale (float32)."""
        scaled = values / scale[:, None]
        if self.kind == "nvfp4":
            return round_to_e2m1(scaled.clamp(-FP4_MAX, FP4_MAX))
        if self.kind == "float":
            return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        low, high = self.code_range
        return (scaled + zero[:, None]).round().clamp(low, high)

    def with_global_scale(self, weights: list[torch.Tensor]) -> WeightGrid:
        """An NVFP4 grid for `weights` (one weight, or the shards of a fused layer, which llm-compressor gives one
        global scale so that a fused kernel can take one): 448 * 6 / their max |w| in float32, 1 where that is
        not finite (compressed-tensors' generate_gparam)."""
        largest = max(float(w.abs().max()) for w in weights)
        scale = torch.tensor(FP8_MAX * FP4_MAX, dtype=torch.float32) / torch.tensor(
            max(largest, torch.finfo(torch.float32).tiny), dtype=torch.float32)
        return dataclasses.replace(self, global_scale=float(scale) if torch.isfinite(scale) else 1.0)

    def check(self, in_features: int) -> None:
        if self.group_size is not None and in_features % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide a layer's {in_features} inputs; "
                             f"choose a group size that divides every quantized layer's input size")


def round_to_e2m1(values: torch.Tensor) -> torch.Tensor:
    """values within +-6 to the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign), ties to the even
    one, as compressed-tensors' cast_to_fp4 rounds."""
    magnitude = values.abs()
    rounded = torch.zeros_like(magnitude)
    # (lower bound, inclusive?, value) from the top: each bound is a midpoint, the tie going to the even code
    for bound, inclusive, value in ((5.0, False, 6.0), (3.5, True, 4.0), (2.5, False, 3.0), (1.75, True, 2.0),
                                    (1.25, False, 1.5), (0.75, True, 1.0), (0.25, False, 0.5)):
        above = (magnitude >= bound) if inclusive else (magnitude > bound)
        rounded = torch.where(above & (rounded == 0), torch.full_like(rounded, value), rounded)
    return torch.where(values < 0, -rounded, rounded)


@dataclass
class RoundedWeight:
    """codes [out, in] (integers or e4m3 values, as float32), scales [out, groups] (float32, exact in the grid's
    scale dtype) and zero points [out, groups] (integers as float32; zeros on symmetric grids); groups is 1 for
    per-channel grids."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    grid: WeightGrid

    def dequantize(self) -> torch.Tensor:
        group = self.codes.shape[1] // self.scales.shape[1]
        per_input = lambda t: t.repeat_interleave(group, dim=1)  # noqa: E731
        return (self.codes - per_input(self.zeros)) * per_input(self.scales)


def round_to_nearest(weight: torch.Tensor, grid: WeightGrid) -> RoundedWeight:
    rows, columns = weight.shape
    grid.check(columns)
    group = grid.group_size or columns
    w = weight.float().reshape(rows, columns // group, group)
    params = [grid.params_of(w[:, g]) for g in range(w.shape[1])]
    scales = torch.stack([scale for scale, _ in params], dim=1)
    zeros = torch.stack([zero for _, zero in params], dim=1)
    codes = torch.cat([grid.codes(w[:, g], *params[g]) for g in range(w.shape[1])], dim=1)
    return RoundedWeight(codes, scales, zeros, grid)


def inverse_hessian_factor(hessian: torch.Tensor, dampening_frac: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp I)^-1 (float32), damp = dampening_frac x mean(diag H); inputs never
    seen in calibration (a zero diagonal) get a unit diagonal, so their columns round to nearest. Dampening grows
    tenfold (from 1e-4 if it was 0) while H is not positive definite, up to the mean diagonal itself."""
    h = hessian.double().clone()
    diagonal = h.diagonal()
    dead = diagonal == 0
    h[dead, dead] = 1.0
    mean = h.diagonal().mean()
    damp = dampening_frac
    for _ in range(6):
        factor, info = torch.linalg.cholesky_ex(h + damp * mean * torch.eye(h.shape[0], dtype=h.dtype))
        if info.item() == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True).float()
        if damp >= 1:
            break
        damp = max(damp * 10, 1e-4)
    raise ValueError(f"the calibration Hessian is not positive definite even with dampening_frac={damp:g}; "
                     "calibrate on more tokens")


def gptq(weight: torch.Tensor, hessian: torch.Tensor, grid: WeightGrid, dampening_frac: float = 0.01,
         block_size: int = 128) -> RoundedWeight:
    """GPTQ without act order: columns rounded left to right, each one's error spread over the rest through
    the inverse Hessian's Cholesky factor, lazily a block at a time. A group's scale is taken when its first
    column comes up, from the group's weights as the earlier errors left them (blocks are whole groups so
    that every earlier error has reached them)."""
    rows, columns = weight.shape
    grid.check(columns)
    if grid.group_size is not None:
        block_size = grid.group_size * max(1, block_size // grid.group_size)
    w = weight.float().clone()
    factor = inverse_hessian_factor(hessian, dampening_frac)
    group = grid.group_size or columns
    codes = torch.empty_like(w)
    scales, zeros = torch.empty(rows, columns // group), torch.empty(rows, columns // group)
    scale, zero = grid.params_of(w) if grid.group_size is None else (None, None)
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block = w[:, start:end].clone()
        errors = torch.empty_like(block)
        inverse = factor[start:end, start:end]
        for j in range(end - start):
            column = start + j
            if column % group == 0:
                if grid.group_size is not None:
                    scale, zero = grid.params_of(block[:, j:j + group])
                scales[:, column // group], zeros[:, column // group] = scale, zero
            code = grid.codes(block[:, j:j + 1], scale, zero)[:, 0]
            codes[:, column] = code
            error = (block[:, j] - (code - zero) * scale) / inverse[j, j]
            block[:, j:] -= error[:, None] * inverse[j, j:][None, :]
            errors[:, j] = error
        w[:, end:] -= errors @ factor[start:end, end:]
    return RoundedWeight(codes, scales, zeros, grid)
