"""Memory that grows with what serving needs, not with what start-up could need: the CPU rotary tables, the
runner's token table, the heap handed back when the engine goes idle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from pagellm.layers.rotary import CPU_INITIAL_POSITIONS, RotaryEmbedding
from pagellm.worker.input_batch import InputBatch, lazily_zeroed


def _rotary(max_positions: int) -> RotaryEmbedding:
    rotary = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), 64, max_positions)
    rotary.reset_cache(torch.device("cpu"))
    return rotary


def test_cpu_rotary_tables_grow_to_the_positions_steps_reach():
    rotary = _rotary(4096)
    assert rotary.cos.shape[0] == CPU_INITIAL_POSITIONS
    rotary.cover(torch.tensor([3, 700, 5]))
    assert rotary.cos.shape[0] == 701  # the step's last position, past twice the old size
    grown = rotary.cos.clone(), rotary.sin.clone()
    rotary.cover(torch.tensor([701]))
    assert rotary.cos.shape[0] == 1402  # doubling
    rotary.cover(torch.tensor([4095]))
    assert rotary.cos.shape[0] == 4096
    # A row does not depend on how many the table has.
    assert torch.equal(grown[0], rotary.cos[:701]) and torch.equal(grown[1], rotary.sin[:701])
    with pytest.raises(ValueError, match="position 4096 is beyond the rotary tables' 4096"):
        _rotary(4096).cover(torch.tensor([4096]))
    rotary.trim()
    assert rotary.cos.shape[0] == CPU_INITIAL_POSITIONS


def test_rope_inputs_and_lookups_cover_their_positions():
    from pagellm.layers.rotary import RopeInputs

    rotary = _rotary(2048)
    RopeInputs(torch.tensor([1000]), None, None, rotary)
    assert rotary.cos.shape[0] >= 1001
    other = _rotary(2048)
    cos, _ = other.lookup(torch.tensor([1500, 2]), torch.float32)
    assert other.cos.shape[0] >= 1501 and torch.equal(cos[0, 0], other.cos[1500])


def _resident_kib(array: np.ndarray) -> int:
    """Resident KiB of the mapping that holds `array`."""
    address, inside = array.__array_interface__["data"][0], False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "Rss:":
                return int(fields[1])
    raise AssertionError("no mapping holds the array")


def test_the_token_table_takes_only_the_pages_written():
    table = lazily_zeroed(256, 32768)  # 64 MiB
    assert not table.any()
    table[:, 0] = 7  # one token in every row: one 4 KiB page a row (each row is 256 KiB)
    assert _resident_kib(table) <= 256 * 4 + 64


def test_input_batch_growth_keeps_every_row():
    batch = InputBatch(max_num_seqs=2, max_model_len=64, max_blocks=8)
    batch.token_ids[0, :5] = [1, 2, 3, 4, 5]
    batch.token_ids[1, :3] = [9, 8, 7]
    batch.num_tokens[:2] = [5, 3]
    batch.block_table[0, :2] = [4, 6]
    batch.num_blocks[:2] = [2, 0]
    batch.grow(3)
    assert batch.token_ids.shape == (5, 64) and batch.block_table.shape == (5, 8)
    assert batch.token_ids[0, :5].tolist() == [1, 2, 3, 4, 5] and batch.token_ids[1, :3].tolist() == [9, 8, 7]
    assert batch.block_table[0, :2].tolist() == [4, 6]
    assert not batch.token_ids[2:].any() and not batch.block_table[2:].any()


def test_the_engine_hands_back_its_heap_when_it_goes_idle(tiny_llama_dir, monkeypatch):
    from pagellm import LLM, SamplingParams
    from pagellm.engine import engine_core

    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    trims = []
    monkeypatch.setattr(engine_core, "return_free_heap", lambda: trims.append(llm.llm_engine.has_unfinished_requests()))
    llm.generate(["Hello there", "The sea"], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert trims == [False]  # once, as the last request finished
