"""Tensor parallelism on 8-bit checkpoints (the tiny 4-KV-head Llama): each rank loads its slice of the int8 or
fp8 weights and of their scales (per-channel scales split with the output features, block scales by whole
blocks, per-shard scales replicated).

fp8 weights are weight-only and static int8 activation scales quantize each feature alike on every rank, so
TP=2 must give TP=1's tokens, as float models do (only the float32 sums of the ranks' partial products differ).
Dynamic int8 activations are another matter: each row-parallel rank quantizes its own slice of the features with
its own scale (as vLLM's ranks do), which is not TP=1's arithmetic; not compared here.
"""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from tests.helpers import PROMPTS
from tests.w8a8_checkpoints import write_quantized

ENGINE = dict(dtype="float32", block_size=4, num_gpu_blocks_override=48, max_num_batched_tokens=32,
              max_model_len=192, max_num_seqs=4, distributed_timeout_seconds=60)
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)


def _run(path: str, tp: int) -> list[tuple[list[int], list[dict]]]:
    llm = LLM(path, tensor_parallel_size=tp, **ENGINE)
    try:
        outputs = llm.generate(PROMPTS[:4], PARAMS, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outputs]


@pytest.mark.parametrize("scheme, fmt", [
    ("fp8-block-dynamic", "fp8"),  # block scales split by whole blocks
    ("int8-tensor-static", "compressed-tensors"),  # per-shard weight and input scales, replicated
])
def test_tp2_equals_tp1_on_8_bit_checkpoints(tmp_path, tiny_4kv_dir, scheme, fmt):
    quantized, _ = write_quantized(tiny_4kv_dir, tmp_path, scheme, fmt)
    one, two = _run(quantized, 1), _run(quantized, 2)
    assert [tokens for tokens, _ in two] == [tokens for tokens, _ in one]
    for (_, ours), (_, theirs) in zip(two, one):
        for mine, reference in zip(ours, theirs):
            assert mine.keys() == reference.keys()
            assert all(abs(mine[t] - reference[t]) < 1e-3 for t in mine)
