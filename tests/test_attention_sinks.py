"""Attention sinks (gpt-oss: a learned logit per query head in every softmax denominator, with no value) on every
attention path against a float64 reference of the same step: the torch path, the native C decode and prefill
kernels on every instruction set this machine runs (float32 and bfloat16), and the Triton kernels under
TRITON_INTERPRET=1 (one split and split-K decode). Steps mix decodes, a fresh prefill and a chunk with cached
context, over shuffled blocks, with and without a sliding window. Sinks span far below the scores (no effect)
to far above them (most of the weight), so that the kernels' rescaling when a sink exceeds the row's maximum
is exercised.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.attention import native
from pagellm.attention.backend import AttentionShape
from pagellm.attention.paged import TorchAttentionBackend, paged_attention
from pagellm.ops import cpu_build
from tests.attention_cases import make_step
from tests.helpers import built_or_skip

ISAS = cpu_build.runnable_isas()
CPU = torch.device("cpu")
# Decodes with ragged contexts, a chunk continuing a sequence, a fresh prompt.
COMPUTED, SCHEDULED = [0, 37, 70, 40, 0], [1, 1, 1, 29, 35]


def _sinks(num_heads: int) -> torch.Tensor:
    # From "never matters" to "takes most of the weight" (scores here are about N(0, 1)).
    return torch.linspace(-30.0, 9.0, num_heads)


def _reference(step, q, k_cache, v_cache, scale: float, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    """float64: each token's query over its sequence's keys up to its position (and inside the window), the
    sink appended to the logits, softmaxed, its column dropped. k_cache/v_cache hold the step's K/V already."""
    block_size, group = k_cache.shape[2], q.shape[1] // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    token = 0
    for seq, (query_len, seq_len) in enumerate(zip(step.query_lens, step.seq_lens)):
        blocks = step.block_tables[seq, : -(-int(seq_len) // block_size)]
        keys = k_cache[blocks].transpose(1, 2).flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)
        values = v_cache[blocks].transpose(1, 2).flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)
        for i in range(int(query_len)):
            position = int(seq_len - query_len + i)
            first = max(0, position - window + 1) if window else 0
            scores = torch.einsum("hd,lhd->hl", q[token].double(), keys[first:position + 1]) * scale
            logits = torch.cat((scores, sinks.double()[:, None]), dim=1)
            weights = logits.softmax(-1)[:, :-1]
            out[token] = torch.einsum("hl,lhd->hd", weights, values[first:position + 1])
            token += 1
    return out


def _run(backend, shape: AttentionShape, dtype, window: int | None, seed: int, computed=COMPUTED,
         scheduled=SCHEDULED, num_blocks: int = 40):
    step, q, k, v, k_cache, v_cache = make_step(shape, computed, scheduled, num_blocks, seed)
    q, k, v, k_cache, v_cache = (t.to(dtype) for t in (q, k, v, k_cache, v_cache))
    sinks = _sinks(shape.num_heads)
    meta = backend.build_metadata(step)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, shape.head_dim**-0.5, window, sinks)
    expected = _reference(step, q, k_cache, v_cache, shape.head_dim**-0.5, window, sinks)
    return out, expected


def _assert_close(out: torch.Tensor, expected: torch.Tensor, dtype) -> None:
    """Relative error per head: a head whose large sink takes most of its weight has a small output, which an
    error over all heads together would not see."""
    assert torch.isfinite(out).all()
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    error = (out.double() - expected).norm(dim=(0, 2)) / expected.norm(dim=(0, 2))
    assert (error < tolerance).all(), f"relative error per head {error.tolist()}"


@pytest.mark.parametrize("window", [None, 10])
def test_torch_path_matches_reference(window):
    shape = AttentionShape(num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    out, expected = _run(TorchAttentionBackend(shape, CPU, None), shape, torch.float32, window, seed=1)
    _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 10])
def test_native_kernels_match_reference(isa, dtype, window):
    decode = built_or_skip(native.decode_kernel(isa), "native.decode_kernel(isa)")
    prefill = native.prefill_kernel(isa)
    # 9 heads over 3 KV heads: a group of 3 (one pass of the decode kernel), 64-float heads.
    shape = AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    backend = TorchAttentionBackend(shape, CPU, decode, native_prefill=prefill)
    out, expected = _run(backend, shape, dtype, window, seed=2)
    assert out.dtype == dtype
    _assert_close(out, expected, dtype)


def test_native_kernels_without_sinks_are_unchanged():
    """sinks=None is the kernels' plain softmax; a sink far below every score changes nothing either."""
    decode = built_or_skip(native.decode_kernel(), "native.decode_kernel()")
    prefill = native.prefill_kernel()
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    step, q, k, v, k_cache, v_cache = make_step(shape, COMPUTED, SCHEDULED, num_blocks=40, seed=3)
    backend = TorchAttentionBackend(shape, CPU, decode, native_prefill=prefill)
    meta = backend.build_metadata(step)
    plain = paged_attention(q, k, v, k_cache, v_cache, meta, 0.2, None)
    torch_path = TorchAttentionBackend(shape, CPU, None)
    reference = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), torch_path.build_metadata(step), 0.2)
    torch.testing.assert_close(plain, reference, rtol=1e-5, atol=1e-6)
    far_below = paged_attention(q, k, v, k_cache, v_cache, meta, 0.2, None, torch.full((4,), -1e4))
    assert torch.equal(far_below, plain)


def test_sinks_of_the_wrong_shape_are_refused():
    decode = built_or_skip(native.decode_kernel(), "native.decode_kernel()")
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    step, q, k, v, k_cache, v_cache = make_step(shape, [5], [1], num_blocks=8, seed=4)
    meta = TorchAttentionBackend(shape, CPU, decode).build_metadata(step)
    with pytest.raises(ValueError, match=r"one float32 logit per query head, \[4\]"):
        paged_attention(q, k, v, k_cache, v_cache, meta, 0.2, None, torch.zeros(2))


# ---- Triton, under the interpreter ----------------------------------------------------------------


@pytest.fixture
def triton_backend():
    if torch.cuda.is_available():
        pytest.skip("the interpreter tests are for machines without CUDA")
    pytest.importorskip("triton", reason="triton is not installed")
    from pagellm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


@pytest.mark.parametrize("window", [None, 10])
def test_triton_kernels_match_reference(triton_backend, window):
    shape = AttentionShape(num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
    out, expected = _run(triton_backend(shape, CPU), shape, torch.float32, window, seed=5)
    _assert_close(out, expected, torch.float32)


def test_triton_split_k_decode_adds_each_sink_once(triton_backend):
    # A 1,200-key decode is split (decode_splits: 2 splits of >= 512 keys); the reduce adds the sink.
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    backend = triton_backend(shape, CPU)
    assert backend.decode_splits(2, 1200) > 1
    out, expected = _run(backend, shape, torch.float32, None, seed=6, computed=[1199, 20], scheduled=[1, 1],
                        num_blocks=80)
    _assert_close(out, expected, torch.float32)
    np.testing.assert_array_less(0, out.abs().sum(-1).numpy())
