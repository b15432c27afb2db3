"""Reference outputs from HuggingFace transformers, the correctness oracle."""

from __future__ import annotations

import torch

# Prompts of very different lengths (3 to ~120 tokens) so a batch mixes short and long prefills.
PROMPTS = [
    "Hello",
    "The capital of France is",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "A long time ago in a galaxy far, far away, " * 6,
    "Paged attention stores the KV cache in fixed-size blocks, like an operating system's virtual memory pages.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The quick brown fox jumps over the lazy dog. " * 10,
    "Translate to French: cheese ->",
]


def hf_greedy(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """Greedy continuation of one unpadded prompt, as `generate(do_sample=False)` gives it."""
    ids = torch.tensor([prompt_ids])
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids))
    if ignore_eos:
        kwargs.update(eos_token_id=None, min_new_tokens=max_new_tokens)
    with torch.no_grad():
        out = model.generate(ids, pad_token_id=tokenizer.eos_token_id, **kwargs)
    return out[0, len(prompt_ids):].tolist()
