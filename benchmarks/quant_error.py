"""What each 8-bit scheme costs in perplexity by itself, apart from any engine's kernels.

The default model's HF export (benchmarks/export_hf.py) runs in transformers in float32 with its linear layers'
weights (and, for W8A8, their inputs) rounded as each scheme rounds them ("fake quantization": the products stay
float32), so what the table shows is the scheme's own error on this model. Every linear layer but the LM head is
quantized, as pagellm's online quantization does (the embedding is not a linear layer). Perplexity is over
benchmarks/texts.py's text, as in benchmarks/quantized.py.

A quantized model's perplexity also depends on which way each value happened to round: its scales moved by a
part in a thousand (each output channel's by its own random factor in [1 - 1e-3, 1 + 1e-3]), a scheme is as good
as before but rounds some values the other way. The columns after the first run each scheme under --dithers such
moves and give the spread of what they measure: the part of a single measurement that is chance.

The last scheme is quantization="int8"'s (pagellm/ops/w8a8_kernels.py, quantize_int8_rotated): weights and
inputs rotated by blocks of a Hadamard matrix before both are quantized, the weights' per-channel scales fitted;
the weights here rotated and fitted by the engine's own functions.

    .venv/bin/python benchmarks/quant_error.py
    .venv/bin/python benchmarks/quant_error.py --dithers 16
    .venv/bin/python benchmarks/quant_error.py --schemes "W8A8 int8 (per-channel weights, per-token inputs)"
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.texts import PERPLEXITY_TEXT
from pagellm.ops import w8a8_kernels as wk

FP8_MAX = 448.0
INT8_MAX = 127.0
# A scale's random relative move under a dither: small enough to leave the scheme's grid as it is, large enough
# to move the values that sit near the middle between two of its steps.
DITHER = 1e-3

Rounder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (values, scale) -> values on the scheme's grid


def round_int8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (values / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale


def round_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (values / scale).to(torch.float8_e4m3fn).float() * scale


def per_channel(weight: torch.Tensor, grid_max: float) -> torch.Tensor:
    return weight.abs().amax(dim=1, keepdim=True) / grid_max


def per_tensor(weight: torch.Tensor, grid_max: float) -> torch.Tensor:
    return (weight.abs().amax() / grid_max).expand(weight.shape[0], 1)


def grouped(weight: torch.Tensor, group: int, rounder: Rounder, grid_max: float, jitter: torch.Tensor) -> torch.Tensor:
    rows, columns = weight.shape
    blocks = weight.reshape(rows, columns // group, group)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / grid_max * jitter[:, :, None]
    return rounder(blocks, scale).reshape(rows, columns)


class Scheme:
    def __init__(self, name: str, weights: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 inputs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.name = name
        self.weights = weights  # (weight, per-channel jitter [rows, 1]) -> rounded weight
        self.inputs = inputs  # a layer's input -> what its product multiplies (None: the input as it is)


def _channel_scheme(rounder: Rounder, scale_of: Callable[[torch.Tensor, float], torch.Tensor], grid_max: float):
    return lambda weight, jitter: rounder(weight, scale_of(weight, grid_max) * jitter)


def _group_scheme(group: int):
    return lambda weight, jitter: grouped(weight, group, round_int8, INT8_MAX, jitter.expand(-1, weight.shape[1] // group))


def _per_token_int8(x: torch.Tensor) -> torch.Tensor:
    return round_int8(x, x.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(x.dtype).tiny) / INT8_MAX)


def _rotated_fitted_weights(weight: torch.Tensor, jitter: torch.Tensor) -> torch.Tensor:
    """quantize_int8_rotated's weights, dequantized (in the rotated space, where `_rotated_int8` puts the inputs);
    a dither moves the fitted scales."""
    rotation = wk.rotation_block(weight.shape[1])
    rotated = (wk.hadamard_rows(weight.double(), rotation) / rotation).float()
    _, scale = wk.quantize_rows_int8_fitted(rotated)
    return round_int8(rotated, scale[:, None].clamp(min=torch.finfo(torch.float32).tiny) * jitter)


def _rotated_int8(x: torch.Tensor) -> torch.Tensor:
    """The input rotated and quantized per token as the kernels do (quantize_rows_int8), dequantized."""
    q, scale = wk.quantize_rows_int8(x, None, wk.rotation_block(x.shape[-1]))
    return (q.float() * scale[:, None]).view(x.shape)


SCHEMES = [
    Scheme("int8 weights, per channel", _channel_scheme(round_int8, per_channel, INT8_MAX)),
    Scheme("int8 weights, groups of 64", _group_scheme(64)),
    Scheme("fp8 e4m3 weights, per tensor", _channel_scheme(round_fp8, per_tensor, FP8_MAX)),
    Scheme("fp8 e4m3 weights, per channel", _channel_scheme(round_fp8, per_channel, FP8_MAX)),
    Scheme("W8A8 int8 (per-channel weights, per-token inputs)", _channel_scheme(round_int8, per_channel, INT8_MAX),
           inputs=_per_token_int8),
    Scheme("W8A8 int8, rotated, fitted scales (quantization=\"int8\")", _rotated_fitted_weights,
           inputs=_rotated_int8),
]


def _linear_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [module for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] != "lm_head"]


def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids).logits.float()
    return math.exp(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item())


def run_scheme(model: torch.nn.Module, originals: list[torch.Tensor], scheme: Scheme, ids: torch.Tensor,
               seed: int | None) -> float:
    """The model's perplexity with `scheme` applied (a dither drawn from `seed`, none for None); weights restored."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    layers = _linear_layers(model)
    hooks = []
    for layer, original in zip(layers, originals):
        rows = original.shape[0]
        jitter = torch.ones(rows, 1) if generator is None else 1 + DITHER * (2 * torch.rand(rows, 1, generator=generator) - 1)
        layer.weight.data = scheme.weights(original, jitter)
        if scheme.inputs is not None:
            hooks.append(layer.register_forward_pre_hook(lambda _module, args: (scheme.inputs(args[0]),)))
    try:
        return perplexity(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
        for layer, original in zip(layers, originals):
            layer.weight.data = original


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dithers", type=int, default=8, help="dithered runs per scheme (default 8)")
    parser.add_argument("--schemes", nargs="+", default=None, choices=[scheme.name for scheme in SCHEMES],
                        metavar="SCHEME", help="schemes to run (default: all)")
    parser.add_argument("--hf-dir", type=Path, default=None,
                        help="the default model's HF export (default: written to a temporary directory)")
    args = parser.parse_args(argv)
    import transformers

    from benchmarks.export_hf import export
    from pagellm.cpu_features import cpu_description
    from pagellm.models.gguf_loader import default_model_path

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = args.hf_dir or Path(scratch) / "hf"
        if args.hf_dir is None:
            export(default_model_path(), hf_dir)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ids = tokenizer(PERPLEXITY_TEXT, return_tensors="pt").input_ids
    originals = [layer.weight.data.clone() for layer in _linear_layers(model)]
    reference = perplexity(model, ids)
    print(f"CPU: {cpu_description()}; float32 reference: perplexity {reference:.3f} over {ids.shape[1]} tokens "
          f"({len(originals)} linear layers quantized per scheme)\n")
    print(f"| scheme | perplexity | vs float32 | {args.dithers} dithered runs: mean | min | max | std |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for scheme in [scheme for scheme in SCHEMES if args.schemes is None or scheme.name in args.schemes]:
        plain = run_scheme(model, originals, scheme, ids, None) / reference - 1
        moved = [run_scheme(model, originals, scheme, ids, seed) / reference - 1 for seed in range(args.dithers)]
        spread = statistics.stdev(moved) if len(moved) > 1 else 0.0
        print(f"| {scheme.name} | {reference * (1 + plain):.3f} | {plain:+.2%} | {statistics.mean(moved):+.2%} | "
              f"{min(moved):+.2%} | {max(moved):+.2%} | {spread:.2%} |")


if __name__ == "__main__":
    main()
