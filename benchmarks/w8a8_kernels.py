"""8-bit weight kernels (pagellm/ops/w8a8_kernels.py) against pagellm's dense linear layers on SmolLM2-135M's
shapes, and the weight memory of SmolLM2 in bfloat16, int8 and fp8.

Kernels: for each row count m, one pass through the four products of every decoder layer (qkv 576 -> 960,
o 576 -> 576, gate_up 576 -> 3072, down 1536 -> 576; 30 layers of distinct random weights, as a forward pass
reads them from memory), through
- `int8`:       W8A8 int8 (per-channel weights, rows quantized per token on the fly);
- `fp8`:        fp8 e4m3 weights as `fp8_linear` runs them (fused widening kernel below
                FP8_DENSE_MIN_ROWS, dequantized tiles into torch's GEMM from there), and both paths forced;
- `f32`, `bf16`: pagellm's dense layers as the loader sets them up (ops/dense_linear.py: oneDNN-packed or MKL
                float32; bfloat16 on its own kernel, oneDNN, or widened per call where the CPU has no bf16);
- `int8-vector`, `bf16-vector`: where the CPU has AMX, the int8 and bf16 kernels kept on their vector paths
                (VNNI, VDPBF16PS) at every row count, beside the AMX tiles the others take from 8 rows on.
Prints GFLOP/s (CPU time, best of --repeats passes with the options taking turns, --threads threads) and the
speed-up over bfloat16, with the CPU's flags. Memory: pagellm's weights_bytes of SmolLM2 loaded from an HF export
(benchmarks/export_hf.py) as bfloat16, float32, and with quantization="int8" and "fp8" (online, from the same
float checkpoint).

    PYTHONPATH=$PWD python benchmarks/w8a8_kernels.py --rows 1 8 64 512 --threads 1
    PYTHONPATH=$PWD python benchmarks/w8a8_kernels.py --memory /tmp/smollm2-hf
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagellm.cpu_features import cpu_description, cpu_flags
from pagellm.ops import w8a8_kernels as wk
from pagellm.ops import cpu_build
from pagellm.ops.dense_linear import NativeBF16Packed, UpcastScratch, choose_dense_kernel
from pagellm.ops.linear_bf16 import linear_bf16

# (in_features, out_features) of SmolLM2-135M's four products per layer.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def build(layers: int, seed: int) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """Per option, one callable per product of every layer (inputs in that option's activation dtype)."""
    kernels = wk.w8a8_kernels()
    if kernels is None:
        raise SystemExit("the 8-bit C kernels are unavailable (no compiler, or PAGELLM_NATIVE_KERNELS=0)")
    generator = torch.Generator().manual_seed(seed)
    scratch = UpcastScratch()
    options: dict[str, list] = {"int8": [], "fp8": [], "fp8-fused": [], "fp8-dense": [], "f32": [], "bf16": []}
    # Where the CPU has AMX, the int8 and bf16 products switch to its tiles from a row count on: the vector
    # paths forced at every row count, beside them.
    int8_vector = wk.w8a8_kernels() if kernels.amx else None
    if int8_vector is not None:
        int8_vector.amx_min_rows = cpu_build.NEVER_ROWS
        options["int8-vector"] = []
    bf16_vector = linear_bf16()
    if bf16_vector is not None and bf16_vector.amx:
        bf16_vector.amx_min_rows = cpu_build.NEVER_ROWS
        options["bf16-vector"] = []
    for _ in range(layers):
        for in_features, out_features in SHAPES:
            w = torch.randn(out_features, in_features, generator=generator) * 0.05
            q, scale = wk.quantize_rows_int8(w)
            packed = wk.pack_int8(q, scale)
            options["int8"].append(lambda x, p=packed: kernels.int8_linear(x, p, None))
            if int8_vector is not None:
                options["int8-vector"].append(lambda x, p=packed: int8_vector.int8_linear(x, p, None))
            if "bf16-vector" in options:
                layer = NativeBF16Packed(w.to(torch.bfloat16), bf16_vector)
                options["bf16-vector"].append(lambda x, k=layer: k(x, None))
            f8, s8 = wk.quantize_fp8_per_tensor(w)
            packed8 = wk.pack_fp8(f8, s8.reshape(1, 1).expand(out_features, 1), in_features)
            options["fp8"].append(lambda x, p=packed8: kernels.fp8_linear(x, p, None))
            options["fp8-fused"].append(lambda x, p=packed8: kernels.fp8_linear_fused(x, p, None))
            options["fp8-dense"].append(lambda x, p=packed8: kernels.fp8_linear_dense(x, p, None))
            for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
                kernel, _ = choose_dense_kernel(w.to(dtype), False, scratch)
                options[name].append(lambda x, k=kernel: k(x, None))
    return options


def time_options(options: dict, rows: int, activation_dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Each option's best CPU seconds of one pass through every product at `rows` rows, the options taking turns
    pass by pass: on a shared machine whose speed changes by the minute, an option timed after another would
    compare the minutes as much as the kernels."""
    inputs = {dtype: {k: torch.randn(rows, k, dtype=dtype) for k in {576, 1536}}
              for dtype in {torch.float32, torch.bfloat16, activation_dtype}}
    best = {name: float("inf") for name in options}
    for repeat in range(repeats + 1):  # the first pass warms up (buffers, packed layouts, page faults)
        for name, products in options.items():
            dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "bf16-vector": torch.bfloat16}.get(
                name, activation_dtype)
            start = time.process_time()
            for product, (in_features, _) in zip(products, SHAPES * (len(products) // len(SHAPES))):
                product(inputs[dtype][in_features])
            if repeat:
                best[name] = min(best[name], time.process_time() - start)
    return best


def kernel_table(rows_list: list[int], layers: int, repeats: int, activation_dtype: torch.dtype) -> None:
    options = build(layers, 0)
    flops_per_row = 2 * layers * sum(k * n for k, n in SHAPES)
    print(f"{layers} layers of SmolLM2-135M's products, {torch.get_num_threads()} thread(s), activations "
          f"{activation_dtype} for int8/fp8; GFLOP/s (CPU time, best of {repeats} interleaved passes), speed-up "
          f"over bf16")
    header = f"{'rows':>5}" + "".join(f"{name:>16}" for name in options)
    print(header)
    for rows in rows_list:
        seconds = time_options(options, rows, activation_dtype, repeats)
        cells = []
        for name in options:
            gflops = flops_per_row * rows / seconds[name] / 1e9
            cells.append(f"{gflops:8.1f} ({seconds['bf16'] / seconds[name]:4.2f}x)")
        print(f"{rows:>5}" + "".join(f"{cell:>16}" for cell in cells))


def memory_table(model_dir: str) -> None:
    from pagellm.layers.weights import weights_bytes
    from pagellm.models import loader

    source = loader.resolve_model(model_dir)
    config, _ = loader.load_hf_config(source)
    print(f"weights of {model_dir} (MiB): whole model / its decoder layers")
    for label, dtype, quantization in (("bfloat16", torch.bfloat16, None), ("float32", torch.float32, None),
                                       ("int8 (online)", torch.bfloat16, "int8"),
                                       ("fp8 (online)", torch.bfloat16, "fp8")):
        model = loader.load_model(source, config, None, dtype, torch.device("cpu"), 2048, quantization=quantization)
        print(f"  {label:<16} {weights_bytes(model) / 2**20:8.1f} {weights_bytes(model.model.layers) / 2**20:8.1f}")
        del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bf16-activations", action="store_true", help="int8/fp8 take bfloat16 activations")
    parser.add_argument("--memory", metavar="HF_DIR", default=None, help="also print SmolLM2's weight memory")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    present = [flag for flag in FLAGS if flag in cpu_flags()]
    kernels = wk.w8a8_kernels()
    print(f"CPU: {cpu_description()}; flags: {' '.join(present)}; 8-bit kernels: {kernels.isa} build, int8 products "
          f"on {kernels.dot_instructions}, fp8 dense path from {kernels.fp8_dense_min_rows} rows "
          f"({kernels.fp8_bf16_dense_min_rows} for bfloat16 rows)")
    kernel_table(args.rows, args.layers, args.repeats, torch.bfloat16 if args.bf16_activations else torch.float32)
    if args.memory:
        memory_table(args.memory)


if __name__ == "__main__":
    main()
