"""CPU operators outside attention: kernels on GGUF quantized weights (gguf_kernels)."""
