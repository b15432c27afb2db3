"""Reference outputs from HuggingFace transformers, the correctness oracle."""

from __future__ import annotations

import functools
import os
import pathlib

import pytest
import torch
import transformers
import transformers.modeling_utils

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


def hf_greedy_with_top_logprobs(model, prompt_ids: list[int], max_new_tokens: int, k: int):
    """HF greedy continuation and, per generated position, the top-k {token id: logprob}."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    tops = []
    for scores in out.scores:
        values, indices = scores[0].float().log_softmax(-1).topk(k)
        tops.append(dict(zip(indices.tolist(), values.tolist())))
    return tokens, tops


def check_logprobs_close(ours: tuple[list[int], list[dict]], theirs: tuple[list[int], list[dict]]) -> int:
    """vLLM's check_logprobs_close: the greedy sequences agree token for token up to their first difference,
    and there each side's token is among the other's top-k (a near-tie that rounding may flip), after which
    the continuations are not compared. Returns how many leading tokens agree exactly."""
    our_tokens, our_tops = ours
    their_tokens, their_tops = theirs
    for position, (mine, theirs_token) in enumerate(zip(our_tokens, their_tokens)):
        if mine == theirs_token:
            continue
        assert mine in their_tops[position], (
            f"position {position}: our {mine} not in their top-k {their_tops[position]}")
        assert theirs_token in our_tops[position], (
            f"position {position}: their {theirs_token} not in our top-k {our_tops[position]}")
        return position
    assert len(our_tokens) == len(their_tokens), "one side stopped while the other went on with the same tokens"
    return len(our_tokens)


def hf_load_gguf(path: pathlib.Path) -> transformers.PreTrainedModel:
    """transformers' own GGUF loading of `path`, dequantized to float32."""
    import gguf  # here, not at the top: tests/gpu import this module on a machine without the gguf package

    with pytest.MonkeyPatch.context() as mp:
        # from_pretrained refuses GGUF without `accelerate` (not installed here), although the
        # dequantizing path for llama/qwen2 never uses it; lift only that gate.
        mp.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
        # transformers builds gguf's tensor-name table anew for every submodule it maps (~400 times for SmolLM2,
        # seconds of CPU); the table depends only on (architecture, layers) and is only read: built once here.
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()


def write_decoder_metadata(writer, config) -> None:
    """The keys llama.cpp's converter writes for every decoder (TextModel.set_gguf_parameters' common part) on a
    gguf.GGUFWriter; each family's writer adds its own."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters.get("full_attention", config.rope_parameters)["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)


def assert_encodes_and_decodes_alike(tokenizer, fast, texts: list[str]) -> None:
    """`tokenizer` (pagellm's compact one) gives `fast`'s ids for each text, with and without
    split_special_tokens, and its text for those ids, with and without special tokens."""
    for text in texts:
        for split in (False, True):
            assert tokenizer.encode(text, split_special_tokens=split) == \
                fast.encode(text, split_special_tokens=split), text[:80]
        ids = fast.encode(text)
        for skip in (False, True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == fast.decode(ids, skip_special_tokens=skip)


def comparable_config(config) -> dict:
    """A config's fields (transformers' or a GGUF config's) without the version that wrote it."""
    values = config.to_dict()
    values.pop("transformers_version", None)
    return values


def assert_same_fields(ours, theirs) -> None:
    """A GGUF config (`ours`) holds every field of transformers' config `theirs` beyond PretrainedConfig's common
    ones (return_dict, dtype, ...), and each of its fields at the same value."""
    mine, other = comparable_config(ours), comparable_config(theirs)
    assert mine == {key: other[key] for key in mine}
    assert set(other) - set(comparable_config(transformers.PretrainedConfig())) <= set(mine)


def run_python(script: str, env: dict | None = None, timeout: float = 300) -> str:
    """The stdout of `script` run by this interpreter in a fresh process (what it imports is its own); its stderr's
    tail where it fails."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def built_or_skip(kernels, what: str):
    """`kernels` (a kernel library's wrapper, None where it could not be built), or a skip where this machine
    cannot build C at all (no compiler, or PAGELLM_NATIVE_KERNELS=0). With a compiler present a failed build fails
    the test: skipping there would hide a kernel source that no longer compiles for this CPU's instruction set."""
    if kernels is not None:
        return kernels
    if os.environ.get("PAGELLM_NATIVE_KERNELS", "1") == "0":
        pytest.skip("PAGELLM_NATIVE_KERNELS=0")
    from pagellm.ops import cpu_build

    try:
        cpu_build.find_compiler()
    except FileNotFoundError:
        pytest.skip("no C compiler")
    pytest.fail(f"{what} failed to build with a C compiler present (the warning logged above names the error)")


def decoder_linear_bytes(llm) -> int:
    """Memory of an engine's decoder layers' linear products, as weights_bytes counts it (parameters and the
    kernels' layouts): the embedding and LM head left out, which quantized checkpoints usually keep float."""
    from pagellm.layers.linear import LinearBase

    total = 0
    for name, module in llm.llm_engine.core.runner.model.named_modules():
        if isinstance(module, LinearBase) and ".layers." in name:
            tensors = list(module.parameters(recurse=False)) + module.quant_method.kernel_tensors(module)
            total += sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    return total
