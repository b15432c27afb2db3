"""How many threads the CPU kernels run on, and how their OpenMP threads wait, from what this process gets.

Threads: the CPUs of the affinity mask, capped by the cgroup's CPU quota (a container given 1.5 CPUs of a
64-core host runs 2 threads, not 64). More threads than the quota lets run at once only queue behind each other.

Waiting: between two of a step's many short parallel regions, libgomp's threads spin before they sleep. On
cores the process has to itself the spin is what makes a region cheap to start; where another process wants the
same cores, each spinning thread holds a core its partner needs, and every region waits for the thread that
was descheduled. libgomp's default spins ~300,000 iterations (milliseconds, a scheduler time slice); pagellm
sets a spin bounded to tens of microseconds, which keeps a region's start cheap alone and gives a busy
neighbour's core back (README, "Serving on a shared CPU"; benchmarks/contention.py measures both). libgomp
reads the setting once, when torch loads it: `configure_openmp_wait` runs at `import pagellm`, before torch, and
leaves OMP_WAIT_POLICY / GOMP_SPINCOUNT alone where the user set either.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# Iterations of libgomp's spin-wait before a thread sleeps (its default without OMP_WAIT_POLICY: 300,000).
# The value where benchmarks/contention.py found the run alone as fast as with the default and the run beside a
# busy process near its fair share.
BOUNDED_SPIN_COUNT = 10_000

_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuShare:
    """The CPUs this process may use: its affinity mask, and the cgroup quota (None: no quota)."""

    affinity: int
    quota: float | None

    @property
    def threads(self) -> int:
        """Threads worth running: the mask's CPUs, at most the quota rounded up."""
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.ceil(self.quota - 1e-9)))

    def describe(self) -> str:
        if self.quota is None or self.threads == self.affinity and self.quota >= self.affinity:
            return f"{self.threads} threads (CPUs in the affinity mask)"
        return f"{self.threads} threads ({self.affinity} CPUs in the affinity mask, a cgroup quota of {self.quota:g})"


def _cgroup_paths(proc_cgroup: str) -> list[Path]:
    """The directories under /sys/fs/cgroup whose CPU quota applies to this process, innermost first: its own
    cgroup and every ancestor, in cgroup v2 (`0::/path`) and v1's cpu controller (`N:cpu,cpuacct:/path`)."""
    paths: list[Path] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, relative = parts
        if controllers == "":
            base = _CGROUP_ROOT
        elif "cpu" in controllers.split(","):
            base = _CGROUP_ROOT / controllers
            if not base.exists():
                base = _CGROUP_ROOT / "cpu"
        else:
            continue
        here = base / relative.lstrip("/")
        while True:
            paths.append(here)
            if here == base:
                break
            here = here.parent
    return paths


def _quota_of(directory: Path) -> float | None:
    """CPUs the cgroup at `directory` may use (quota / period), None where it sets no quota."""
    try:
        text = (directory / "cpu.max").read_text().split()  # v2: "max 100000" or "150000 100000"
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:  # v1
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cgroup_cpu_quota(proc_cgroup: str | None = None) -> float | None:
    """The smallest CPU quota among this process's cgroups, None where none sets one."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    quotas = [q for q in map(_quota_of, _cgroup_paths(proc_cgroup)) if q is not None]
    return min(quotas) if quotas else None


def cpu_share() -> CpuShare:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CpuShare(affinity, cgroup_cpu_quota())


def cpu_threads() -> int:
    """Threads for the CPU kernels of a single-rank engine."""
    return cpu_share().threads


def configure_openmp_wait(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """Sets GOMP_SPINCOUNT to BOUNDED_SPIN_COUNT unless the user chose a wait policy; returns what it set (None
    when it left the environment alone). Effective only before torch loads libgomp."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    environ["GOMP_SPINCOUNT"] = str(BOUNDED_SPIN_COUNT)
    return environ["GOMP_SPINCOUNT"]


def openmp_wait_description(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """How libgomp's threads wait, for the start-up log."""
    if "OMP_WAIT_POLICY" in environ:
        return f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']}"
    if "GOMP_SPINCOUNT" in environ:
        bounded = environ["GOMP_SPINCOUNT"] == str(BOUNDED_SPIN_COUNT) and _configured_before_torch
        return f"GOMP_SPINCOUNT={environ['GOMP_SPINCOUNT']}" + (" (pagellm's bounded spin)" if bounded else "")
    return "libgomp's default spin"


# Whether configure_openmp_wait ran before torch was imported (else libgomp already read its environment).
_configured_before_torch = False


def configure_at_import() -> None:
    global _configured_before_torch
    if "torch" not in sys.modules:
        _configured_before_torch = configure_openmp_wait() is not None
