"""The parts of tensor parallelism that need no processes: which sizes a model allows, which heads each
rank holds, how cores are shared out, and the flags and arguments that ask for it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagellm.config import EngineArgs
from pagellm.distributed.cpu_binding import numa_hint, numa_nodes, parse_cpu_list, split_cores
from pagellm.entrypoints.cli import build_parser, engine_args_from
from pagellm.layers.linear import head_shard
from pagellm.models.llama import allowed_tensor_parallel_sizes, check_tensor_parallel_size

SMOLLM2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
LLAMA_8B = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)


def test_allowed_sizes_split_heads_evenly_or_replicate_kv_heads_whole():
    assert allowed_tensor_parallel_sizes(SMOLLM2) == [1, 3]
    # 16 and 32 ranks replicate each of the 8 KV heads 2 and 4 times, as vLLM does.
    assert allowed_tensor_parallel_sizes(LLAMA_8B) == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*num_key_value_heads=3.*allowed sizes: \[1, 3\]"):
        check_tensor_parallel_size(SMOLLM2, 2)


def test_expert_features_must_split_evenly_unless_experts_are_placed_whole():
    # Qwen3-MoE-shaped: 96 intermediate features per expert, dense sizes that 1, 2, 4 or 8 ranks split.
    moe = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, intermediate_size=512, moe_intermediate_size=96)
    assert allowed_tensor_parallel_sizes(moe) == [1, 2, 4, 8]
    moe.moe_intermediate_size = 90
    assert allowed_tensor_parallel_sizes(moe) == [1, 2]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .*moe_intermediate_size=90.*allowed sizes: \[1, 2\]"
                                         r".*enable_expert_parallel"):
        check_tensor_parallel_size(moe, 4)
    assert allowed_tensor_parallel_sizes(moe, expert_parallel=True) == [1, 2, 4, 8]
    check_tensor_parallel_size(moe, 4, expert_parallel=True)


def test_head_shards_cover_every_head_and_map_queries_to_their_kv_head():
    for config in (SMOLLM2, LLAMA_8B):
        group_size = config.num_attention_heads // config.num_key_value_heads
        for size in allowed_tensor_parallel_sizes(config):
            shards = [head_shard(config.num_attention_heads, config.num_key_value_heads, rank, size) for rank in range(size)]
            assert sorted(q for s in shards for q in range(s.q_start, s.q_start + s.num_q)) == list(
                range(config.num_attention_heads))
            assert {kv for s in shards for kv in range(s.kv_start, s.kv_start + s.num_kv)} == set(
                range(config.num_key_value_heads))
            for s in shards:  # every query head of the rank reads a KV head the rank holds
                for q in range(s.q_start, s.q_start + s.num_q):
                    assert s.kv_start <= q // group_size < s.kv_start + s.num_kv


def test_cores_are_split_per_numa_node_when_ranks_divide_evenly(tmp_path):
    for node, cpus in enumerate(("0-3", "4-7")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    nodes = numa_nodes(tmp_path)
    assert nodes == [[0, 1, 2, 3], [4, 5, 6, 7]]
    allowed = set(range(8))
    assert split_cores(nodes, allowed, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_cores(nodes, allowed, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_cores(nodes, allowed, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]  # across nodes
    assert "--tensor-parallel-size 2" in numa_hint(3, nodes) and numa_hint(2, nodes) == ""
    assert split_cores([[0, 1]], {0, 1}, 3) == [[0], [1], [0]]  # more ranks than cores: shared
    assert parse_cpu_list("0-2,8,10-11") == [0, 1, 2, 8, 10, 11]


def test_serve_flags_reach_the_engine_arguments():
    args = build_parser().parse_args(["serve", "-tp", "4", "--nnodes", "2", "--master-addr", "10.0.0.1",
                                      "--master-port", "29500", "--distributed-timeout-seconds", "30"])
    engine_args = engine_args_from(args)
    assert (engine_args.tensor_parallel_size, engine_args.nnodes, engine_args.node_rank) == (4, 2, 0)
    assert (engine_args.master_addr, engine_args.master_port, engine_args.distributed_timeout_seconds) == (
        "10.0.0.1", 29500, 30.0)
    worker = build_parser().parse_args(["worker", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h",
                                        "--master-port", "1"])
    assert (worker.command, worker.node_rank) == ("worker", 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
    (dict(tensor_parallel_size=3, nnodes=2), "does not split evenly over nnodes=2"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=1), "pagellm worker"),
    (dict(tensor_parallel_size=2, nnodes=2, master_addr=""), "master_addr=''"),
    (dict(master_port=70000), "master_port=70000"),
    (dict(distributed_timeout_seconds=0), "distributed_timeout_seconds=0"),
])
def test_bad_parallel_arguments_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)
