"""The entry point of one tensor-parallel worker process: `python -m pagellm.distributed.worker_process`.

Started by the driver (`launch.spawn_workers`) or by `pagellm worker` on another host. It joins the
rendezvous, loads its shard, sizes its pool with the others, then runs whatever step the driver
broadcasts until told to stop. Nothing imports this module, so running it with -m executes it once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from pagellm.distributed.launch import (
    LaunchSpec,
    connect_store,
    error_key,
    join_group,
    pin_to_cores,
    read_spec,
    ready_key,
)
from pagellm.executor.model_worker import ModelWorker, pick_device

logger = logging.getLogger("pagellm.distributed.worker")
# How long a started worker waits for the driver's store and arguments (the driver starts it after both exist).
_SPEC_TIMEOUT_S = 60.0


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pagellm-parent-watch", daemon=True).start()


def worker_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one tensor-parallel worker rank (started by the driver)")
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--cores", default=None)
    options = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    rank = options.rank
    store = None
    try:
        cores = [int(c) for c in options.cores.split(",")] if options.cores else None
        pin_to_cores(rank, cores, len(os.sched_getaffinity(0)))
        store = connect_store(options.master_addr, options.master_port, False, _SPEC_TIMEOUT_S)
        spec = read_spec(store, options.master_addr, options.master_port, _SPEC_TIMEOUT_S)
        _serve(store, rank, options.local_rank, spec, options.master_addr, options.master_port)
    except BaseException as exc:  # noqa: BLE001 - the driver must learn why this rank is gone
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        if store is not None:
            try:
                store.set(error_key(rank), f"{type(exc).__name__}: {exc}"[:2000])
            except (RuntimeError, dist.DistError):
                pass
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _serve(store: dist.Store, rank: int, local_rank: int, spec: LaunchSpec, addr: str, port: int) -> None:
    device = pick_device(spec.args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    store.set(ready_key(rank), b"1")
    group = join_group(store, rank, spec, device, addr, port)
    worker = ModelWorker(spec.args, group, device, spec.ranks_per_node)
    logger.info("tensor-parallel rank %d of %d ready (%d KV blocks)", rank, spec.world_size, worker.num_blocks)
    while True:
        message = group.broadcast_object()
        if message is None:
            break
        worker.runner.append_sampled_tokens(message.sampled_token_ids, message.accepted_draft_ids)
        worker.runner.execute(message.scheduler_output)
    group.shutdown()


if __name__ == "__main__":
    worker_main()
