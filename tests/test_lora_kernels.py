"""LoRA's pieces without a model: the step's token grouping, the C kernel and the Triton kernels (under
TRITON_INTERPRET=1) against a float64 reference, and the slot table / scheduler admission rules."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig
from pagellm.lora.cpu_kernels import lora_kernel
from pagellm.lora.punica import add_lora_torch, build_mapping
from pagellm.lora.request import LoRARequest
from pagellm.lora.slot_table import LoRASlotTable
from pagellm.ops.cpu_build import runnable_isas
from pagellm.sampling_params import SamplingParams
from tests.helpers import built_or_skip

CASES = [
    # tokens' slots (-1: none), slots, capacity, in, out, widths per slot
    (np.array([-1, 2, 0, 2, -1, 0, 1, 2, 2, 0]), 3, 48, 64, 96, [48, 16, 32]),
    (np.array([1] * 7), 2, 16, 40, 33, [0, 16]),  # every token one slot: no gather
    (np.array([0, -1, 1, 1, 0]), 2, 24, 33, 70, [0, 24]),  # a slot whose adapter skips this layer
    (np.arange(37) % 5 - 1, 4, 32, 128, 300, [32, 8, 32, 17]),
]


def _operands(case, dtype=torch.float32):
    token_slots, num_slots, cap, k, n, widths = case
    generator = torch.Generator().manual_seed(len(token_slots) * 7 + n)
    x = torch.randn(len(token_slots), k, generator=generator).to(dtype)
    out = torch.randn(len(token_slots), n, generator=generator).to(dtype)
    a = torch.zeros(num_slots, cap, k, dtype=dtype)
    b_t = torch.zeros(num_slots, cap, n, dtype=dtype)
    for slot, width in enumerate(widths):
        a[slot, :width] = torch.randn(width, k, generator=generator).to(dtype)
        b_t[slot, :width] = torch.randn(width, n, generator=generator).to(dtype)
    return x, out, a, b_t, widths


def _reference(x, out, a, b_t, token_slots) -> torch.Tensor:
    expected = out.double().clone()
    for token, slot in enumerate(token_slots):
        if slot >= 0:
            expected[token] += (x[token].double() @ a[slot].double().t()) @ b_t[slot].double()
    return expected


def test_a_step_without_adapted_tokens_has_no_mapping():
    assert build_mapping(np.array([-1, -1, -1]), torch.device("cpu")) is None
    mapping = build_mapping(np.array([3, -1, 0, 3]), torch.device("cpu"))
    assert mapping.segments == [(0, 0, 1), (3, 1, 3)] and mapping.rows.tolist() == [2, 0, 3]


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("case", CASES)
def test_torch_and_c_kernel_add_the_delta_of_adapted_tokens_only(case, isa):
    token_slots = case[0]
    x, out, a, b_t, widths = _operands(case)
    expected = _reference(x, out, a, b_t, token_slots)
    mapping = build_mapping(token_slots, torch.device("cpu"))
    torch_out = add_lora_torch(x, out.clone(), a, b_t, widths, mapping)
    torch.testing.assert_close(torch_out.double(), expected, rtol=1e-5, atol=1e-4)
    kernel = built_or_skip(lora_kernel(isa), "lora_kernel(isa)")
    c_out = kernel(x, out.clone(), a, b_t, mapping.rows, mapping.segment_array, np.array(widths, dtype=np.int64))
    torch.testing.assert_close(c_out.double(), expected, rtol=1e-5, atol=1e-4)
    untouched = token_slots < 0
    assert torch.equal(c_out[untouched], out[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES[::3] + CASES[2:3])
def test_triton_kernels_match_the_reference_under_the_interpreter(case, dtype):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from pagellm.lora.triton_kernels import add_lora_triton

    token_slots = case[0]
    x, out, a, b_t, _ = _operands(case, dtype)
    expected = _reference(x, out, a, b_t, token_slots)
    mapping = build_mapping(token_slots, torch.device("cpu"))
    result = add_lora_triton(x, out.clone(), a, b_t, mapping)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    torch.testing.assert_close(result.double(), expected, **tolerance)
    assert torch.equal(result[token_slots < 0], out[token_slots < 0])


def _lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


def test_the_slot_table_never_evicts_an_adapter_in_use_and_reuses_the_least_recent():
    table = LoRASlotTable(2)
    assert table.acquire("r1", _lora(1)) == 0 and table.acquire("r2", _lora(2)) == 1
    assert table.take_loads() == [(0, _lora(1)), (1, _lora(2))]
    assert not table.can_admit(_lora(3)) and table.can_admit(_lora(1)) and table.can_admit(None)
    assert table.acquire("r3", _lora(1)) == 0 and table.take_loads() == []  # resident: no load
    table.release("r1", 0)
    assert not table.can_admit(_lora(3))  # r3 still runs on slot 0
    table.release("r2", 1)
    table.release("r3", 0)
    # Slot 1 went idle first: adapter 3 replaces adapter 2, and adapter 1 stays resident.
    assert table.acquire("r4", _lora(3)) == 1 and table.take_loads() == [(1, _lora(3))]
    assert table.slot_of == {1: 0, 3: 1}


def _adapted_request(request_id: str, arrival: int, lora: LoRARequest | None) -> Request:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    return Request(request_id, [1, 2, 3, 4, 5], params, arrival, 2, lora_request=lora)


def test_a_request_waits_while_no_slot_can_be_freed_and_others_pass_it():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(64, 8, max_model_len=64), kv, lora_slots=LoRASlotTable(1))
    scheduler.add_request(_adapted_request("a", 0, _lora(1)))
    scheduler.add_request(_adapted_request("b", 1, _lora(2)))
    scheduler.add_request(_adapted_request("base", 2, None))
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"a", "base"}  # b's adapter has no slot while a runs
    assert step.lora_loads == [(0, _lora(1))]
    assert {new.request_id: new.lora_slot for new in step.new_requests} == {"a": 0, "base": -1}
    for _ in range(2):  # a and base each sample their two tokens and finish
        output = ModelRunnerOutput(sampled_token_ids={r: 7 for r in step.num_scheduled_tokens})
        scheduler.update_from_output(step, output)
        step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"b"} and step.lora_loads == [(0, _lora(2))]


def test_prefix_blocks_are_keyed_by_adapter():
    kv = KVCacheManager(16, 2, enable_prefix_caching=True)
    kv.allocate_slots("r", 4)
    kv.publish_full_blocks("r", [1, 2, 3, 4], 4, None, lora_int_id=1)
    assert kv.find_cached_prefix([1, 2, 3, 4, 5], None, lora_int_id=1).num_tokens == 4
    assert kv.find_cached_prefix([1, 2, 3, 4, 5], None, lora_int_id=2).num_tokens == 0
    assert kv.find_cached_prefix([1, 2, 3, 4, 5]).num_tokens == 0
