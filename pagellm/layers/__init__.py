"""The layers models are built from (vLLM's model_executor/layers shape): linear layers that get their weight
format's method when they are built, norms, rotary embeddings, activations, the vocabulary embedding and LM
head. A model file composes them into its graph; what differs between checkpoints (quantized formats, fused
or split projections, tensor-parallel shards) lives here, behind each parameter's weight loader."""
