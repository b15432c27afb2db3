"""Tensor-parallel fixtures: a tiny random Llama with 4 KV heads (splits 2 and 4 ways) and process helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import _save_tiny

# head_dim 32, so that decode runs on the native kernel as it does for real models.
TINY_4KV = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture(scope="session")
def tiny_4kv_dir(tmp_path_factory, default_tokenizer) -> str:
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama-4kv"), default_tokenizer, **TINY_4KV)


@pytest.fixture(scope="session")
def tiny_mqa_dir(tmp_path_factory, default_tokenizer) -> str:
    """One KV head for four query heads: two ranks must replicate it."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama-mqa"), default_tokenizer,
                      **{**TINY_4KV, "num_key_value_heads": 1})


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc, no psutil)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name, which is in parentheses and may hold spaces.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry.name))
    return children


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def shared_memory_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
