"""gpt-oss from GGUF, written as llama.cpp's converter (convert_hf_to_gguf.py's GptOssModel) writes it: experts
stacked per projection in MXFP4 (gate and up de-interleaved from HF's gate_up_proj), their biases stacked beside
them, a sink per head (attn_sinks), the norm after attention as post_attention_norm, a biased router, yarn rope;
then read by pagellm and compared with transformers on the same values."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.layers.fused_moe import FusedMoE
from pagellm.layers.quantization.gguf_moe import GGUFFusedMoEMethod
from pagellm.models.gguf_loader import load_gguf
from tests.helpers import PROMPTS, hf_greedy
from tests.mxfp4_checkpoints import write_gpt_oss_gguf

MAX_TOKENS = 8
ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
@pytest.fixture(scope="module")
def gpt_oss_gguf(module_tmp_path_factory, default_tokenizer):
    """(HF model on the MXFP4 experts' values, tokenizer directory, GGUF path)."""
    from tests.models.test_gpt_oss import _gpt_oss, _randomise_biases_and_sinks

    model_class, config = _gpt_oss()
    config.swiglu_limit = 7.0  # a GGUF carries none: llama.cpp (and pagellm) take the released models' 7
    config.vocab_size = len(default_tokenizer)
    config.bos_token_id, config.eos_token_id = default_tokenizer.bos_token_id, default_tokenizer.eos_token_id
    torch.manual_seed(0)
    model = model_class(config).float().eval()
    with torch.no_grad():
        _randomise_biases_and_sinks(model)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    directory = module_tmp_path_factory.mktemp("gpt-oss-gguf")
    default_tokenizer.save_pretrained(directory)
    path = directory / "tiny-gpt-oss.gguf"
    kept = write_gpt_oss_gguf(model.state_dict(), model.config, path)
    with torch.no_grad():  # the model's experts take the values the blocks hold
        for name, values in kept.items():
            model.get_parameter(name).copy_(values)
    return model, directory, path


def test_config_and_tensors_equal_the_hf_model(gpt_oss_gguf):
    model, _, path = gpt_oss_gguf
    config, state_dict = load_gguf(path)
    ref = model.config
    assert config.architectures == ["GptOssForCausalLM"]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
                  "layer_types", "rope_parameters", "attention_bias", "swiglu_limit", "swiglu_alpha"):
        assert getattr(config, field) == getattr(ref, field), field
    expected = model.state_dict()
    for layer in range(ref.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, bias = expected.pop(f"{prefix}.gate_up_proj"), expected.pop(f"{prefix}.gate_up_proj_bias")
        down, down_bias = expected.pop(f"{prefix}.down_proj"), expected.pop(f"{prefix}.down_proj_bias")
        for expert in range(ref.num_local_experts):
            expected[f"{prefix}.{expert}.gate_proj.weight"] = gate_up[expert, :, 0::2].t()
            expected[f"{prefix}.{expert}.up_proj.weight"] = gate_up[expert, :, 1::2].t()
            expected[f"{prefix}.{expert}.down_proj.weight"] = down[expert].t()
            expected[f"{prefix}.{expert}.gate_proj.bias"] = bias[expert, 0::2]
            expected[f"{prefix}.{expert}.up_proj.bias"] = bias[expert, 1::2]
            expected[f"{prefix}.{expert}.down_proj.bias"] = down_bias[expert]
    assert state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state_dict[name], tensor), name


def test_greedy_equals_transformers_on_the_blocks_values(gpt_oss_gguf, default_tokenizer, torch_ops_only):
    """The products' torch path: the same tokens as transformers on the values the MXFP4 blocks hold."""
    model, directory, path = gpt_oss_gguf
    llm = LLM(str(path), tokenizer=str(directory), **ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for output in llm.generate(PROMPTS[:4], greedy, use_tqdm=False):
        expected = hf_greedy(model, default_tokenizer, output.prompt_token_ids, MAX_TOKENS, ignore_eos=True)
        assert output.outputs[0].token_ids == expected, output.prompt


def test_experts_stay_in_mxfp4_blocks(gpt_oss_gguf, caplog):
    """The native kernels: MXFP4 experts kept as MXFP4_F16 blocks with their biases, each layer's experts within
    2% of transformers' experts on the same values (activations rounded to 8 bits per 32, as llama.cpp does)."""
    model, directory, path = gpt_oss_gguf
    with caplog.at_level("INFO", logger="pagellm.engine.engine_core"):
        llm = LLM(str(path), tokenizer=str(directory), **ENGINE)
    assert "MXFP4 as MXFP4_F16" in caplog.text
    ours = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    generator = torch.Generator().manual_seed(0)
    config = model.config
    for layer, experts in enumerate(ours):
        assert isinstance(experts.quant_method, GGUFFusedMoEMethod) and experts.gguf_experts is not None
        assert experts.w13_weight.numel() + experts.w2_weight.numel() == (
            config.num_local_experts * 3 * config.hidden_size * config.intermediate_size * 18 // 32)
        x = torch.randn(5, config.hidden_size, generator=generator)
        logits = torch.randn(5, config.num_local_experts, generator=generator)
        weights, ids = experts.select_experts(logits)
        with torch.no_grad():
            got = experts.quant_method.apply(experts, x, weights, ids)
            expected = model.model.layers[layer].mlp.experts(x, ids, weights)  # transformers' GptOssExperts
        assert (got - expected).norm() <= 0.02 * expected.norm(), layer


def test_the_files_own_vocabulary_is_its_tokenizer(gpt_oss_gguf, tmp_path, default_tokenizer):
    """A gpt-oss GGUF's tokenizer comes from its vocabulary, as for the other architectures (transformers' own
    config read of such a file fails on its rope keys; pagellm names the tokenizer's type instead)."""
    from pagellm.models.gguf_loader import build_gguf_tokenizer, default_model_path

    model, _, _ = gpt_oss_gguf
    path = tmp_path / "with-vocabulary.gguf"
    write_gpt_oss_gguf(model.state_dict(), model.config, path, vocabulary=default_model_path())
    tokenizer = build_gguf_tokenizer(path)
    text = "Hello world, the capital of France is 1234 and it's 'quoted'."
    assert tokenizer.encode(text) == default_tokenizer.encode(text)
