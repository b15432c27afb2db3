"""GPU tests: marked `gpu`, skipped where torch sees no CUDA device; benchmarks/gpu_check.sh runs them on one.

They need no hub and no default model: the tiny model and a word-level tokenizer are made here.
"""

from __future__ import annotations

import pytest
import torch

VOCAB_SIZE = 512


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (benchmarks/gpu_check.sh runs these on one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here; benchmarks/gpu_check.sh runs the gpu tests on one")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def save_word_tokenizer(path, vocab_size: int = VOCAB_SIZE):
    """A word-level tokenizer over the words w3..w{vocab_size-1}, saved as a HF tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="session")
def gpu_tiny_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY_CONFIG

    path = tmp_path_factory.mktemp("gpu-tiny-llama")
    save_word_tokenizer(path)
    torch.manual_seed(0)
    # Heads of 32 with a GQA ratio of 4, so the kernels see a realistic group.
    config = LlamaConfig(vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2,
                         **{**TINY_CONFIG, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1})
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return str(path)
