"""CPU operators outside attention: kernels on GGUF quantized weights (gguf_kernels) and on AWQ/GPTQ group-quantized
weights (wna16)."""
