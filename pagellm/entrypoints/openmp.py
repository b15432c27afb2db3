"""The server's OpenMP thread teams: one, so that libgomp waits between torch's parallel regions as it should.

torch runs a CPU kernel on the OpenMP (libgomp) thread team of the thread that calls it, and each calling
thread gets a team of its own. `pagellm serve` loads the model on its main thread and steps it on the engine
thread: two teams. While libgomp manages more threads than the process has CPUs, it cuts its spin-wait to
about a hundred iterations, so the server waited passively by accident, whatever OMP_WAIT_POLICY said, and
with OMP_WAIT_POLICY=ACTIVE the main thread's idle worker spun on a core of its own for good.

Releasing the loading thread's team once the model is loaded leaves one team, so the server waits as the
offline engine does: libgomp's default (spin for a while, then sleep), or what OMP_WAIT_POLICY / GOMP_SPINCOUNT
say. On cores the server has to itself, spinning is what keeps a step's many short parallel regions cheap;
where other processes share the cores, a spinning thread holds a core its partner needs, and
OMP_WAIT_POLICY=PASSIVE holds up better (README, "Serving on a shared CPU").
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# OpenMP 5.0's omp_pause_hard: free the calling thread's team (libgomp treats soft and hard alike on the host).
_OMP_PAUSE_HARD = 2


def loaded_libgomp() -> Path | None:
    """The libgomp that torch runs its kernels on, as this process loaded it; None when torch has not loaded
    one. Other packages bring copies of their own (sentencepiece does): torch's is the one in its package
    (torch/lib, or torch.libs beside it), or else the only one loaded."""
    try:
        with open("/proc/self/maps") as maps:
            loaded = sorted({Path(line.split()[-1]) for line in maps if "/libgomp" in line})
    except OSError:
        return None
    import torch

    package = Path(torch.__file__).resolve().parent
    for path in loaded:
        if path.resolve().parent in (package / "lib", package.parent / "torch.libs"):
            return path
    return loaded[0] if len(loaded) == 1 else None


def release_thread_team() -> bool:
    """Ends the OpenMP worker threads that the calling thread's parallel regions started; a later region on
    this thread starts them again. True when there was a libgomp to ask."""
    path = loaded_libgomp()
    if path is None:
        return False
    # dlopen of a path already loaded returns that library, not a second copy.
    pause = ctypes.CDLL(str(path)).omp_pause_resource_all
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    if pause(_OMP_PAUSE_HARD) != 0:
        logger.warning("libgomp refused to release the loading thread's OpenMP team; the server's OpenMP threads "
                       "may wait passively whatever OMP_WAIT_POLICY says, and steps take longer.")
        return False
    return True
