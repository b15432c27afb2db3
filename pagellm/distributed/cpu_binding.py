"""Which cores each tensor-parallel rank on a host runs on. Imports no torch.

Ranks on one host would otherwise each start as many threads as there are cores and fight over them.
Each rank gets its own share of the cores this process may use; where the host has several NUMA
nodes and the ranks divide evenly between them, each rank's share lies within one node (vLLM's CPU
backend scales the same way: one rank per node, its memory local).
"""

from __future__ import annotations

import os
from pathlib import Path

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes(root: Path = NODE_ROOT) -> list[list[int]]:
    """The CPUs of each NUMA node with any; one node holding every core where the system says nothing."""
    nodes = []
    for node in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpu_list((node / "cpulist").read_text())
        except OSError:
            continue
        if cpus:
            nodes.append(cpus)
    return nodes or [sorted(os.sched_getaffinity(0))]


def split_cores(nodes: list[list[int]], allowed: set[int], num_ranks: int) -> list[list[int]]:
    """The cores of each of `num_ranks` local ranks, from the `allowed` ones.

    With as many ranks as NUMA nodes (or a multiple), each node's cores go to its own ranks; otherwise
    the allowed cores are dealt out in order. With fewer cores than ranks, ranks share cores round-robin
    (one core each), which works but gains nothing.
    """
    nodes = [[c for c in node if c in allowed] for node in nodes]
    nodes = [node for node in nodes if node]
    if len(nodes) > 1 and num_ranks % len(nodes) == 0 and all(len(n) >= num_ranks // len(nodes) for n in nodes):
        per_node = num_ranks // len(nodes)
        return [share for node in nodes for share in _deal(node, per_node)]
    cores = sorted(allowed)
    if len(cores) < num_ranks:
        return [[cores[i % len(cores)]] for i in range(num_ranks)]
    return _deal(cores, num_ranks)


def _deal(cores: list[int], num_ranks: int) -> list[list[int]]:
    """Contiguous shares, as equal as the count allows (the first ones get the extra cores)."""
    base, extra = divmod(len(cores), num_ranks)
    shares, start = [], 0
    for i in range(num_ranks):
        size = base + (1 if i < extra else 0)
        shares.append(cores[start : start + size])
        start += size
    return shares


def numa_hint(num_ranks: int, nodes: list[list[int]]) -> str:
    """A line for the start-up log suggesting one rank per NUMA node where that is not the split in use."""
    if len(nodes) > 1 and num_ranks % len(nodes) != 0:
        return (f" This host has {len(nodes)} NUMA nodes: --tensor-parallel-size {len(nodes)} (or a multiple) "
                "puts each rank on one node.")
    return ""
