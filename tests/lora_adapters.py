"""Random PEFT LoRA adapters of the tiny test Llama (tests/conftest.py), saved as PEFT saves them, and
transformers + peft's greedy outputs with each: the oracle of the LoRA tests."""

from __future__ import annotations

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def save_adapter(base_dir: str, path, rank: int, targets: list[str], alpha: float = 16, seed: int = 0,
                 rslora: bool = False) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    # init_lora_weights=False: A and B both random (PEFT's default B is zero, an adapter that changes nothing).
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    get_peft_model(model, config).save_pretrained(str(path))
    return str(path)


def peft_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                       do_sample=False, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs
