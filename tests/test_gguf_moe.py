"""Mixture-of-experts GGUF files: llama.cpp's stacked experts (blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps),
routers, shared experts and DeepSeek's latent attention tensors, loaded with the experts kept in their blocks.

Each model is a tiny random transformers model written out as llama.cpp's converter writes it (its tensor names,
its q/k permutation for llama, its 3-D expert stacks, its split of kv_b_proj into attn_k_b / attn_v_b, its metadata
keys), with the experts quantized to Q8_0 or Q4_K and everything else F32. The HF model then takes the experts'
dequantized values, so it is the exact reference: pagellm's greedy tokens equal transformers' token for token in
float32 with the GGUF kernels multiplying on dequantized tiles of each expert's slice (their int8 products, which
quantize the activations as llama.cpp does, are compared with a float reference within tolerance below, and on
the Triton kernels under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from pagellm import LLM, SamplingParams
from pagellm.distributed.parallel_state import TensorParallelGroup, building_with
from pagellm.layers.fused_moe import FusedMoE, Routing, grouped_experts
from pagellm.layers.quantization.gguf import GGUFConfig, GGUFWeight
from pagellm.models import gguf_quants
from pagellm.models.gguf_loader import load_gguf, open_gguf
from pagellm.models.loader import default_dtype
from pagellm.ops import gguf_kernels as gk
from tests.helpers import PROMPTS, check_logprobs_close, hf_greedy, hf_greedy_with_top_logprobs, write_decoder_metadata

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
MOE_PROMPTS = [PROMPTS[0], PROMPTS[2], PROMPTS[5]]
T = gguf.GGMLQuantizationType

ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                 initializer_range=0.3, tie_word_embeddings=False)
MLA = dict(num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.3,
           kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, first_k_dense_replace=1,
           n_routed_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0}


def _mixtral():
    # Q4_K experts: rows of 256 weights (one super-block) in and out.
    return transformers.MixtralConfig(**ATTENTION, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_local_experts=8, num_experts_per_tok=2, rope_theta=10000.0,
                                      sliding_window=None)


def _qwen3_moe():
    # As llama.cpp runs qwen3moe: every layer sparse, weights renormalised (Qwen3-30B-A3B's norm_topk_prob).
    return transformers.Qwen3MoeConfig(**ATTENTION, hidden_size=128, head_dim=64, intermediate_size=96,
                                       moe_intermediate_size=64, num_hidden_layers=2, num_experts=8,
                                       num_experts_per_tok=3, norm_topk_prob=True, rope_theta=10000.0)


def _olmoe():
    return transformers.OlmoeConfig(**ATTENTION, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                                    num_experts=8, num_experts_per_tok=2, clip_qkv=2.5, rope_theta=10000.0)


def _deepseek_v2_lite(grouped: bool = False):
    # q_lora_rank None (attn_q), softmax routing, two shared experts; kv_b_proj split as newer llama.cpp writes it.
    routing = dict(topk_method="group_limited_greedy", n_group=4, topk_group=2) if grouped else {}
    return transformers.DeepseekV2Config(**MLA, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         moe_intermediate_size=64, q_lora_rank=None, n_shared_experts=2,
                                         rope_theta=10000.0, **routing)


def _deepseek_v3():
    # q_lora_rank, yarn rope, sigmoid routing with exp_probs_b, groups, routed_scaling_factor; one attn_kv_b.
    return transformers.DeepseekV3Config(**MLA, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                         moe_intermediate_size=256, q_lora_rank=48, n_group=4, topk_group=2,
                                         routed_scaling_factor=2.5, n_shared_experts=1, rope_parameters=YARN)


# name -> (config, GGUF architecture, expert type, kv_b_proj split into attn_k_b / attn_v_b)
VARIANTS = {
    "mixtral-q4_k": (_mixtral, "llama", T.Q4_K, False),
    "qwen3moe-q8_0": (_qwen3_moe, "qwen3moe", T.Q8_0, False),
    "olmoe-q8_0": (_olmoe, "olmoe", T.Q8_0, False),
    "deepseek-v2-lite-q8_0": (_deepseek_v2_lite, "deepseek2", T.Q8_0, True),
    # DeepSeek-V2's group-limited routing: the file's expert_group_count / expert_group_used_count.
    "deepseek-v2-grouped-q8_0": (lambda: _deepseek_v2_lite(grouped=True), "deepseek2", T.Q8_0, False),
    "deepseek-v3-q4_k": (_deepseek_v3, "deepseek2", T.Q4_K, False),
}


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """Q4_K blocks of float32 rows (gguf cannot quantize k-quants): per 32 weights a 6-bit scale and min of the
    block's d and dmin, 4-bit quants, laid out as ggml's block_q4_K (d, dmin, 12 bytes of scales, 128 of quants)."""
    rows, cols = weights.shape
    sub = weights.reshape(-1, 8, 32).astype(np.float64)
    low = np.minimum(sub.min(axis=-1), 0)
    step = (sub.max(axis=-1) - low) / 15
    d = np.maximum(step.max(axis=-1) / 63, 1e-4).astype(np.float16)
    dmin = np.maximum((-low).max(axis=-1) / 63, 1e-4).astype(np.float16)
    scales = np.clip(np.rint(step / d.astype(np.float64)[:, None]), 1, 63).astype(np.uint8)
    mins = np.clip(np.rint(-low / dmin.astype(np.float64)[:, None]), 0, 63).astype(np.uint8)
    real_step = d.astype(np.float64)[:, None] * scales
    real_low = dmin.astype(np.float64)[:, None] * mins
    quants = np.clip(np.rint((sub + real_low[..., None]) / real_step[..., None]), 0, 15).astype(np.uint8)
    packed_scales = np.empty((len(d), 12), dtype=np.uint8)
    packed_scales[:, 0:4] = (scales[:, :4] & 63) | ((scales[:, 4:] >> 4) << 6)
    packed_scales[:, 4:8] = (mins[:, :4] & 63) | ((mins[:, 4:] >> 4) << 6)
    packed_scales[:, 8:12] = (scales[:, 4:] & 0xF) | ((mins[:, 4:] & 0xF) << 4)
    packed_quants = (quants[:, 0::2] | (quants[:, 1::2] << 4)).reshape(len(d), 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed_scales,
                             packed_quants], axis=1)
    return blocks.reshape(rows, cols // 256 * 144)


def quantized(weights: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, torch.Tensor]:
    """(the blocks of `weights` [..., cols] in `qtype`, their dequantized values)."""
    flat = weights.detach().reshape(-1, weights.shape[-1]).numpy().astype(np.float32)
    blocks = quantize_q4_k(flat) if qtype == T.Q4_K else gguf.quants.quantize(flat, qtype)
    values = gguf_quants.dequantize(blocks, int(qtype), flat.shape)
    return blocks.reshape(*weights.shape[:-1], -1), torch.from_numpy(values).view(weights.shape)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's rotary permutation of q/k rows (LlamaModel.permute)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def _write_metadata(writer: gguf.GGUFWriter, config, arch: str) -> None:
    write_decoder_metadata(writer, config)
    if arch != "deepseek2":
        writer.add_head_count_kv(config.num_key_value_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch == "olmoe":
            writer.add_clamp_kqv(config.clip_qkv)
        return
    # DeepseekV2Model.set_gguf_parameters: MLA as one latent "head" of rank + rope, the heads' sizes under *_mla.
    writer.add_head_count_kv(1)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    if config.model_type == "deepseek_v3":
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if config.model_type == "deepseek_v3" or config.topk_method == "group_limited_greedy":
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    rope = config.rope_parameters
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_moe_gguf(model: transformers.PreTrainedModel, arch: str, expert_type: gguf.GGMLQuantizationType,
                   split_kv_b: bool, path: pathlib.Path, per_expert: bool = False) -> None:
    """The model as llama.cpp's converter writes it, experts in `expert_type`; the model's experts take the values
    their blocks hold. `per_expert`: one 2-D tensor per expert (blk.N.ffn_gate.E.weight), as Mixtral files were
    written before llama.cpp stacked them."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, arch)
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    state = model.state_dict()
    for hf_name, tensor in state.items():
        if hf_name in globals_:
            writer.add_tensor(globals_[hf_name], tensor.numpy().astype(np.float32))
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        if rest.endswith("e_score_correction_bias"):
            writer.add_tensor(f"blk.{layer}.exp_probs_b.bias", tensor.numpy().astype(np.float32))
            continue
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            stacks = ({"ffn_gate_exps": tensor.chunk(2, dim=1)[0], "ffn_up_exps": tensor.chunk(2, dim=1)[1]}
                      if rest.endswith("gate_up_proj") else {"ffn_down_exps": tensor})
            values = []
            for stem, stack in stacks.items():
                blocks, dequantized = quantized(stack.contiguous(), expert_type)
                if per_expert:
                    for expert, expert_blocks in enumerate(blocks):
                        writer.add_tensor(f"blk.{layer}.{stem.removesuffix('_exps')}.{expert}.weight",
                                          np.ascontiguousarray(expert_blocks), raw_dtype=expert_type)
                else:
                    writer.add_tensor(f"blk.{layer}.{stem}.weight", blocks, raw_dtype=expert_type)
                values.append(dequantized)
            with torch.no_grad():
                state[hf_name].copy_(torch.cat(values, dim=1))
            continue
        module, kind = rest.rsplit(".", 1)
        data = tensor.numpy().astype(np.float32)
        stem = _BLOCK[module]
        if arch == "llama" and stem in ("attn_q", "attn_k"):
            data = _permute(data, config.num_attention_heads if stem == "attn_q" else config.num_key_value_heads)
        if stem == "attn_kv_b" and split_kv_b:
            heads, nope = config.num_attention_heads, config.qk_nope_head_dim
            per_head = data.reshape(heads, nope + config.v_head_dim, -1)
            keys = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))  # [heads, rank, nope]
            writer.add_tensor(f"blk.{layer}.attn_k_b.weight", keys)
            writer.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(per_head[:, nope:]))
            continue
        if stem.endswith("_shexp") and expert_type == T.Q8_0:
            writer.add_tensor(f"blk.{layer}.{stem}.{kind}", gguf.quants.quantize(data, T.Q8_0), raw_dtype=T.Q8_0)
            with torch.no_grad():
                state[hf_name].copy_(quantized(tensor, T.Q8_0)[1])
            continue
        writer.add_tensor(f"blk.{layer}.{stem}.{kind}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _perturb(model: transformers.PreTrainedModel) -> None:
    """Norms away from one (a norm loaded into the wrong place shows) and V3's correction bias away from zero (it
    changes which experts are chosen)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.3)


@pytest.fixture(scope="module")
def tiny_ggufs(module_tmp_path_factory, default_tokenizer):
    """variant -> (HF model on the dequantized experts, tokenizer directory, GGUF path), built on first use."""
    built = {}

    def get(variant: str):
        if variant not in built:
            make_config, arch, expert_type, split_kv_b = VARIANTS[variant]
            config = make_config()
            config.vocab_size = len(default_tokenizer)
            config.bos_token_id, config.eos_token_id = default_tokenizer.bos_token_id, default_tokenizer.eos_token_id
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
            _perturb(model)
            directory = module_tmp_path_factory.mktemp(variant)
            default_tokenizer.save_pretrained(directory)
            path = directory / f"{variant}.gguf"
            write_moe_gguf(model, arch, expert_type, split_kv_b, path)
            built[variant] = model, directory, path
        return built[variant]

    return get


def _experts_stay_quantized(llm: LLM, path: pathlib.Path) -> None:
    """Every FusedMoE holds its experts as the file's blocks: uint8, as many bytes as the file's expert tensors."""
    model = llm.llm_engine.core.runner.model
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert layers
    resident = 0
    for layer in layers:
        assert layer.w13_weight.dtype == torch.uint8 and layer.w2_weight.dtype == torch.uint8, layer.prefix
        resident += layer.w13_weight.nbytes + layer.w2_weight.nbytes
        resident += sum(t.nbytes for t in layer.quant_method.kernel_tensors(layer))
    _, tensors = open_gguf(path)
    in_file = sum(gguf_quants.tensor_nbytes(info.shape, info.type_id) for info in tensors.header.tensors.values()
                  if "_exps." in info.name)
    assert resident == in_file


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_transformers_on_the_dequantized_experts(variant, tiny_ggufs, default_tokenizer,
                                                                dequantized_tiles):
    model, directory, path = tiny_ggufs(variant)
    llm = LLM(str(path), tokenizer=str(directory), dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.core.runner.model.config.architectures == [type(model).__name__]
    _experts_stay_quantized(llm, path)
    for output in llm.generate(MOE_PROMPTS, GREEDY, use_tqdm=False):
        expected = hf_greedy(model, default_tokenizer, output.prompt_token_ids, MAX_TOKENS, ignore_eos=True)
        assert output.outputs[0].token_ids == expected, (variant, output.prompt)


def test_config_from_the_file_equals_the_model(tiny_ggufs):
    """The metadata llama.cpp writes gives back the HF config's routing, MLA sizes and rope."""
    model, _, path = tiny_ggufs("deepseek-v3-q4_k")
    config, _ = open_gguf(path)
    ref = model.config
    assert config.architectures == ["DeepseekV3ForCausalLM"] and config.model_type == "deepseek_v3"
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
                  "n_shared_experts", "first_k_dense_replace", "moe_intermediate_size", "n_group", "topk_group",
                  "norm_topk_prob", "intermediate_size"):
        assert getattr(config, field) == getattr(ref, field), field
    assert config.routed_scaling_factor == pytest.approx(ref.routed_scaling_factor)
    rope = config.rope_parameters
    # beta_fast / beta_slow are not written (the converter leaves llama.cpp's defaults, transformers' too: 32, 1).
    for field in ("rope_type", "factor", "original_max_position_embeddings"):
        assert rope[field] == ref.rope_parameters[field], field
    assert rope["mscale_all_dim"] == pytest.approx(YARN["mscale_all_dim"]) == pytest.approx(rope["mscale"])
    lite, _ = open_gguf(tiny_ggufs("deepseek-v2-lite-q8_0")[2])
    assert lite.architectures == ["DeepseekV2ForCausalLM"] and lite.q_lora_rank is None
    assert lite.topk_method == "greedy" and lite.n_shared_experts == 2
    grouped, _ = open_gguf(tiny_ggufs("deepseek-v2-grouped-q8_0")[2])
    assert (grouped.topk_method, grouped.n_group, grouped.topk_group) == ("group_limited_greedy", 4, 2)


@pytest.mark.parametrize("variant", ["olmoe-q8_0", "deepseek-v2-lite-q8_0"])
def test_float_state_dict_holds_each_expert_under_its_hf_name(variant, tiny_ggufs):
    """load_gguf (everything dequantized) names each expert of a stack as an HF checkpoint does, with the values
    the HF model runs on; kv_b_proj comes back whole from attn_k_b / attn_v_b."""
    model, _, path = tiny_ggufs(variant)
    _, state_dict = load_gguf(path)
    reference = model.state_dict()
    whole = "self_attn.kv_b_proj.weight" if "deepseek" in variant else "self_attn.q_norm.weight"
    for name in ("mlp.gate.weight", whole):
        assert torch.equal(state_dict[f"model.layers.1.{name}"], reference[f"model.layers.1.{name}"]), name
    experts = model.model.layers[1].mlp.experts
    for expert in range(experts.gate_up_proj.shape[0]):
        gate, up = experts.gate_up_proj[expert].detach().chunk(2)
        for proj, values in (("gate_proj", gate), ("up_proj", up), ("down_proj", experts.down_proj[expert].detach())):
            assert torch.equal(state_dict[f"model.layers.1.mlp.experts.{expert}.{proj}.weight"], values), (expert, proj)


def test_mixtral_with_one_tensor_per_expert_loads_as_the_stacked_file(tiny_ggufs, tmp_path):
    model, _, stacked = tiny_ggufs("mixtral-q4_k")
    legacy = tmp_path / "per-expert.gguf"
    write_moe_gguf(model, "llama", T.Q4_K, False, legacy, per_expert=True)
    config, tensors = open_gguf(legacy)
    assert config.architectures == ["MixtralForCausalLM"] and config.num_local_experts == 8
    ours = dict(tensors.items())
    theirs = dict(open_gguf(stacked)[1].items())
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        if isinstance(tensor, GGUFWeight):
            assert isinstance(ours[name], GGUFWeight) and ours[name].type_name == tensor.type_name == "Q4_K"
            assert torch.equal(ours[name].data, tensor.data), name
        else:
            assert torch.equal(ours[name], tensor), name


def test_int8_products_agree_with_transformers_up_to_near_ties(tiny_ggufs):
    """The kernels' own choice per product (here the int8 dot products at every row count: Q4_K's tiles start at
    1024 rows) quantizes activations as llama.cpp does, 0.5-0.7% off the exact product per product on these
    weights and 1-2% through an expert (gate_up, activation, down): on this random model's flat logits the tokens
    part within the first few, so what is checked is vLLM's check_logprobs_close (up to the first difference
    each side's token is in the other's top 5); the layer's own error is bounded below."""
    model, directory, path = tiny_ggufs("mixtral-q4_k")
    llm = LLM(str(path), tokenizer=str(directory), dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    assert gk.gguf_kernels() is None or gk.DENSE_MIN_ROWS[gk.gguf_kernels().isa]["Q4_K"] > 64
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    for output in llm.generate(MOE_PROMPTS, params, use_tqdm=False):
        completion = output.outputs[0]
        ours = (completion.token_ids, [{t: lp.logprob for t, lp in p.items()} for p in completion.logprobs])
        theirs = hf_greedy_with_top_logprobs(model, output.prompt_token_ids, MAX_TOKENS, 5)
        check_logprobs_close(ours, theirs)


# --- the method on random experts: the C kernels' int8 products and the Triton kernels on an expert's slice ---

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 256, 256, 4, 2


def _random_experts(type_name: str, seed: int, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE):
    """(per expert (w1, w3, w2) as GGUFWeight, the same dequantized as float [E, 2I, H] and [E, H, I])."""
    rng = np.random.default_rng(seed)
    qtype = T[type_name]
    weights, w13, w2 = [], [], []
    for _ in range(EXPERTS):
        parts = []
        for rows, cols in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate)):
            blocks, values = quantized(torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32) * 0.1),
                                       qtype)
            parts.append((GGUFWeight(torch.from_numpy(np.ascontiguousarray(blocks)), type_name, rows, cols), values))
        weights.append([p[0] for p in parts])
        w13.append(torch.cat([parts[0][1], parts[1][1]]))
        w2.append(parts[2][1])
    return weights, torch.stack(w13), torch.stack(w2)


def _reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        for weight, expert in zip(weights[token], ids[token]):
            gate, up = (x[token].double() @ w13[expert].double().t()).chunk(2)
            out[token] += weight.double() * (F.silu(gate) * up) @ w2[expert].double().t()
    return out


def _gguf_moe(ops, experts, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE,
              group: TensorParallelGroup | None = None, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
              **kwargs) -> FusedMoE:
    """The GGUF experts' layer on `experts`' blocks, and on `biases` (w13 [E, 2I], w2 [E, H]) where given."""
    with building_with(group or TensorParallelGroup(0, 1)), default_dtype(torch.float32):
        layer = FusedMoE(EXPERTS, TOP_K, hidden, intermediate, quant_config=GGUFConfig(ops=ops),
                         prefix="model.layers.0.mlp.experts", routing=Routing.softmax_top_k(TOP_K, True),
                         reduce_results=group is None, **kwargs)
    for expert, parts in enumerate(experts):
        for shard, weight in zip(("w1", "w3", "w2"), parts):
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            param.weight_loader(param, weight, (expert, shard))
        if biases is not None:
            b13, b2 = biases[0][expert], biases[1][expert]
            for shard, bias in (("w1", b13[:intermediate]), ("w3", b13[intermediate:]), ("w2", b2)):
                param = layer.w2_bias if shard == "w2" else layer.w13_bias
                param.weight_loader(param, bias, (expert, shard))
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize(("kernels", "type_name"), [("c", "Q8_0"), ("c", "Q4_K"), ("triton", "Q8_0")])
def test_experts_multiply_on_their_blocks(kernels, type_name):
    """Each expert's products on its slice of the stacked blocks. The Triton kernels run under the interpreter,
    slowly: small experts of one type (tests/test_triton_gguf.py covers every type's decoding)."""
    if kernels == "c":
        ops = gk.gguf_kernels()
        if ops is None:
            pytest.skip("the GGUF C kernels cannot be built here")
        tokens, hidden, intermediate = 5, HIDDEN, INTERMEDIATE  # decode-sized: the int8 products
    else:
        from pagellm.ops.triton_gguf import TritonGGUFKernels

        ops = TritonGGUFKernels()  # on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py)
        tokens, hidden, intermediate = 3, 64, 32
    experts, w13, w2 = _random_experts(type_name, 1, hidden, intermediate)
    layer = _gguf_moe(ops, experts, hidden, intermediate)
    assert layer.w13_weight.dtype == torch.uint8
    assert layer.w13_weight.nbytes + layer.w2_weight.nbytes == sum(w.data.nbytes for e in experts for w in e)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
    logits = torch.randn(tokens, EXPERTS, generator=torch.Generator().manual_seed(3))
    weights, ids = layer.select_experts(logits)
    expected = _reference(x, w13, w2, weights, ids)
    # int8 activations (C): llama.cpp's Q8 rounding of x and of the activated rows, 1.2% (Q8_0) and 1.8% (Q4_K)
    # of the output's norm here; Triton: float32 sums. A misplaced expert or shard is off by ~100%.
    tolerance = 3e-2 if kernels == "c" else 1e-5
    out = layer(x, logits).double()
    assert (out - expected).norm() <= tolerance * expected.norm()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_0"])
def test_a_decode_steps_experts_in_one_call_give_each_experts_own_products(type_name):
    """On the C kernels a decode-sized step runs each projection's experts in one gguf_matmul_experts call: the
    same bits as the products expert by expert."""
    ops = gk.gguf_kernels()
    if ops is None:
        pytest.skip("the GGUF C kernels cannot be built here")
    experts, _, _ = _random_experts(type_name, 1)
    layer = _gguf_moe(ops, experts)
    method = layer.quant_method
    assert method._one_call(layer.gguf_experts.gate_up[0], HIDDEN) is not None
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(4))
    weights, ids = layer.select_experts(torch.randn(6, EXPERTS, generator=torch.Generator().manual_seed(5)))
    one_by_one = grouped_experts(x, weights, ids, EXPERTS, method._gate_up(layer.gguf_experts, HIDDEN),
                                 method._down(layer.gguf_experts, INTERMEDIATE), 2 * INTERMEDIATE, layer.act_fn)
    assert torch.equal(method.apply(layer, x, weights, ids), one_by_one)


@pytest.mark.parametrize("kernels", ["c", "triton"])
def test_biased_experts_add_their_biases_on_the_blocks(kernels):
    """gpt-oss's experts (biases after each product, the clamped SwiGLU; its MXFP4 checkpoints take this method)
    on the C kernels and on the Triton kernels under the interpreter."""
    from pagellm.layers.fused_moe import ClampedSwiGLU

    if kernels == "c":
        ops = gk.gguf_kernels()
        if ops is None:
            pytest.skip("the GGUF C kernels cannot be built here")
        hidden, intermediate = HIDDEN, INTERMEDIATE
    else:
        from pagellm.ops.triton_gguf import TritonGGUFKernels

        ops, hidden, intermediate = TritonGGUFKernels(), 64, 32
    experts, w13, w2 = _random_experts("Q8_0", 7, hidden, intermediate)
    generator = torch.Generator().manual_seed(8)
    b13 = torch.randn(EXPERTS, 2 * intermediate, generator=generator)
    b2 = torch.randn(EXPERTS, hidden, generator=generator)
    layer = _gguf_moe(ops, experts, hidden, intermediate, biases=(b13, b2), activation="swigluoai", has_bias=True,
                      swiglu_limit=1.0)
    assert layer.gguf_experts is not None
    x = torch.randn(3, hidden, generator=generator)
    logits = torch.randn(3, EXPERTS, generator=generator)
    weights, ids = layer.select_experts(logits)
    act = ClampedSwiGLU(1.702, 1.0)
    expected = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(3):
        for weight, expert in zip(weights[token], ids[token]):
            h = act((x[token].double() @ w13[expert].double().t() + b13[expert].double())[None])[0]
            expected[token] += weight.double() * (h @ w2[expert].double().t() + b2[expert].double())
    tolerance = 3e-2 if kernels == "c" else 1e-5  # int8 activations on the C kernels (see above)
    assert (layer(x, logits).double() - expected).norm() <= tolerance * expected.norm()


def test_gate_and_up_of_different_types_are_separate_products():
    experts, w13, w2 = _random_experts("Q8_0", seed=4)
    for parts in experts:  # up in Q4_K, as a mixed quantization might store it
        values = parts[1].dequantize(torch.float32)
        blocks, _ = quantized(values, T.Q4_K)
        parts[1] = GGUFWeight(torch.from_numpy(np.ascontiguousarray(blocks)), "Q4_K", INTERMEDIATE, HIDDEN)
    w13 = torch.stack([torch.cat([p[0].dequantize(torch.float32), p[1].dequantize(torch.float32)]) for p in experts])
    layer = _gguf_moe(gk.TorchGGUFOps(), experts)
    assert [t for _, t, _ in layer.gguf_experts.gate_up] == ["Q8_0", "Q4_K"]
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(5))
    logits = torch.randn(4, EXPERTS, generator=torch.Generator().manual_seed(6))
    weights, ids = layer.select_experts(logits)
    torch.testing.assert_close(layer(x, logits).double(), _reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_experts_without_kernels_run_dequantized():
    """Where the CPU kernels cannot be built (TorchGGUFOps without blocks) the experts are dequantized once at
    load and run as float experts."""
    experts, w13, w2 = _random_experts("Q4_K", seed=12)
    layer = _gguf_moe(gk.TorchGGUFOps(keeps_blocks=False), experts)
    assert layer.gguf_experts is None and layer.w13_weight.dtype == torch.float32
    # As dequantized, or packed for the native experts kernel (ops/cpu_moe.py) where it is built.
    assert layer.w13_weight.shape in ((EXPERTS, 2 * INTERMEDIATE, HIDDEN), (EXPERTS, -(-INTERMEDIATE // 16), 2, HIDDEN, 16))
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(13))
    logits = torch.randn(3, EXPERTS, generator=torch.Generator().manual_seed(14))
    weights, ids = layer.select_experts(logits)
    torch.testing.assert_close(layer(x, logits).double(), _reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_tensor_parallel_ranks_take_their_rows_and_input_blocks():
    """Two ranks: each holds its half of every expert's gate/up rows and of its down projection's input blocks;
    the ranks' partial sums add up to the whole layer."""
    experts, w13, w2 = _random_experts("Q8_0", seed=8)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(9))
    logits = torch.randn(4, EXPERTS, generator=torch.Generator().manual_seed(10))
    total = torch.zeros(4, HIDDEN, dtype=torch.float64)
    for rank in range(2):
        layer = _gguf_moe(gk.TorchGGUFOps(), experts, group=TensorParallelGroup(rank, 2))
        assert layer.w13_weight.nbytes + layer.w2_weight.nbytes == sum(w.data.nbytes for e in experts for w in e) // 2
        weights, ids = layer.select_experts(logits)
        total += layer(x, logits).double()
    torch.testing.assert_close(total, _reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_expert_parallel_ranks_take_whole_experts_of_their_own():
    """Two ranks with expert parallelism: each holds the blocks of its half of the experts, whole (a Q4_K down
    projection that tensor parallelism would split inside a block loads here), and the ranks' sums add up."""
    experts, w13, w2 = _random_experts("Q4_K", seed=15)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(16))
    logits = torch.randn(4, EXPERTS, generator=torch.Generator().manual_seed(17))
    total = torch.zeros(4, HIDDEN, dtype=torch.float64)
    for rank in range(2):
        group = TensorParallelGroup(rank, 2, expert_parallel=True)
        layer = _gguf_moe(gk.TorchGGUFOps(), experts, group=group)
        held = experts[layer.placement.start:layer.placement.start + layer.placement.count]
        assert layer.local_num_experts == EXPERTS // 2
        assert layer.w13_weight.nbytes + layer.w2_weight.nbytes == sum(w.data.nbytes for e in held for w in e)
        weights, ids = layer.select_experts(logits)
        total += layer(x, logits).double()
    torch.testing.assert_close(total, _reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_a_down_projection_split_inside_a_block_is_refused():
    experts, _, _ = _random_experts("Q4_K", seed=11)  # 256 intermediate features: one block per row
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 gives each rank 128.*Q4_K"):
        _gguf_moe(gk.TorchGGUFOps(), experts, group=TensorParallelGroup(0, 2))


def test_experts_of_one_projection_in_two_types_are_refused():
    experts, _, _ = _random_experts("Q8_0", seed=7)
    values = experts[1][0].dequantize(torch.float32)
    experts[1][0] = GGUFWeight(torch.from_numpy(np.ascontiguousarray(quantized(values, T.Q4_K)[0])), "Q4_K",
                               INTERMEDIATE, HIDDEN)
    with pytest.raises(ValueError, match=r"experts\.1\.w1.*Q4_K.*Q8_0"):
        _gguf_moe(gk.TorchGGUFOps(), experts)


def test_an_unsupported_expert_type_is_refused_naming_it(tmp_path):
    """An expert stack in a type pagellm cannot read (Q8_K, llama.cpp's activation type) is refused before any
    tensor is read, naming the tensor, its type and the types pagellm reads."""
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "qwen3moe")
    writer.add_block_count(1)
    writer.add_embedding_length(256)
    writer.add_head_count(4)
    writer.add_expert_count(2)
    writer.add_expert_used_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float32))
    # Q8_K: 292 bytes per 256 weights; two experts of 64 x 256.
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 64, 292), dtype=np.uint8), raw_dtype=T.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"Q8_K.*blk\.0\.ffn_gate_exps\.weight.*Q4_K"):
        open_gguf(tmp_path / "iq.gguf")
