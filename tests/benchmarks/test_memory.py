"""memory.py: KV accounting on hand-checked and simulated workloads, and the simulation against the engine."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from benchmarks import memory
from benchmarks.memory import SchedulerKnobs, fit_table, requests_that_fit, simulate
from benchmarks.workload import BenchRequest, Workload, WorkloadSpec, generate_workload


def hand_workload() -> Workload:
    # Prompts of 5 and 9 tokens; 3 and 1 output tokens.
    requests = [BenchRequest(list(range(10, 15)), 3), BenchRequest(list(range(20, 29)), 1)]
    return Workload(WorkloadSpec(num_prompts=2), requests)


def test_peak_accounting_by_hand():
    result = simulate(hand_workload(), block_size=4, num_blocks=64, max_model_len=32, knobs=SchedulerKnobs())
    peak = result.peak
    # Step 0 admits both: 5 slots in 2 blocks and 9 slots in 3 blocks; the 1-token request then finishes.
    assert (peak.step, peak.num_running, peak.num_used_blocks, peak.num_stored_tokens) == (0, 2, 5, 14)
    assert peak.paged_waste == pytest.approx(1 - 14 / 20)
    assert peak.contiguous_waste(32) == pytest.approx(1 - 14 / 64)
    assert peak.exact_reservation_waste == pytest.approx(1 - 14 / 18)
    # Then the 3-token request decodes alone: 6 and 7 tokens in 2 blocks.
    assert [(s.num_running, s.num_used_blocks, s.num_stored_tokens) for s in result.trace] == [(2, 5, 14), (1, 2, 6), (1, 2, 7)]
    assert (result.num_steps, result.max_running, result.num_preemptions) == (3, 2, 0)


def test_small_pool_preempts_and_still_finishes():
    workload = generate_workload(WorkloadSpec(8, 24, 12, Fraction(1, 2), seed=0), range(100, 1000))
    roomy = simulate(workload, 8, 400, 64, SchedulerKnobs())
    tight = simulate(workload, 8, 12, 64, SchedulerKnobs())
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert tight.peak.num_used_blocks <= 12 and tight.max_running < roomy.max_running
    # Stored tokens never exceed the slots they occupy, and never fall short by a block or more per sequence.
    for snapshot in tight.trace + roomy.trace:
        assert snapshot.num_stored_tokens <= snapshot.allocated_slots
        assert snapshot.allocated_slots - snapshot.num_stored_tokens < 8 * max(1, snapshot.num_running)


def test_requests_that_fit_cycles_through_the_workload():
    assert requests_that_fit([3, 5], 7) == 1
    assert requests_that_fit([3, 5], 8) == 2
    assert requests_that_fit([3, 5], 19) == 5  # 3+5+3+5 = 16, and the next 3 makes exactly 19
    assert requests_that_fit([3, 5], 18) == 4
    with pytest.raises(ValueError):
        requests_that_fit([], 10)


def test_fit_table_by_hand():
    # Final lengths 8 and 10 tokens; a 32-token budget.
    rows = {row.scheme: row.num_requests for row in fit_table(hand_workload(), 32, [4], max_model_len=32)}
    assert rows == {
        "paged, block size 4": 3,  # blocks 2 + 3 + 2 = 7 of 8; another 3 would not fit
        "contiguous, prompt + max_tokens": 3,  # 8 + 10 + 8 = 26; another 10 would not fit
        "contiguous, max_model_len=32": 1,
    }


def test_simulation_matches_the_engine_step_for_step(tiny_llama_dir):
    workload = generate_workload(WorkloadSpec(6, 24, 12, Fraction(1, 2), seed=0), range(100, 1000))
    knobs = SchedulerKnobs(max_num_seqs=8, max_num_batched_tokens=64)
    # 12 blocks of 8 for requests of up to 54 tokens: the engine has to preempt, and chunk prefills.
    simulated = simulate(workload, 8, 12, 64, knobs)
    real = memory.run_engine(workload, 8, 12, 64, knobs, tiny_llama_dir, "float32")
    assert simulated.num_preemptions > 0
    assert real.trace == simulated.trace
    assert real.num_preemptions == simulated.num_preemptions


def test_main_prints_tables_and_writes_the_plot(tmp_path, tiny_llama_dir, capsys):
    plot = tmp_path / "memory.png"
    memory.main(["--model", tiny_llama_dir, "--num-prompts", "6", "--input-len", "40", "--output-len", "20",
                 "--kv-budget-tokens", "2048", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    runs = [json.loads(line) for line in out.splitlines() if line.startswith('{"mode"')]
    assert [(r["mode"], r["block_size"]) for r in runs] == [("simulate", 8), ("simulate", 16), ("simulate", 32)]
    # Larger blocks can only leave more of their slots empty.
    wastes = [r["paged_waste"] for r in runs]
    assert wastes == sorted(wastes)
    assert all(r["contiguous_max_model_len_waste"] > r["contiguous_exact_waste"] > r["paged_waste"] for r in runs)
    fit = json.loads(out.splitlines()[-1])["fit"]
    assert fit["contiguous, max_model_len=512"] == 4 and fit["paged, block size 8"] > 4
