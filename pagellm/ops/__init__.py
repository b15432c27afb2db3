"""CPU and Triton operators of the layers, outside attention: the build of the C libraries (cpu_build), the fused
elementwise layers (cpu_ops), bfloat16 linear (linear_bf16), the dense kernel choice (dense_linear), the fused
mixture-of-experts layer (cpu_moe, triton_moe), the decode stack (decode_stack), and kernels on GGUF quantized
weights (gguf_kernels), AWQ/GPTQ group-quantized weights (wna16) and W8A8 int8/fp8 (w8a8_kernels)."""
