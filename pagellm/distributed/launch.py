"""Starting tensor-parallel ranks and bringing them together.

Every rank meets the others on one TCP store, hosted by the driver (rank 0, the engine process) at
master_addr:master_port. The driver publishes the engine's arguments there; a worker needs nothing but
that address and its rank. Ranks on the driver's host are started by the driver (`spawn_workers`);
ranks on other hosts by `pagellm worker` there (`run_node`), which learns the rest from the store.

A worker process ignores Ctrl-C (the driver, which gets it too, shuts it down in order) and exits on
its own when its parent goes away or a collective fails, so that nothing outlives the engine.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pagellm.child_process import child_environment
from pagellm.config import EngineArgs
from pagellm.distributed.cpu_binding import numa_nodes, split_cores
from pagellm.distributed.parallel_state import TensorParallelGroup, build_group

logger = logging.getLogger(__name__)

LAUNCH_KEY = "pagellm/launch"
# A worker waits here between steps for as long as the engine is idle.
IDLE_TIMEOUT = timedelta(days=365)


class RendezvousError(RuntimeError):
    """The ranks could not all meet at the rendezvous address within the timeout."""


@dataclass(frozen=True)
class LaunchSpec:
    """What the driver publishes on the store for every other rank."""

    args: EngineArgs
    world_size: int
    nnodes: int

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node_rank: int) -> range:
        return range(node_rank * self.ranks_per_node, (node_rank + 1) * self.ranks_per_node)


@dataclass(frozen=True)
class StepMessage:
    """The driver's per-step broadcast: the schedule, and the tokens it sampled last step (which the
    other ranks append to their copies of the sequences, as rank 0's runner did)."""

    scheduler_output: object
    sampled_token_ids: dict[str, int]
    # The drafts rank 0 accepted after each sampled token (speculative decoding).
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def connect_store(addr: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(addr, port, is_master=is_master, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False, use_libuv=True)
    except (RuntimeError, dist.DistError) as exc:
        action = "host" if is_master else "reach"
        raise RendezvousError(
            f"could not {action} the tensor-parallel rendezvous at {addr}:{port} within "
            f"distributed_timeout_seconds={timeout_s:g} ({exc}); check --master-addr/--master-port "
            "(and that the driver, `pagellm serve ... --node-rank 0`, is running), or raise the timeout."
        ) from exc


def join_group(store: dist.Store, rank: int, spec: LaunchSpec, device: torch.device, addr: str,
               port: int) -> TensorParallelGroup:
    timeout = timedelta(seconds=spec.args.distributed_timeout_seconds)
    try:
        return build_group(store, rank, spec.world_size, device, timeout, IDLE_TIMEOUT,
                           spec.args.enable_expert_parallel)
    except (RuntimeError, dist.DistError) as exc:
        hint = ""
        if spec.nnodes > 1:
            hint = (f"; every other node must run `pagellm worker --nnodes {spec.nnodes} --node-rank K "
                    f"--master-addr {addr} --master-port {port}`")
        raise RendezvousError(
            f"the tensor-parallel rendezvous at {addr}:{port} did not complete: not all {spec.world_size} ranks "
            f"joined within distributed_timeout_seconds={spec.args.distributed_timeout_seconds:g}{hint} ({exc})"
        ) from exc


def pin_to_cores(rank: int, cores: list[int] | None, num_cores_allowed: int) -> None:
    """Run this process's threads on `cores` only, one torch thread per core; log what was done."""
    if cores is None:
        return
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    logger.info("tensor-parallel rank %d: pinned to cores %s of the %d this host allows, %d torch threads",
                rank, cores, num_cores_allowed, len(cores))


def local_core_shares(ranks_on_host: int) -> list[list[int]]:
    return split_cores(numa_nodes(), set(os.sched_getaffinity(0)), ranks_on_host)


# ---- starting workers --------------------------------------------------------------------------


def spawn_workers(addr: str, port: int, ranks: range, first_local: int, shares: list[list[int]] | None,
                  ) -> list[subprocess.Popen]:
    """Start one process per rank in `ranks` on this host (a fresh interpreter: `python -m` this module,
    so that nothing of the caller's __main__ runs again in it)."""
    env = child_environment()
    processes = []
    for local, rank in enumerate(ranks, start=first_local):
        command = [sys.executable, "-m", "pagellm.distributed.worker_process", "--master-addr", addr,
                   "--master-port", str(port), "--rank", str(rank), "--local-rank", str(local)]
        if shares is not None:
            command += ["--cores", ",".join(map(str, shares[local]))]
        processes.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL))
    return processes


def run_node(node_rank: int, nnodes: int, addr: str, port: int, timeout_s: float) -> int:
    """`pagellm worker`: start this node's ranks and wait for them; returns the exit status."""
    store = connect_store(addr, port, False, timeout_s)
    spec = read_spec(store, addr, port, timeout_s)
    if spec.nnodes != nnodes:
        raise ValueError(f"--nnodes {nnodes} disagrees with the driver's --nnodes {spec.nnodes}; use the same value.")
    if not 0 < node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is out of range for a worker node; allowed: 1..{nnodes - 1} "
                         "(node 0 is the driver, `pagellm serve`).")
    ranks = spec.node_ranks(node_rank)
    shares = local_core_shares(len(ranks)) if not torch.cuda.is_available() else None
    processes = spawn_workers(addr, port, ranks, 0, shares)
    logger.info("node %d: started tensor-parallel ranks %d..%d (pids %s)", node_rank, ranks.start, ranks.stop - 1,
                [p.pid for p in processes])
    previous = signal.signal(signal.SIGTERM, lambda *_: stop_processes(processes))
    try:
        return max(p.wait() for p in processes)
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_processes(processes)


def stop_processes(processes: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Wait up to `grace_s` for each process to exit, then terminate, then kill."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.terminate()
    for process in processes:
        try:
            process.wait(2.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def read_spec(store: dist.Store, addr: str, port: int, timeout_s: float) -> LaunchSpec:
    try:
        return pickle.loads(store.get(LAUNCH_KEY))
    except (RuntimeError, dist.DistError) as exc:
        raise RendezvousError(
            f"the driver at {addr}:{port} published no engine arguments within distributed_timeout_seconds="
            f"{timeout_s:g} ({exc})"
        ) from exc


# ---- a worker process ----------------------------------------------------------------------------


def error_key(rank: int) -> str:
    return f"pagellm/error/{rank}"


def ready_key(rank: int) -> str:
    return f"pagellm/ready/{rank}"
