"""Writing quantized checkpoints (`pagellm quantize`): GPTQ and round-to-nearest onto compressed-tensors' grids."""
