"""Qwen3 and Gemma 3 from GGUF: a tiny random HF model written out as llama.cpp's converter would (F32, so the
round trip is exact), then read back by pagellm, equals the HF model: same config, same tensors, and the same
greedy tokens as transformers."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
import transformers

from pagellm import LLM, SamplingParams
from pagellm.models.gguf_loader import _ARCHS, _GLOBAL_NAMES, load_gguf
from tests.helpers import hf_greedy, write_decoder_metadata

MAX_TOKENS = 8
# Prompts and outputs stay inside Gemma's 64-token window (sliding windows are tested in test_sliding_window.py).
PROMPTS = ["Hello", "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,"]

COMMON = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.3)
HF_CONFIGS = {
    # head_dim 64, not hidden / heads = 32: the GGUF's key_length must be read.
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=64,
                                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # 6 layers: llama.cpp's fixed pattern makes layer 5 global, the rest sliding.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**COMMON, "tie_word_embeddings": True}, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=64, architectures=["Gemma3ForCausalLM"],
    ),
}


def _gguf_quantize(name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType):
    return gguf.quants.quantize(data, qtype), qtype


def write_gguf_like_llama_cpp(model: transformers.PreTrainedModel, arch: str, path: pathlib.Path,
                              quantized: Callable[[str], gguf.GGMLQuantizationType | None] = lambda name: None,
                              encode=_gguf_quantize) -> None:
    """The HF model's tensors under llama.cpp's names, in F32 (or the block type `quantized` gives a GGUF name,
    its blocks and the type they are stored as from `encode(name, data, type)`), with its metadata keys
    (convert_hf_to_gguf.py)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    write_decoder_metadata(writer, config)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)

    gguf_names = {hf: name for name, hf in _GLOBAL_NAMES.items()}
    block_stems = {hf: stem for stem, hf in _ARCHS[arch].block_names.items()}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if hf_name.startswith("model.layers."):
            _, _, layer, rest = hf_name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{layer}.{block_stems[module]}.{kind}"
        else:
            name = gguf_names[hf_name]
        data = tensor.numpy().astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1)  # llama.cpp multiplies by the weight, HF by 1 + weight
        qtype = quantized(name)
        if qtype is None:
            writer.add_tensor(name, data)
        else:
            blocks, stored = encode(name, data, qtype)
            writer.add_tensor(name, blocks, raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_hf_model(config, tokenizer, seed: int) -> transformers.PreTrainedModel:
    """A random float32 model of `config` over `tokenizer`'s vocabulary, its norms random too."""
    torch.manual_seed(seed)
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Random norms (Gemma's init is all zeros), on a 2^-10 grid so that the converter's + 1 and the
                # loader's - 1 are exact in float32.
                param.copy_(torch.round(torch.empty_like(param).uniform_(-0.5, 0.5) * 1024) / 1024)
    return model


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def tiny(request, module_tmp_path_factory, default_tokenizer):
    """(arch, HF model, HF directory, GGUF path) for one family."""
    arch = request.param
    model = tiny_hf_model(HF_CONFIGS[arch](), default_tokenizer, seed=0)
    directory = module_tmp_path_factory.mktemp(f"tiny-{arch}")
    model.save_pretrained(directory)
    default_tokenizer.save_pretrained(directory)
    path = directory / f"tiny-{arch}.gguf"
    write_gguf_like_llama_cpp(model, arch, path)
    return arch, model, directory, path


def test_gguf_config_and_tensors_equal_the_hf_model(tiny):
    arch, model, _, path = tiny
    config, state_dict = load_gguf(path)
    ref = model.config
    assert type(config.to_transformers()) is type(ref) and config.architectures == [type(model).__name__]
    fields = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rope_parameters", "tie_word_embeddings", "attention_bias"]
    if arch == "gemma3":
        fields += ["sliding_window", "layer_types", "query_pre_attn_scalar", "hidden_activation",
                   "final_logit_softcapping", "attn_logit_softcapping"]
        assert "full_attention" in config.layer_types and "sliding_attention" in config.layer_types
    for field in fields:
        assert getattr(config, field) == getattr(ref, field), field
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps)

    expected = model.state_dict()
    if ref.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state_dict[name], tensor), name


def test_gguf_greedy_equals_transformers(tiny, default_tokenizer):
    arch, model, directory, path = tiny
    # Prompts and outputs inside Gemma's 64-token window: windowed attention has its own tests.
    llm = LLM(str(path), tokenizer=str(directory), dtype="float32", max_model_len=64, kv_cache_memory_bytes=32 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for output in llm.generate(PROMPTS, greedy, use_tqdm=False):
        expected = hf_greedy(model, default_tokenizer, output.prompt_token_ids, MAX_TOKENS, ignore_eos=True)
        assert output.outputs[0].token_ids == expected, (arch, output.prompt)


# IQ types, by (layer, GGUF tensor stem) (qwen3's rows: 128 inputs for q/gate, 256 for attn_output/ffn_down, so the
# 256-weight types go there).
_T = gguf.GGMLQuantizationType
KERNEL_LESS = {(0, "attn_q"): _T.IQ4_NL, (1, "attn_q"): _T.IQ4_NL, (0, "attn_output"): _T.IQ4_XS,
               (1, "attn_output"): _T.IQ3_XXS, (0, "ffn_down"): _T.IQ2_XXS, (1, "ffn_down"): _T.IQ3_S}
# Each type's scale field (byte offset), set to a value that keeps random blocks' weights near the model's.
_SCALES = {"IQ4_NL": (0, 0.003), "IQ4_XS": (0, 0.0001), "IQ2_XXS": (0, 0.002), "IQ3_XXS": (0, 0.001),
           "IQ3_S": (0, 0.001)}


def _kernel_less_blocks(name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Blocks of `qtype` for a tensor of data's shape: gguf's quantizer where it has one, else random blocks
    (seeded by the name) whose scale field is set to a moderate value."""
    import zlib

    if qtype.name not in _SCALES:
        return gguf.quants.quantize(data, qtype)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    blocks = rng.integers(0, 256, (data.size // block_size, block_bytes), dtype=np.uint8)
    offset, scale = _SCALES[qtype.name]
    blocks[:, offset:offset + 2] = np.full((len(blocks), 1), scale, dtype=np.float16).view(np.uint8)
    return blocks.reshape(data.shape[0], -1)


def test_kernel_less_types_run_as_the_blocks_they_are_kept_as(tmp_path, default_tokenizer, caplog):
    """IQ4_XS tensors are kept as IQ4_NL blocks, IQ3_XXS and IQ3_S ones as Q6_K blocks, IQ2_XXS ones as Q8_0
    blocks (gguf_quants.transcode_blocks; IQ4_NL has kernels of its own): the engine generates what it
    generates from a file that stores those blocks itself, token for token and logprob for logprob, and the
    start-up log names the types."""
    from pagellm.models.gguf_quants import kernel_type, transcode_blocks

    model = tiny_hf_model(HF_CONFIGS["qwen3"](), default_tokenizer, seed=1)

    def stem_type(name: str):
        parts = name.split(".")
        return KERNEL_LESS.get((int(parts[1]), parts[2])) if name.startswith("blk.") and parts[-1] == "weight" else None

    def as_stored(name, data, qtype):
        return _kernel_less_blocks(name, data, qtype), qtype

    def as_kept(name, data, qtype):
        blocks = _kernel_less_blocks(name, data, qtype)
        kept = gguf.GGMLQuantizationType[kernel_type(qtype.name)]
        if kept == qtype:
            return blocks, qtype
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        return transcode_blocks(blocks.reshape(-1, block_bytes), int(qtype)).reshape(data.shape[0], -1), kept

    paths = {}
    for kind, encode in (("stored", as_stored), ("kept", as_kept)):
        paths[kind] = tmp_path / f"{kind}.gguf"
        write_gguf_like_llama_cpp(model, "qwen3", paths[kind], stem_type, encode)
    default_tokenizer.save_pretrained(tmp_path)
    # The memory check counts the Q8_0 blocks' bytes: the second file's size, up to each tensor's alignment.
    from pagellm.models.gguf_loader import open_gguf

    growth = open_gguf(paths["stored"])[1].transcoding_growth()
    converted = len(KERNEL_LESS)
    assert abs(paths["stored"].stat().st_size + growth - paths["kept"].stat().st_size) <= 32 * converted
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    results = {}
    for kind, path in paths.items():
        caplog.clear()
        with caplog.at_level("INFO", logger="pagellm.engine.engine_core"):
            llm = LLM(str(path), tokenizer=str(tmp_path), dtype="float32", max_model_len=64,
                      kv_cache_memory_bytes=32 << 20)
        if kind == "stored":
            for name in ("IQ4_XS as IQ4_NL", "IQ3_XXS as Q6_K", "IQ3_S as Q6_K", "IQ2_XXS as Q8_0", " IQ4_NL"):
                assert name in caplog.text, name
        results[kind] = [(o.outputs[0].token_ids, [{t: p.logprob for t, p in step.items()}
                                                   for step in o.outputs[0].logprobs])
                         for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.llm_engine.shutdown()
    assert results["stored"] == results["kept"]


@pytest.fixture(scope="module")
def mxfp4_gguf(module_tmp_path_factory, default_tokenizer):
    """A Qwen3 GGUF whose gate and up projections are MXFP4 (llama.cpp's block_mxfp4, as gpt-oss GGUFs store their
    experts), and the HF model on those tensors' values as gguf dequantizes them."""
    model = tiny_hf_model(HF_CONFIGS["qwen3"](), default_tokenizer, seed=2)
    directory = module_tmp_path_factory.mktemp("mxfp4-gguf")
    default_tokenizer.save_pretrained(directory)

    def mxfp4(name: str):
        return _T.MXFP4 if name.startswith("blk.") and name.endswith(("ffn_gate.weight", "ffn_up.weight")) else None

    path = directory / "tiny-mxfp4.gguf"
    write_gguf_like_llama_cpp(model, "qwen3", path, mxfp4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                blocks = gguf.quants.quantize(param.numpy(), _T.MXFP4)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, _T.MXFP4)))
    return model, directory, path


def test_mxfp4_tensors_stay_in_4_bit_blocks(mxfp4_gguf, caplog):
    """MXFP4 tensors are kept as MXFP4_F16 blocks (18 bytes per 32 weights where the file has 17; the values bit
    for bit, gguf_quants.mxfp4_f16_blocks), and run on the native kernels within 2% of their dequantized weights
    (the kernels quantize activations per 32, as llama.cpp does)."""
    from pagellm.layers.linear import LinearBase

    model, directory, path = mxfp4_gguf
    with caplog.at_level("INFO", logger="pagellm.engine.engine_core"):
        llm = LLM(str(path), tokenizer=str(directory), dtype="float32", max_model_len=64,
                  kv_cache_memory_bytes=32 << 20)
    assert "MXFP4 as MXFP4_F16" in caplog.text
    ours = dict(llm.llm_engine.core.runner.model.named_modules())
    theirs = dict(model.named_modules())
    generator = torch.Generator().manual_seed(0)
    for layer in range(model.config.num_hidden_layers):
        mlp = ours[f"model.layers.{layer}.mlp.gate_up_proj"]
        assert isinstance(mlp, LinearBase)
        [part] = mlp.quantized_parts  # gate and up of one type: one product
        assert part.type_name == "MXFP4_F16" and part.data.numel() == 2 * 256 * 128 * 18 // 32
        x = torch.randn(3, 128, generator=generator)
        hf = theirs[f"model.layers.{layer}.mlp"]
        expected = torch.cat((hf.gate_proj(x), hf.up_proj(x)), dim=1)
        assert (mlp(x) - expected).norm() <= 0.02 * expected.norm(), layer


def test_mxfp4_gguf_greedy_equals_transformers_on_its_values(mxfp4_gguf, default_tokenizer, torch_ops_only):
    model, directory, path = mxfp4_gguf
    llm = LLM(str(path), tokenizer=str(directory), dtype="float32", max_model_len=64, kv_cache_memory_bytes=32 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for output in llm.generate(PROMPTS, greedy, use_tqdm=False):
        expected = hf_greedy(model, default_tokenizer, output.prompt_token_ids, MAX_TOKENS, ignore_eos=True)
        assert output.outputs[0].token_ids == expected, output.prompt
