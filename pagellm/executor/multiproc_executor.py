"""Tensor parallelism over processes: this process is rank 0 (the driver), the others are workers.

Each step the driver broadcasts the schedule, then every rank runs the same forward; the collectives
inside it keep them in lockstep, and rank 0 samples. A rank that dies, or a step that raises on any
rank, leaves the ranks out of step for good: the executor then fails (ExecutorDeadError) and stays
failed, and the engine reports itself dead rather than run on a broken group.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import subprocess
import threading
import time

import torch

from pagellm.config import EngineArgs
from pagellm.core.scheduler import ModelRunnerOutput, SchedulerOutput
from pagellm.distributed import launch
from pagellm.distributed.cpu_binding import numa_hint, numa_nodes
from pagellm.distributed.launch import LaunchSpec, RendezvousError, StepMessage
from pagellm.executor.model_worker import ModelWorker, pick_device

logger = logging.getLogger(__name__)


class ExecutorDeadError(RuntimeError):
    """A tensor-parallel rank is gone or the ranks fell out of step; no later step can run."""


class MultiprocExecutor:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._sampled: dict[str, int] = {}
        self._accepted: dict[str, list[int]] = {}
        self.processes: list[subprocess.Popen] = []
        self.group = None
        # master_addr:master_port is where other hosts' ranks meet this one; on one host, as in vLLM, the ranks
        # meet on a free port (so that engines side by side never collide on the default 29501).
        self.addr = args.master_addr if args.nnodes > 1 else "127.0.0.1"
        self.port = args.master_port if args.nnodes > 1 else launch.free_port(self.addr)
        spec = LaunchSpec(args, args.tensor_parallel_size, args.nnodes)
        device = pick_device(args.device)
        if device.type == "cuda":
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        self._saved_affinity = os.sched_getaffinity(0)
        self._saved_threads = torch.get_num_threads()
        shares = launch.local_core_shares(spec.ranks_per_node) if device.type == "cpu" else None
        self.store = launch.connect_store(self.addr, self.port, True, args.distributed_timeout_seconds)
        self.store.set(launch.LAUNCH_KEY, pickle.dumps(spec))
        atexit.register(self.shutdown)
        try:
            self.processes = launch.spawn_workers(self.addr, self.port, spec.node_ranks(0)[1:], 1, shares)
            launch.pin_to_cores(0, shares[0] if shares else None, len(self._saved_affinity))
            if shares:
                logger.info("tensor parallelism: %d ranks on this host share its cores as %s.%s",
                            spec.ranks_per_node, shares, numa_hint(spec.ranks_per_node, numa_nodes()))
            self._wait_until_local_workers_start(args.distributed_timeout_seconds)
            self.group = launch.join_group(self.store, 0, spec, device, self.addr, self.port)
            self.driver = ModelWorker(args, self.group, device, spec.ranks_per_node)
        except BaseException as exc:
            reason = self._worker_failure()
            # The other ranks may be inside a collective that rank 0 will never join: stop them, without asking.
            self.failure = reason or f"start-up failed on rank 0: {exc!r}"
            self.shutdown()
            if reason is not None and not isinstance(exc, ValueError):
                raise ExecutorDeadError(f"tensor-parallel start-up failed: {reason}") from exc
            raise
        self._watch = threading.Thread(target=self._watch_workers, name="pagellm-tp-watch", daemon=True)
        self._watch.start()

    # ---- steps -----------------------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.failure is None:
            self.failure = self._worker_failure()
        if self.failure is not None:
            raise ExecutorDeadError(self.failure)
        try:
            self.group.broadcast_object(StepMessage(scheduler_output, self._sampled, self._accepted))
            output = self.driver.runner.execute(scheduler_output)
        except Exception as exc:
            # Give a dying worker a moment to be reaped, so that the error names it rather than the socket.
            deadline = time.monotonic() + 2.0
            while self._worker_failure() is None and time.monotonic() < deadline and self.processes:
                time.sleep(0.02)
            self.failure = (self._worker_failure() or self._remote_failure()
                            or f"a tensor-parallel step failed on rank 0: {exc!r}")
            raise ExecutorDeadError(f"{self.failure}; the engine cannot go on.") from exc
        self._sampled, self._accepted = output.sampled_token_ids, output.spec_token_ids
        return output

    def prefault_kv_cache(self, seconds: float) -> bool:
        """The other ranks would have to be asked between steps: on tensor-parallel ranks, only the start-up share
        of the pool is faulted in ahead, the rest on first use."""
        return False

    # ---- liveness --------------------------------------------------------------------------------

    def _worker_failure(self) -> str | None:
        """Why a worker is gone (its exit, and the error it left on the store), or None if all run."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is None:
                continue
            how = (f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}")
            reported = self._reported_error(rank)
            reason = f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}"
            return f"{reason}: {reported}" if reported else reason
        return None

    def _remote_failure(self) -> str | None:
        """The error a rank on another host left on the store before it exited, if any."""
        for rank in range(len(self.processes) + 1, self.args.tensor_parallel_size):
            reported = self._reported_error(rank)
            if reported:
                return f"tensor-parallel worker rank {rank} (on another host) failed: {reported}"
        return None

    def _reported_error(self, rank: int) -> str | None:
        try:
            if self.store.check([launch.error_key(rank)]):
                return self.store.get(launch.error_key(rank)).decode()
        except Exception:  # noqa: BLE001 - the store is only a source of detail here
            pass
        return None

    def _watch_workers(self) -> None:
        """Notice a worker that dies while the engine is idle, so that health checks report it at once."""
        while not self._closed and self.failure is None:
            reason = self._worker_failure()
            if reason is not None and not self._closed:
                logger.error("%s; the engine cannot serve any more.", reason)
                self.failure = reason
                return
            time.sleep(0.2)

    def _wait_until_local_workers_start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        keys = [launch.ready_key(rank) for rank in range(1, len(self.processes) + 1)]
        while not self.store.check(keys):
            reason = self._worker_failure()
            if reason is not None:
                raise ExecutorDeadError(f"tensor-parallel start-up failed: {reason}")
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"the local tensor-parallel workers did not reach the rendezvous at {self.addr}:{self.port} "
                    f"within distributed_timeout_seconds={timeout_s:g}"
                )
            time.sleep(0.02)

    # ---- shutdown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker (asking first, then terminating), close the groups, give back the cores."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.group is not None and self.failure is None and self._worker_failure() is None:
            try:
                self.group.broadcast_object(None)
            except Exception:  # noqa: BLE001 - a worker that cannot hear it is terminated below
                pass
        # After a failure the workers may be stuck in a collective that will never complete: no grace.
        launch.stop_processes(self.processes, grace_s=0.0 if self.failure else 5.0)
        if self.group is not None:
            self.group.shutdown()
        os.sched_setaffinity(0, self._saved_affinity)
        torch.set_num_threads(self._saved_threads)
        atexit.unregister(self.shutdown)

