"""The native CPU kernels on every instruction set this machine runs (forced per test), in float32 and
bfloat16, against the torch expressions they replace; the builds this machine cannot run are compile-checked.

The bfloat16 fused ops round where torch's bfloat16 ops store a tensor, so they are compared with the unfused
bfloat16 expressions (transformers' own LlamaRMSNorm for the norm) up to one bfloat16 step, which a float32
sum taken in another order can move a value across; almost every element must be equal.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from pagellm.attention import native
from pagellm.ops import cpu_build
from pagellm.ops.cpu_ops import CpuOps, cpu_ops
from tests.helpers import built_or_skip

ISAS = cpu_build.runnable_isas()
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=ISAS)
def isa(request):
    return request.param


def _ops(isa):
    ops = built_or_skip(cpu_ops(isa), "cpu_ops(isa)")
    assert ops.isa == isa
    return ops


def _close(actual, expected, dtype, fp32_tolerance=(1e-5, 1e-6)):
    """float32: tight tolerances. bfloat16: within one bfloat16 step, and 99% of elements identical."""
    assert actual.dtype == expected.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=fp32_tolerance[0], atol=fp32_tolerance[1])
        return
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-6)
    # Below e^-87 the kernels' exponential stops (silu(-200) is 1e-37 there, -0.0 in torch): not a rounding.
    equal = ((actual == expected) | ((actual.float() - expected.float()).abs() < 1e-30)).float().mean().item()
    assert equal >= 0.99, f"only {equal:.2%} of the bfloat16 results are identical to torch's"


# ---- fused ops ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 100), (33, 23)])
def test_add_rms_norm_matches_transformers(isa, dtype, rows, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ops = _ops(isa)
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    residual = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    with torch.no_grad():
        expected_sum = x + residual
        expected_out = norm(expected_sum)
        stream = residual.clone()
        out = ops.add_rms_norm(x, stream, norm.weight, 1e-5)
        assert torch.equal(stream, expected_sum)  # the same additions, rounded the same way
        _close(out, expected_out, dtype)
        _close(ops.add_rms_norm(x, None, norm.weight, 1e-5), norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1536), (5, 37)])
def test_silu_and_mul_matches_torch(isa, dtype, rows, width):
    ops = _ops(isa)
    gen = torch.Generator().manual_seed(width)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 4
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -20.0, -1e-8, 0.0, 1e-8, 20.0, 200.0])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    _close(ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype, (2e-6, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 36])
def test_rotary_inplace_matches_torch(isa, dtype, head_dim):
    from transformers import LlamaConfig

    from pagellm.layers.rotary import RotaryEmbedding, apply_rotary

    ops = _ops(isa)
    num_heads, num_kv_heads, tokens = 5, 1, 9
    rotary = RotaryEmbedding(LlamaConfig(rope_theta=100000.0), head_dim, 4096)
    rotary.reset_cache(torch.device("cpu"))
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 4095, 7, 100, 101, 102, 2000, 3])
    rotary.cover(positions)  # the kernel reads the tables by position
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = (part.reshape(tokens, -1, head_dim) for part in qkv.split(sizes, dim=-1))
    expected_q, expected_k = apply_rotary(q, k, rotary.lookup(positions, dtype))
    expected_v = v.clone()
    ops.rotary_inplace(qkv, num_heads + num_kv_heads, head_dim, rotary.cos, rotary.sin, positions)
    q, k, v = (part.reshape(tokens, -1, head_dim) for part in qkv.split(sizes, dim=-1))
    _close(q, expected_q, dtype)
    _close(k, expected_k, dtype)
    assert torch.equal(v, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5, 700])
def test_kv_writer_equals_index_copy(isa, dtype, tokens):
    """The C write lands every head of every token in the row index_copy_ puts it, from strided views of
    a fused qkv output as the model passes them, and touches nothing else."""
    from pagellm.attention.paged import kv_write_index, write_kv

    writer = built_or_skip(native.kv_writer(isa), "native.kv_writer(isa)")
    num_blocks, kv_heads, block_size, head_dim = 64, 3, 16, 64
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    k = qkv[:, 9 * head_dim : (9 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (9 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = np.random.default_rng(tokens).permutation(num_blocks * block_size)[:tokens]
    rows = torch.from_numpy(kv_write_index(slots // block_size, slots % block_size, kv_heads, block_size))
    caches = [torch.full((num_blocks, kv_heads, block_size, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
    writer(k, v, caches[0], caches[1], rows)
    write_kv(k, v, caches[2], caches[3], rows)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))
    assert int((~caches[0].isnan()).sum()) == tokens * kv_heads * head_dim


def test_fused_ops_refuse_other_dtypes():
    ops = _ops(ISAS[0])
    assert CpuOps.supports(576, 1536, torch.bfloat16) and CpuOps.supports(576, 1536)
    assert not CpuOps.supports(576, 1536, torch.float16)
    with pytest.raises(TypeError, match="float16"):
        ops.silu_and_mul(torch.zeros(2, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match="weight must be torch.bfloat16"):
        ops.add_rms_norm(torch.zeros(2, 16, dtype=torch.bfloat16), None, torch.ones(16), 1e-5)


# ---- decode attention -----------------------------------------------------------------------------


def _decode_case(num_heads, num_kv_heads, head_dim, block_size, context_lens, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
    order = np.random.default_rng(seed).permutation(num_blocks)
    tables = np.zeros((len(context_lens), max(blocks_per_seq) + 2), dtype=np.int64)
    used = 0
    for seq, count in enumerate(blocks_per_seq):
        tables[seq, :count] = order[used : used + count]
        used += count
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, np.array(context_lens, dtype=np.int64)


def _decode_reference(q, k_cache, v_cache, tables, context_lens, scale, window=0, sinks=None, magnitudes=False):
    """Softmax attention in float64 over each sequence's keys, gathered block by block (with `sinks`, [heads]
    logits each denominator also holds). magnitudes: the sums of weight * |value| instead, the scale of the error
    that rounding each weight makes."""
    outs = []
    group = q.shape[1] // k_cache.shape[1]
    for seq, length in enumerate(context_lens):
        keys = k_cache[tables[seq]].transpose(1, 2).flatten(0, 1)[:length].double()  # [L, KVH, D]
        values = v_cache[tables[seq]].transpose(1, 2).flatten(0, 1)[:length].double()
        first = max(0, length - window) if window else 0
        keys, values = keys[first:].repeat_interleave(group, 1), values[first:].repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[seq].double(), keys) * scale
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        weights = scores.softmax(-1)[:, : keys.shape[0]]
        outs.append(torch.einsum("hl,lhd->hd", weights, values.abs() if magnitudes else values))
    return torch.stack(outs)


def _uses_tiles(kernel, dtype, block_size):
    return kernel.amx and dtype == torch.bfloat16 and block_size % 16 == 0


def _within_rounded_weights(out, case, scale, **reference_options):
    """bfloat16 attention whose softmax weights were rounded to bfloat16 before the value product (the AMX path,
    as SDPA's bfloat16 kernel rounds them): each output within 2^-8 of its sum of weight * |value| plus one
    bfloat16 step of itself."""
    expected = _decode_reference(*case, scale, **reference_options)
    magnitude = _decode_reference(*case, scale, magnitudes=True, **reference_options)
    error = (out.double() - expected).abs()
    bound = 2**-8 * (magnitude + expected.abs()) + 1e-6
    assert not torch.isnan(out).any()
    assert (error <= bound).all(), f"worst error / bound {(error / bound).max().item():.2f}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 1, 128, 8), (4, 4, 96, 32)])
def test_decode_kernel_matches_reference(isa, dtype, block_size, num_heads, num_kv_heads, head_dim):
    kernel = native.decode_kernel(isa)
    assert kernel.isa == isa
    case = _decode_case(num_heads, num_kv_heads, head_dim, block_size, [1, 7, block_size, 77, 130], dtype,
                        seed=block_size + head_dim)
    out = kernel(*case, head_dim**-0.5)
    assert out.dtype == dtype
    if _uses_tiles(kernel, dtype, block_size):
        _within_rounded_weights(out, case, head_dim**-0.5)
        return
    expected = _decode_reference(*case, head_dim**-0.5).to(dtype)
    _close(out, expected, dtype, (1e-4, 2e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 13, 1000])
def test_decode_kernel_sliding_window_never_reads_slid_out_blocks(isa, dtype, window):
    block_size, head_dim = 8, 64
    kernel = native.decode_kernel(isa)
    q, k_cache, v_cache, tables, context_lens = _decode_case(6, 2, head_dim, block_size, [3, 20, 61, 97], dtype,
                                                             seed=window)
    expected = _decode_reference(q, k_cache, v_cache, tables, context_lens, 0.125, window).to(dtype)
    # Blocks wholly before L - window are holes: an index far outside the pool, which a read would crash on.
    for seq, length in enumerate(context_lens):
        tables[seq, : max(0, length - window) // block_size] = 1 << 40
    out = kernel(q, k_cache, v_cache, tables, context_lens, 0.125, sliding_window=window)
    _close(out, expected, dtype, (1e-4, 2e-5))


@pytest.mark.skipif(not native.decode_kernel(ISAS[0]).amx, reason="no AMX tiles on this CPU (or not granted)")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window", [
    (9, 3, 64, 16, 0), (40, 2, 128, 32, 0), (6, 3, 96, 16, 0), (8, 2, 64, 16, 21), (4, 1, 64, 32, 50)])
def test_decode_tiles_against_reference_and_vector_loops(num_heads, num_kv_heads, head_dim, block_size, window):
    """The AMX path (bfloat16 q and cache, block_size a multiple of 16): over 16 heads per kv head (two passes),
    head sizes that end on a 32-float value tile, sliding windows starting mid-tile with slid-out blocks as holes,
    sinks, and NaN in every cache slot past a sequence's end (a zero weight times NaN would poison the sum)."""
    kernel = native.decode_kernel(ISAS[0])
    lengths = [1, 15, 16, 17, 33, 100, 257]
    case = _decode_case(num_heads, num_kv_heads, head_dim, block_size, lengths, torch.bfloat16, seed=head_dim + window)
    q, k_cache, v_cache, tables, context_lens = case
    for seq, length in enumerate(lengths):
        if length % block_size:
            k_cache[tables[seq, length // block_size], :, length % block_size :] = float("nan")
            v_cache[tables[seq, length // block_size], :, length % block_size :] = float("nan")
    sinks = torch.linspace(-1.0, 2.0, num_heads)
    scale = head_dim**-0.5
    options = {"window": window, "sinks": sinks}
    holes = tables.copy()
    for seq, length in enumerate(lengths):
        if window:
            holes[seq, : max(0, length - window) // block_size] = 1 << 40
    tiles = kernel(q, k_cache, v_cache, holes, context_lens, scale, sliding_window=window, sinks=sinks)
    _within_rounded_weights(tiles, case, scale, **options)
    kernel.amx = False  # a wrapper of its own (decode_kernel makes one per call)
    loops = kernel(q, k_cache, v_cache, holes, context_lens, scale, sliding_window=window, sinks=sinks)
    # The loops keep the weights in float32: the two paths differ by the weights' rounding alone.
    torch.testing.assert_close(tiles.float(), loops.float(), rtol=2**-6, atol=2**-7)


def test_decode_tiles_only_where_the_build_has_them():
    for isa in ISAS[1:]:
        assert not native.decode_kernel(isa).amx, isa


def test_decode_kernel_float32_queries_on_bf16_cache_equal_float32_cache(isa):
    # The bf16 cache is widened exactly on load: the same values in float32 give the same result.
    kernel = native.decode_kernel(isa)
    q, k_cache, v_cache, tables, context_lens = _decode_case(6, 2, 64, 16, [1, 77, 160], torch.bfloat16, seed=8)
    q = q.float()
    from_bf16 = kernel(q, k_cache, v_cache, tables, context_lens, 0.125)
    assert from_bf16.dtype == torch.float32
    assert torch.equal(from_bf16, kernel(q, k_cache.float(), v_cache.float(), tables, context_lens, 0.125))
    with pytest.raises(ValueError, match="sliding_window=-1"):
        kernel(q, k_cache, v_cache, tables, context_lens, 0.125, sliding_window=-1)


def test_decode_kernel_refuses_head_sizes_it_cannot_sum():
    assert native.DecodeKernel.supports(64) and native.DecodeKernel.supports(32)
    assert not native.DecodeKernel.supports(48)
    kernel = native.decode_kernel(ISAS[0])
    case = _decode_case(2, 1, 48, 16, [5], torch.float32, seed=0)
    with pytest.raises(ValueError, match="head_dim=48"):
        kernel(*case, 0.1)


# ---- choosing and building the instruction set ----------------------------------------------------


def test_isa_follows_cpu_flags_and_override(monkeypatch):
    assert cpu_build.runnable_isas(frozenset()) == ["generic"]
    assert cpu_build.runnable_isas(frozenset({"avx2", "fma"})) == ["avx2", "generic"]
    avx512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"})
    assert cpu_build.runnable_isas(avx512) == ["avx512", "avx2", "generic"]
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.delenv("PAGELLM_CPU_ISA", raising=False)
    assert cpu_build.best_isa() == "avx2"
    monkeypatch.setenv("PAGELLM_CPU_ISA", "generic")
    assert cpu_build.best_isa() == "generic"
    monkeypatch.setenv("PAGELLM_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="lacks"):
        cpu_build.best_isa()
    monkeypatch.setenv("PAGELLM_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="sse9"):
        cpu_build.best_isa()


def test_override_selects_the_library(monkeypatch):
    monkeypatch.setenv("PAGELLM_CPU_ISA", ISAS[-1])
    cpu_build.native_library.cache_clear()
    try:
        assert native.decode_kernel().isa == ISAS[-1]
    finally:
        monkeypatch.delenv("PAGELLM_CPU_ISA")
        cpu_build.native_library.cache_clear()
    assert native.decode_kernel().isa == ISAS[0]


def test_every_isa_compiles(tmp_path):
    """Compile-only (to object files): the builds this CPU cannot run must still compile on it."""
    try:
        compiler = cpu_build.find_compiler()
    except FileNotFoundError:
        pytest.skip("no C compiler")
    if not any(flag in cpu_build.cpu_flags() for flag in ("avx2", "sse2")):
        pytest.skip("x86 targets need an x86 compiler")  # the generic build is what other CPUs load
    builds = {"generic": cpu_build.compiler_flags("generic"), "avx2": cpu_build.compiler_flags("avx2"),
              "avx512": cpu_build.compiler_flags("avx512", native_bf16=False, amx=False),
              "avx512_bf16": cpu_build.compiler_flags("avx512", native_bf16=True, amx=False),
              "avx512_amx": cpu_build.compiler_flags("avx512", native_bf16=True, amx=True)}
    jobs = []
    for name, flags in builds.items():
        # -O0: the same target checks (always_inline intrinsics need their instruction set) in less time.
        flags = ["-O0" if flag == "-O3" else flag for flag in flags]
        for source in cpu_build.SOURCES:
            command = [compiler, *flags, "-Werror", "-c", str(source), "-o", str(tmp_path / f"{name}-{source.stem}.o")]
            jobs.append((name, subprocess.Popen(command, stderr=subprocess.PIPE, text=True)))
    for name, job in jobs:
        _, errors = job.communicate(timeout=120)
        assert job.returncode == 0, f"{name}: {errors}"


# ---- end to end ---------------------------------------------------------------------------------


def test_bf16_model_on_fused_ops_gives_the_unfused_greedy_tokens(tiny_llama_dir):
    """The tiny model in bfloat16: the fused kernels round as the torch ops do, so greedy tokens are equal."""
    from pagellm import LLM, SamplingParams
    from tests.helpers import PROMPTS

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # No prefix caching: the second run would start from the first run's cached blocks and prefill only the
    # prompts' tails, another computation, whose rounding may flip a near tie in bfloat16.
    llm = LLM(tiny_llama_dir, dtype="bfloat16", max_num_batched_tokens=64, kv_cache_memory_bytes=16 << 20,
              enable_prefix_caching=False)
    runner = llm.llm_engine.core.runner
    assert runner.native_decode is not None
    model = runner.model
    model.use_cpu_ops(None)  # whatever the loader chose, first the torch ops
    unfused = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    ops = cpu_ops()
    assert CpuOps.supports(model.config.hidden_size, model.config.intermediate_size, torch.bfloat16)
    model.use_cpu_ops(ops)
    fused = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert fused == unfused
