"""Qwen3, Gemma 3 and Phi-3 from HF checkpoint directories: greedy output equals transformers' generate token
for token in fp32 (batched, chunked prefill, prefix-cached), and unsupported checkpoints are refused by name.

Each family is a tiny random model (2 layers, GQA, small dims) saved with transformers' save_pretrained,
with the default model's tokenizer; the configs turn on the family's particular features.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.conftest import TINY_CONFIG
from tests.helpers import PROMPTS
from tests.models.tiny_checkpoints import check_greedy, checkpoint_dirs, greedy_references

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Small engine limits keep start-up cheap (the profiling run sizes itself by them).
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, max_num_seqs=8, max_model_len=256)
# Short and long prompts (the longest ~110 tokens), so one batch mixes prefills of very different lengths.
FAMILY_PROMPTS = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[5], PROMPTS[8]]
SHARED_PREFIX = PROMPTS[8]

# The engine tests' tiny shape (tests/conftest.py) with two layers; each family sets its own norm eps,
# rotary and embedding tying below.
FAMILY_OWN_KEYS = ("rms_norm_eps", "rope_theta", "tie_word_embeddings")
COMMON = {**{key: value for key, value in TINY_CONFIG.items() if key not in FAMILY_OWN_KEYS}, "num_hidden_layers": 2}


def _qwen3(tie: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 64 is not hidden_size / heads (32): Qwen3 takes it from the config.
    config = Qwen3Config(**COMMON, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie)
    return Qwen3ForCausalLM, config


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Layer 0 local (sliding), layer 1 global, each with its own rotary base; the global one linearly scaled
    # as Gemma 3 4B+ are. The longer prompts run several windows past the local layer's 24 tokens.
    config = Gemma3TextConfig(
        **COMMON, head_dim=32, rms_norm_eps=1e-6, layer_types=["sliding_attention", "full_attention"],
        sliding_window=24, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0,
    )
    return Gemma3ForCausalLM, config


def _gemma3_multimodal():
    """The multimodal checkpoint layout (Gemma 3 4B and larger): the same language model under
    model.language_model, beside a vision tower that text-only serving does not use."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    _, text_config = _gemma3()
    vision_config = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text_config.to_dict(), vision_config=vision_config, mm_tokens_per_image=4)
    return Gemma3ForConditionalGeneration, config


def _phi3(longrope: bool):
    from transformers import Phi3Config, Phi3ForCausalLM

    if not longrope:
        return Phi3ForCausalLM, Phi3Config(**COMMON, rms_norm_eps=1e-5, rope_theta=10000.0)
    # Phi-4-mini's shape of config: half of each head rotates, LongRoPE, tied embeddings. Positions from
    # LONGROPE_ORIGINAL on rotate with the long factors, which the generated tokens reach.
    half_rotary = 32 // 2 // 2
    config = Phi3Config(
        **COMMON, rms_norm_eps=1e-5, partial_rotary_factor=0.5, tie_word_embeddings=True,
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        rope_scaling={"rope_type": "longrope", "rope_theta": 10000.0,
                      "short_factor": [1.0 + 0.1 * i for i in range(half_rotary)],
                      "long_factor": [2.0 + 0.7 * i for i in range(half_rotary)]},
    )
    return Phi3ForCausalLM, config


# transformers rotates with LongRoPE's short factors while a sequence fits in original_max_position_embeddings
# and with the long ones, for all positions, once it is longer; pagellm fixes the set by max_model_len
# (pagellm/models/phi3.py). Checked both ways: prompts longer than LONGROPE_ORIGINAL at the default
# max_model_len (long), and sequences within it at max_model_len=LONGROPE_ORIGINAL (short).
LONGROPE_ORIGINAL = 48
LONG_PROMPTS = [PROMPTS[5], PROMPTS[8]]  # 73 and 101 tokens
SHORT_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[6], PROMPTS[7]]  # 1 to 23 tokens

VARIANTS = {
    "qwen3": lambda: _qwen3(tie=False),
    "qwen3-tied": lambda: _qwen3(tie=True),
    "gemma3": _gemma3,
    "gemma3-multimodal": _gemma3_multimodal,
    "phi3": lambda: _phi3(longrope=False),
    "phi3-longrope-partial": lambda: _phi3(longrope=True),
}
# Whether the variant's attention runs the fused CPU kernels (norms, rotary) when they are there.
FUSED_ATTENTION = {"qwen3": True, "qwen3-tied": True, "gemma3": True, "gemma3-multimodal": True, "phi3": True, "phi3-longrope-partial": False}
# Per variant where not the defaults: (prompts, LLM arguments) of the batched test, and (prompts, prompt whose
# prefix a follow-up request shares, LLM arguments) of the chunked/prefix-cached one.
BATCHED_CASES = {"phi3-longrope-partial": (LONG_PROMPTS, {})}
CHUNKED_CASES = {"phi3-longrope-partial": (SHORT_PROMPTS, PROMPTS[6], {"max_model_len": LONGROPE_ORIGINAL})}


@pytest.fixture(scope="module")
def family_dirs(module_tmp_path_factory, default_tokenizer):
    """Checkpoint directories saved on first use, one per variant."""
    return checkpoint_dirs(VARIANTS, module_tmp_path_factory, default_tokenizer)


@pytest.fixture(scope="module")
def hf_references(family_dirs, default_tokenizer):
    """transformers' greedy continuation of each prompt, per variant, computed on first use."""
    return greedy_references(family_dirs, default_tokenizer, MAX_TOKENS)


def _check_greedy(llm: LLM, prompts: list[str], expected: list[list[int]]) -> list:
    return check_greedy(llm, prompts, expected, GREEDY)


# Qwen3 with tied embeddings runs in the chunked test only: it differs from "qwen3" only in what is loaded.
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "qwen3-tied"])
def test_batched_greedy_matches_hf(variant, family_dirs, hf_references):
    prompts, llm_args = BATCHED_CASES.get(variant, (FAMILY_PROMPTS, {}))
    llm = LLM(family_dirs(variant), **{**ENGINE_ARGS, **llm_args})
    assert llm.llm_engine.core.runner.native_decode is not None
    attention = llm.llm_engine.core.runner.model.model.layers[0].self_attn
    assert (attention.ops is not None) == FUSED_ATTENTION[variant]
    _check_greedy(llm, prompts, hf_references(variant, prompts))
    assert llm.llm_engine.get_stats().kv_cache.num_used_blocks == 0


def test_gemma3_logprobs_match_hf_with_softcapped_logits(family_dirs, default_tokenizer):
    # Soft-capping is monotonic, so greedy tokens cannot show it; the logprobs do. So does the sliding window
    # (the prompt runs four windows long), which a random model's peaked logits rarely let flip a greedy token.
    from transformers import AutoModelForCausalLM

    from tests.helpers import hf_greedy_with_top_logprobs

    path = family_dirs("gemma3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt_ids = default_tokenizer.encode(PROMPTS[8])
    tokens, tops = hf_greedy_with_top_logprobs(model, prompt_ids, 4, 3)
    llm = LLM(path, **ENGINE_ARGS)
    [output] = llm.generate([PROMPTS[8]], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)
    assert output.outputs[0].token_ids == tokens
    for ours, theirs in zip(output.outputs[0].logprobs, tops):
        assert set(ours) == set(theirs)
        for token, logprob in theirs.items():
            assert ours[token].logprob == pytest.approx(logprob, abs=1e-4)


# The multimodal layout changes only what is loaded; the batched test covers it.
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in ("qwen3", "gemma3-multimodal")])
def test_chunked_prefill_and_prefix_cache_match_hf(variant, family_dirs, hf_references, torch_ops_only):
    # A 32-token budget splits the long prompts into chunks beside other requests' decodes; then a request
    # sharing the long prompt's prefix starts from its cached blocks. Runs the torch path of every op, where
    # the batched test above runs the fused kernels.
    prompts, shared_prefix, llm_args = CHUNKED_CASES.get(variant, (FAMILY_PROMPTS, SHARED_PREFIX, {}))
    llm = LLM(family_dirs(variant), **{**ENGINE_ARGS, "max_num_batched_tokens": 32, "block_size": 8,
                                       "enable_prefix_caching": True, **llm_args})
    _check_greedy(llm, prompts, hf_references(variant, prompts))
    follow_up = [shared_prefix + " And once more:"]
    [output] = _check_greedy(llm, follow_up, hf_references(variant, follow_up))
    assert output.num_cached_tokens >= 16, "the shared prefix came from the cache"
    assert llm.llm_engine.core.runner.native_decode is None


def test_two_tensor_parallel_ranks_match_hf(family_dirs, hf_references):
    # Each rank holds one of the 2 KV heads: Phi-3's fused checkpoint tensors are split by head and by MLP
    # share, and the partial rotary applies per rank.
    variant = "phi3-longrope-partial"
    prompts, llm_args = BATCHED_CASES[variant]
    llm = LLM(family_dirs(variant), **{**ENGINE_ARGS, **llm_args}, tensor_parallel_size=2,
              distributed_timeout_seconds=60)
    try:
        _check_greedy(llm, prompts, hf_references(variant, prompts))
    finally:
        llm.llm_engine.shutdown()


def _write_config(directory, **fields) -> str:
    """A checkpoint directory holding only config.json: a refusal must come before any weight is looked for."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return str(directory)


SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
             "Gemma3ForConditionalGeneration")


@pytest.mark.parametrize("fields, named", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "GPT2LMHeadModel"),
    # transformers does not know this model type: refused before AutoConfig would fail on it.
    (dict(architectures=["NoSuchModelForCausalLM"], model_type="no_such_model"), "NoSuchModelForCausalLM"),
    (dict(model_type="no_such_model"), "no_such_model"),
])
def test_unsupported_architecture_is_refused_naming_the_supported(tmp_path, fields, named):
    with pytest.raises(ValueError) as refusal:
        LLM(_write_config(tmp_path / "model", **fields), dtype="float32")
    message = str(refusal.value)
    assert named in message and "not supported" in message
    assert all(arch in message for arch in SUPPORTED), message


@pytest.mark.parametrize("quantization", [
    {"quant_method": "aqlm", "in_group_size": 8, "nbits_per_codebook": 16, "num_codebooks": 1},
    {"quant_method": "torchao", "quant_type": {"default": {"_type": "Int4WeightOnlyConfig"}}},
])
def test_unsupported_quantized_checkpoints_are_refused_before_loading(tmp_path, quantization):
    directory = _write_config(tmp_path / "model", architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                              quantization_config=quantization)
    with pytest.raises(ValueError) as refusal:
        LLM(directory, dtype="float32")
    message = str(refusal.value)
    assert f"quant_method={quantization['quant_method']!r} is not supported" in message
    assert "GGUF" in message, message


def test_config_without_architectures_is_matched_by_model_type():
    from transformers import Gemma3TextConfig, Phi3Config, Qwen3Config

    from pagellm.models import registry

    for config, family in ((Qwen3Config(), "Qwen3"), (Gemma3TextConfig(), "Gemma 3"), (Phi3Config(), "Phi-3")):
        config.architectures = None
        assert registry.family_of(config).name == family
