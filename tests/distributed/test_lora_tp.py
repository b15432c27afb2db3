"""LoRA under tensor parallelism: each rank holds its shard of every adapter (B split by output features of the
column-parallel layers, A by input features of the row-parallel ones); two ranks give one rank's tokens, fp32,
in a batch that mixes the base model and more adapters than slots."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.lora.request import LoRARequest
from tests.helpers import PROMPTS
from tests.lora_adapters import ATTENTION, MLP, save_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loras(tiny_4kv_dir, module_tmp_path_factory) -> list[LoRARequest]:
    root = module_tmp_path_factory.mktemp("tp-adapters")
    specs = [dict(rank=8, targets=ATTENTION + MLP, seed=21), dict(rank=4, targets=["q_proj", "o_proj", "down_proj"],
                                                                   seed=22, rslora=True)]
    return [LoRARequest(f"tp{i}", i + 1, save_adapter(tiny_4kv_dir, root / f"tp{i}", **spec))
            for i, spec in enumerate(specs)]


def _run(model: str, tp: int, loras: list[LoRARequest]) -> list[list[int]]:
    llm = LLM(model, tensor_parallel_size=tp, dtype="float32", kv_cache_memory_bytes=16 << 20, enable_lora=True,
              max_loras=1, max_lora_rank=8, distributed_timeout_seconds=60)
    prompts = PROMPTS[:3] * 3
    assignment = [lora for lora in [None, *loras] for _ in range(3)]  # each prompt with each adapter
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=assignment)
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


def test_two_ranks_give_one_ranks_tokens_with_adapters(tiny_4kv_dir, loras):
    reference = _run(tiny_4kv_dir, 1, loras)
    assert reference[0] != reference[3] and reference[0] != reference[6], "the adapters change nothing"
    assert _run(tiny_4kv_dir, 2, loras) == reference
