"""Where the model runs: in the engine process (one rank) or on tensor-parallel ranks in several processes.

Both executors offer the same few calls to EngineCore: `driver` (rank 0's ModelWorker, in this process),
`execute(scheduler_output)`, `prefault_kv_cache(seconds)` (idle time: fault in more of the CPU KV pool; False
once there is nothing more to do), `failure` (why the ranks can no longer run, or None) and `shutdown()`.
"""

from __future__ import annotations

from pagellm.config import EngineArgs
from pagellm.executor.model_worker import ModelWorker
from pagellm.executor.multiproc_executor import ExecutorDeadError, MultiprocExecutor
from pagellm.core.scheduler import ModelRunnerOutput, SchedulerOutput


class UniprocExecutor:
    def __init__(self, args: EngineArgs) -> None:
        self.driver = ModelWorker(args)
        self.failure: str | None = None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.runner.execute(scheduler_output)

    def prefault_kv_cache(self, seconds: float) -> bool:
        prefaulter = self.driver.kv_prefaulter
        return prefaulter is not None and prefaulter.advance(seconds)

    def shutdown(self) -> None:
        pass


def create_executor(args: EngineArgs) -> UniprocExecutor | MultiprocExecutor:
    if args.tensor_parallel_size == 1:
        return UniprocExecutor(args)
    return MultiprocExecutor(args)


__all__ = ["ExecutorDeadError", "MultiprocExecutor", "UniprocExecutor", "create_executor"]
