"""The Triton attention backend against the torch reference backend, on CPU tensors under TRITON_INTERPRET=1.

Each case is one step over a pool whose blocks are shuffled: decodes with ragged context lengths (some long
enough to be split), and prefill chunks that start a sequence or continue one (chunked prefill / prefix-cache
hit). Both backends get the same host inputs (StepAttentionInputs) and their own copy of the pool; the written
pools and the outputs must agree. bf16 is checked on the device only (tests/gpu): the interpreter mishandles it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("the interpreter tests are for machines without CUDA; tests/gpu run the kernels on the GPU",
                allow_module_level=True)
# Read when triton.jit decorates a kernel, so it must be set before the kernels are imported.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed: `pip install triton` runs these tests on CPU")

from pagellm.attention.backend import AttentionShape, StepAttentionInputs  # noqa: E402
from tests.attention_cases import make_step  # noqa: E402
from pagellm.attention.paged import TorchAttentionBackend, paged_attention  # noqa: E402
from pagellm.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def run_both(shape, computed, scheduled, dtype, seed, num_blocks=64):
    step, q, k, v, k_cache, v_cache = make_step(shape, computed, scheduled, num_blocks, seed)
    scale = shape.head_dim ** -0.5
    results = []
    for backend in (TorchAttentionBackend(shape, torch.device("cpu"), None),
                    TritonAttentionBackend(shape, torch.device("cpu"))):
        kc, vc = k_cache.to(dtype).clone(), v_cache.to(dtype).clone()
        meta = backend.build_metadata(step)
        out = paged_attention(q.to(dtype), k.to(dtype), v.to(dtype), kc, vc, meta, scale)
        results.append((out.float(), kc.float(), vc.float(), meta))
    return results


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


def assert_close(ref, got, dtype):
    assert torch.isfinite(got).all()
    error = (got - ref).norm() / ref.norm()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (8, 2), (8, 1)])
def test_mixed_step_matches_reference(dtype, block_size, num_heads, num_kv_heads):
    """Decodes (ragged, one long enough for several key tiles) + a fresh prefill + a continued chunk."""
    shape = AttentionShape(num_heads, num_kv_heads, head_dim=32, block_size=block_size)
    computed = [0, 37, 150, 0, 45]
    scheduled = [1, 1, 1, 23, 30]
    (ref, ref_k, ref_v, _), (out, k, v, _) = run_both(shape, computed, scheduled, dtype, seed=block_size + num_heads)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert_close(ref, out, dtype)


def test_split_k_decode_matches_reference():
    """Long contexts over few sequences: the decode runs as several splits and a reduce."""
    shape = AttentionShape(4, 2, head_dim=16, block_size=16)
    step, *_ = make_step(shape, [1500, 700], [1, 1], num_blocks=160, seed=3)
    backend = TritonAttentionBackend(shape, torch.device("cpu"))
    assert backend.build_metadata(step).num_splits > 1
    (ref, *_), (out, _, _, meta) = run_both(shape, [1500, 700], [1, 1], torch.float32, seed=3, num_blocks=160)
    assert meta.num_splits > 1
    assert_close(ref, out, torch.float32)


def test_head_dim_not_a_power_of_two_and_empty_padding_rows():
    """head_dim 40 (padded lanes masked); a decode row of length 0 (CUDA-graph padding) gives zeros, no NaN."""
    shape = AttentionShape(4, 4, head_dim=40, block_size=16)
    (ref, *_), (out, *_) = run_both(shape, [10, 3], [1, 9], torch.float32, seed=5)
    assert_close(ref, out, torch.float32)
    backend = TritonAttentionBackend(shape, torch.device("cpu"))
    q = torch.randn(2, 4, 40)
    cache = torch.randn(4, 4, 16, 40)
    out = torch.full_like(q, float("nan"))
    backend.decode(out, q, cache, cache, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32),
                   1, 0.1)
    assert torch.equal(out[0], torch.zeros(4, 40)) and torch.isfinite(out[1]).all()


def test_negative_slot_writes_nothing():
    shape = AttentionShape(2, 2, head_dim=16, block_size=16)
    backend = TritonAttentionBackend(shape, torch.device("cpu"))
    k_cache, v_cache = torch.zeros(4, 2, 16, 16), torch.zeros(4, 2, 16, 16)
    step = StepAttentionInputs(2, np.ones(2, np.int64), np.array([1, 1]), np.array([[1], [2]]), np.array([16, -1]))
    meta = backend.build_metadata(step)
    k = torch.randn(2, 2, 16)
    backend.write_kv(k, k, k_cache, v_cache, meta)
    assert torch.equal(k_cache[1, :, 0], k[0]) and k_cache[2].abs().sum() == 0
