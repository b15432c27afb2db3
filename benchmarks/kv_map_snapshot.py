"""The cost of one /kv snapshot (pagellm/core/block_map.py) and of encoding it as /kv/state's JSON.

A pool of --num-blocks blocks is filled to --fill with requests of --blocks-per-request blocks, every
fourth of them forked once (sharing its blocks), through the real scheduler's KV-cache manager; then the
snapshot is taken --repeat times on the engine's side and encoded on the route's side.

    .venv/bin/python benchmarks/kv_map_snapshot.py --num-blocks 5825
    .venv/bin/python benchmarks/kv_map_snapshot.py --num-blocks 100000
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagellm.core.block_map import take_block_map
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.entrypoints.kv_map import state_dict
from pagellm.sampling_params import SamplingParams

BLOCK_SIZE = 16


def filled_scheduler(num_blocks: int, fill: float, blocks_per_request: int) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(8192, 1024, 1 << 20), KVCacheManager(num_blocks, BLOCK_SIZE))
    params = SamplingParams(max_tokens=1)
    index = 0
    while scheduler.kv.pool.num_used_blocks + blocks_per_request <= fill * num_blocks:
        request_id = f"req-{index}"
        tokens = blocks_per_request * BLOCK_SIZE - BLOCK_SIZE // 2
        request = Request(request_id, list(range(tokens)), params, index, 1)
        scheduler.add_request(request)
        scheduler.kv.allocate_slots(request_id, tokens, account=request.kv_account)
        if index % 4 == 0:
            scheduler.fork_request(request_id, f"{request_id}#1")  # waiting parent: the child waits too
            scheduler.kv.fork(request_id, f"{request_id}#1")
        index += 1
    return scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=5825)
    parser.add_argument("--fill", type=float, default=0.9, help="fraction of the pool in use")
    parser.add_argument("--blocks-per-request", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    scheduler = filled_scheduler(args.num_blocks, args.fill, args.blocks_per_request)
    snapshot_ms, encode_ms = [], []
    for _ in range(args.repeat):
        started = time.perf_counter()
        snapshot = take_block_map(scheduler)
        snapshot_ms.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        state_dict(snapshot)
        encode_ms.append((time.perf_counter() - started) * 1e3)
    stats = scheduler.kv.stats()
    from pagellm.cpu_features import cpu_description

    print(f"CPU: {cpu_description()}")
    print(f"pool {args.num_blocks} blocks, {stats.num_used_blocks} in use ({stats.num_shared_blocks} shared), "
          f"{len(snapshot.owner_ids)} requests")
    print(f"snapshot (engine thread): median {statistics.median(snapshot_ms):.3f} ms, max {max(snapshot_ms):.3f} ms")
    print(f"encode (route, once per snapshot): median {statistics.median(encode_ms):.3f} ms")


if __name__ == "__main__":
    main()
