"""GGUF configs built without transformers' model config classes hold what those classes would hold."""

import copy

import pytest
import transformers

from pagellm.models.gguf_config import _FAMILIES, gguf_model_config
from pagellm.models.gguf_loader import default_model_path, open_gguf
from tests.helpers import assert_same_fields, comparable_config, run_python

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "mscale": 0.707, "mscale_all_dim": 0.707}
SHAPE = dict(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=2048, rope_parameters=ROPE,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=[2, 7])

# Per transformers class, field sets as the GGUF loader passes them (and a few it may leave to the defaults).
CASES = {
    "LlamaConfig": [dict(SHAPE, architectures=["LlamaForCausalLM"], head_dim=32, attention_bias=False),
                    dict(SHAPE, num_key_value_heads=None, pad_token_id=0, attention_bias=True),
                    dict(SHAPE, rope_parameters=YARN)],
    "Qwen2Config": [dict(SHAPE, architectures=["Qwen2ForCausalLM"], head_dim=32),
                    dict(SHAPE, use_sliding_window=True, sliding_window=64, max_window_layers=2)],
    "Qwen3Config": [dict(SHAPE, head_dim=64, attention_bias=False), dict(SHAPE, num_key_value_heads=None)],
    "Gemma3TextConfig": [
        dict(SHAPE, head_dim=32, rope_parameters={"full_attention": dict(ROPE, rope_theta=1e6),
                                                  "sliding_attention": ROPE},
             hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32, sliding_window=64,
             layer_types=["sliding_attention"] * 3 + ["full_attention"], attn_logit_softcapping=None,
             final_logit_softcapping=30.0),
        dict(SHAPE, head_dim=32, rope_parameters={"full_attention": dict(ROPE), "sliding_attention": dict(ROPE)},
             sliding_window_pattern=2)],
    "MixtralConfig": [dict(SHAPE, head_dim=32, num_experts_per_tok=2, num_local_experts=4, sliding_window=None,
                           attention_bias=False, architectures=["MixtralForCausalLM"])],
    "OlmoeConfig": [dict(SHAPE, head_dim=32, num_experts_per_tok=2, num_experts=4, norm_topk_prob=False,
                         clip_qkv=8.0)],
    "Qwen3MoeConfig": [dict(SHAPE, head_dim=32, num_experts_per_tok=2, num_experts=4, moe_intermediate_size=64,
                            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], attention_bias=False),
                       dict(SHAPE, num_experts=8)],
    "GptOssConfig": [dict(SHAPE, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                          attention_bias=True, architectures=["GptOssForCausalLM"],
                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                           "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "truncate": False}),
                     dict(SHAPE, rope_parameters=None, num_experts=8)],
    "DeepseekV2Config": [dict(SHAPE, rope_parameters=YARN, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                              qk_nope_head_dim=32, v_head_dim=32, moe_intermediate_size=64, n_routed_experts=8,
                              num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                              routed_scaling_factor=1.0, norm_topk_prob=False, n_group=4, topk_group=2,
                              topk_method="group_limited_greedy")],
    "DeepseekV3Config": [dict(SHAPE, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32,
                              v_head_dim=32, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
                              n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                              norm_topk_prob=True, n_group=1, topk_group=1, rope_interleave=True)],
}


def test_every_family_has_cases():
    assert set(CASES) == set(_FAMILIES)


@pytest.mark.parametrize("name, fields", [(name, fields) for name, cases in CASES.items() for fields in cases])
def test_fields_equal_transformers_class(name, fields):
    ours = gguf_model_config(name, **copy.deepcopy(fields))
    theirs = getattr(transformers, name)(**copy.deepcopy(fields))
    assert ours.model_type == theirs.model_type
    assert_same_fields(ours, theirs)
    for alias in type(theirs).attribute_map:
        assert getattr(ours, alias) == getattr(theirs, alias), alias
    rebuilt = ours.to_transformers()
    assert type(rebuilt) is type(theirs) and comparable_config(rebuilt) == comparable_config(theirs)


def test_aliases_read_and_write_their_field():
    config = gguf_model_config("Qwen3MoeConfig", **copy.deepcopy(SHAPE), num_experts=8)
    assert config.num_local_experts == 8 and "num_experts" not in vars(config)
    config.num_experts = 16
    assert config.num_local_experts == 16 and config.num_experts == 16
    with pytest.raises(AttributeError, match="no field 'nonexistent'"):
        config.nonexistent
    assert copy.deepcopy(config) == config


def test_default_model_config_equals_transformers_class():
    config, _ = open_gguf(default_model_path())
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert_same_fields(config, config.to_transformers())


def test_an_engine_on_a_gguf_imports_no_transformers():
    """Importing transformers keeps ~20 MiB in the process, and its model config modules pull in its activations,
    accelerate and sympy besides: an engine on a GGUF whose tokenizer is cached imports none of it."""
    script = (
        "import sys\n"
        "from pagellm import LLM, SamplingParams\n"
        f"llm = LLM({str(default_model_path())!r}, max_model_len=256, max_num_seqs=2, kv_cache_memory_bytes=8 << 20)\n"
        "llm.generate(['Hi'], SamplingParams(max_tokens=2, logprobs=2), use_tqdm=False)\n"
        "heavy = [m for m in ('sympy', 'accelerate', 'transformers') if m in sys.modules]\n"
        "print('heavy:', heavy)\n"
    )
    out = run_python(script)
    assert "heavy: []" in out, out
