"""The CPU micro-benchmarks time only options that compute the same thing as the path pagellm runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.cpu_attention import blocked, sdpa
from benchmarks.cpu_gemm import gemm_options, time_chain
from pagellm.ops.dense_linear import can_pack_for_cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_options_agree_with_f_linear(dtype):
    torch.manual_seed(0)
    weight = torch.randn(48, 24, dtype=dtype)
    x = torch.randn(5, 24, dtype=dtype)
    expected = F.linear(x.float(), weight.float())
    options = gemm_options(weight)
    from pagellm.ops.linear_bf16 import linear_bf16

    assert ("native" in options) == (dtype == torch.bfloat16 and linear_bf16() is not None)
    assert ("packed" in options) == can_pack_for_cpu(weight.device, dtype)
    for name, fn in options.items():
        torch.testing.assert_close(fn(x).float(), expected, rtol=2e-2, atol=5e-2, msg=name)


def test_gemm_chain_times_every_option_over_distinct_layers():
    seconds = time_chain(torch.bfloat16, rows=2, layers=1, repeats=1)
    assert "mkl" in seconds and ("packed" in seconds or "upcast" in seconds)
    assert all(0 < s < 60 for s in seconds.values())


@pytest.mark.parametrize("tokens", [7, 40])
def test_blocked_attention_is_causal_sdpa(tokens):
    torch.manual_seed(tokens)
    q, k, v = torch.randn(tokens, 6, 16), torch.randn(tokens, 2, 16), torch.randn(tokens, 2, 16)
    torch.testing.assert_close(blocked(q, k, v, 0.25, block=16), sdpa(q, k, v, 0.25), rtol=1e-4, atol=1e-5)
    # Causal: the first token's output depends on its own key and value only.
    k2, v2 = k.clone(), v.clone()
    k2[1:], v2[1:] = 0, 0
    torch.testing.assert_close(blocked(q, k2, v2, 0.25, block=16)[0], blocked(q, k, v, 0.25, block=16)[0])


def test_sampler_benchmark_times_both_selections_and_restores_the_kernel(capsys):
    from benchmarks import sampler as sampler_benchmark
    from pagellm.ops.largest import largest_per_row
    from pagellm.sample import sampler

    sampler_benchmark.main(["--vocab", "4096", "--rows", "4", "--repeats", "1"])
    table = capsys.readouterr().out
    assert table.count("x |") == 4 + len(sampler_benchmark.SETTINGS)  # a speed-up on every row
    assert sampler.largest_per_row is largest_per_row
