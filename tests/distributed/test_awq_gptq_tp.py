"""A quantized checkpoint on two tensor-parallel ranks gives one rank's tokens: AWQ (row-parallel ranks hold their
own groups), GPTQ with desc_act (row-parallel ranks hold every group's scales, their inputs' g_idx slice) and
bitsandbytes NF4 (each rank whole 32-weight blocks of its rows and inputs; vLLM refuses this one) and NVFP4
(NVFP4_F16 blocks, the same)."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from tests.helpers import PROMPTS
from tests.bnb_checkpoints import write_bnb
from tests.quant_checkpoints import QuantSpec, write_quantized

ENGINE = dict(dtype="float32", kv_cache_memory_bytes=16 << 20, distributed_timeout_seconds=60)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("spec", [QuantSpec("awq", group_size=32),
                                  QuantSpec("gptq", bits=4, group_size=32, desc_act=True, sym=False)],
                         ids=["awq", "gptq_desc_act"])
def test_tp2_equals_tp1(spec, tmp_path, tiny_4kv_dir):
    write_quantized(tiny_4kv_dir, tmp_path / "quantized", tmp_path / "dequantized", spec)
    _check_tp2_equals_tp1(str(tmp_path / "quantized"))


def test_bitsandbytes_nf4_tp2_equals_tp1(tmp_path, tiny_4kv_dir):
    write_bnb(tiny_4kv_dir, tmp_path / "bnb", 4, "nf4", 64)
    _check_tp2_equals_tp1(str(tmp_path / "bnb"))


@pytest.mark.parametrize("flavour, variant", [("compressed-tensors", "NVFP4A16"), ("modelopt", "NVFP4")])
def test_nvfp4_tp2_equals_tp1(flavour, variant, tmp_path, tiny_4kv_dir):
    from tests.nvfp4_checkpoints import compressed_checkpoint, write_checkpoint

    modules, _ = compressed_checkpoint(tiny_4kv_dir)
    _check_tp2_equals_tp1(write_checkpoint(tiny_4kv_dir, tmp_path / "nvfp4", modules, flavour, variant))


def _check_tp2_equals_tp1(model: str) -> None:
    expected = [o.outputs[0].token_ids for o in LLM(model, **ENGINE).generate(PROMPTS[:6], GREEDY, use_tqdm=False)]
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)] == expected
    finally:
        llm.llm_engine.shutdown()
