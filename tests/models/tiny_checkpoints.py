"""Tiny random checkpoints of each family, saved with transformers' save_pretrained beside the default model's
tokenizer, and transformers' greedy continuations of them: the oracle of tests/models/."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm import LLM, SamplingParams
from tests.helpers import hf_greedy

Variant = Callable[[], tuple[type, object]]  # () -> (transformers model class, its config)


def save_tiny_checkpoint(variant: Variant, tokenizer, path, perturb: Callable[[torch.nn.Module], None] | None = None
                         ) -> str:
    model_class, config = variant()
    for part in (config, getattr(config, "text_config", config)):
        part.vocab_size = len(tokenizer)
        part.bos_token_id, part.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        # Norms start as all ones (or zeros); perturbed, a norm weight loaded into the wrong place shows.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
        if perturb is not None:
            perturb(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def checkpoint_dirs(variants: dict[str, Variant], tmp_path_factory, tokenizer,
                    perturb: Callable[[torch.nn.Module], None] | None = None) -> Callable[[str], str]:
    """variant name -> its checkpoint directory, saved on first use."""
    saved: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in saved:
            saved[name] = save_tiny_checkpoint(variants[name], tokenizer, tmp_path_factory.mktemp(name), perturb)
        return saved[name]

    return get


def greedy_references(dirs: Callable[[str], str], tokenizer, max_tokens: int
                      ) -> Callable[[str, list[str]], list[list[int]]]:
    """(variant, prompts) -> transformers' greedy continuation of each prompt, computed on first use."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, dict[str, list[int]]] = {}

    def get(variant: str, prompts: list[str]) -> list[list[int]]:
        known = cache.setdefault(variant, {})
        missing = [p for p in prompts if p not in known]
        if missing:
            model = AutoModelForCausalLM.from_pretrained(dirs(variant), dtype=torch.float32).eval()
            for prompt in missing:
                known[prompt] = hf_greedy(model, tokenizer, tokenizer.encode(prompt), max_tokens, ignore_eos=True)
        return [known[p] for p in prompts]

    return get


def check_greedy(llm: LLM, prompts: list[str], expected: list[list[int]], params: SamplingParams) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, reference in zip(outputs, expected):
        assert output.outputs[0].token_ids == reference, output.prompt
    return outputs
