"""How many threads the CPU kernels run on, and how their OpenMP threads wait, from what this process gets.

Threads: the CPUs of the affinity mask, capped by the cgroup's CPU quota (a container given 1.5 CPUs of a
64-core host runs 2 threads, not 64). More threads than the quota lets run at once only queue behind each other.

Waiting: between two of a step's many short parallel regions, libgomp's threads spin before they sleep. On
cores the process has to itself the spin is what makes a region cheap to start; where another process wants the
same cores, each spinning thread holds a core its partner needs, and every region waits for the thread that
was descheduled. libgomp's default spins ~300,000 iterations (milliseconds, a scheduler time slice). At
`import pagellm`, before torch loads libgomp (which reads the setting once), a 50 ms probe of /proc/stat sees
whether other processes keep this process's CPUs busy: if they do, pagellm sets a spin of a few microseconds
(GOMP_SPINCOUNT), which gives a busy neighbour's core back; on quiet CPUs it keeps libgomp's default, the faster
one alone (README, "Serving on a shared CPU"; benchmarks/contention.py measures both). A user's
OMP_WAIT_POLICY / GOMP_SPINCOUNT always wins.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Iterations of libgomp's spin-wait before a thread sleeps (its default without OMP_WAIT_POLICY: 300,000).
# Where benchmarks/contention.py found the best trade (README, "Serving on a shared CPU"): a few percent slower
# alone than the default's spin, and beside a busy process within 1.8x of alone where the default took ~2.8x.
BOUNDED_SPIN_COUNT = 1_000
# The probe at import: how long it watches the CPUs, and how busy other processes must keep them (in CPUs) for
# the bounded spin. On quiet cores libgomp's default spin is kept: it is the faster one alone.
PROBE_SECONDS = 0.05
SHARED_MIN_BUSY_CPUS = 0.5

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


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(idle, total) jiffies of each CPU in `cpus`, from /proc/stat (empty where it cannot be read)."""
    times: dict[int, tuple[int, int]] = {}
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                values = [int(v) for v in fields[:8]]
                times[int(name[3:])] = (values[3] + values[4], sum(values))  # idle + iowait
    except (OSError, ValueError):
        return {}
    return times


def busy_cpus_elsewhere(interval_s: float = PROBE_SECONDS) -> float:
    """How many of this process's CPUs other processes kept busy over `interval_s` (this one sleeps meanwhile)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    before = _cpu_times(cpus)
    time.sleep(interval_s)
    after = _cpu_times(cpus)
    busy = 0.0
    for cpu, (idle, total) in after.items():
        if cpu in before and total > before[cpu][1]:
            busy += 1.0 - (idle - before[cpu][0]) / (total - before[cpu][1])
    return busy


def configure_openmp_wait(environ: dict[str, str] | os._Environ = os.environ,
                          busy_cpus: float | None = None) -> str | None:
    """Unless the user chose a wait policy: GOMP_SPINCOUNT=BOUNDED_SPIN_COUNT where other processes keep at least
    half a CPU of this process's busy (`busy_cpus`, probed when None), libgomp's default spin otherwise. Returns
    what it set (None when it left the environment alone). Effective only before torch loads libgomp."""
    global _busy_at_start
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    _busy_at_start = busy_cpus_elsewhere() if busy_cpus is None else busy_cpus
    if _busy_at_start < SHARED_MIN_BUSY_CPUS:
        return None
    environ["GOMP_SPINCOUNT"] = str(BOUNDED_SPIN_COUNT)
    return environ["GOMP_SPINCOUNT"]


def openmp_wait_description(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """How libgomp's threads wait, for the start-up log."""
    if "OMP_WAIT_POLICY" in environ:
        return f"OMP_WAIT_POLICY={environ['OMP_WAIT_POLICY']}"
    busy = "" if _busy_at_start is None else f"; other processes kept {_busy_at_start:.1f} CPUs busy at start"
    if "GOMP_SPINCOUNT" in environ:
        bounded = environ["GOMP_SPINCOUNT"] == str(BOUNDED_SPIN_COUNT) and _configured_before_torch
        return f"GOMP_SPINCOUNT={environ['GOMP_SPINCOUNT']}" + (f" (pagellm's bounded spin{busy})" if bounded else "")
    return f"libgomp's default spin{busy}"


# Whether configure_openmp_wait set the spin before torch was imported (else libgomp already read its
# environment), and the probe's finding.
_configured_before_torch = False
_busy_at_start: float | None = None


def configure_at_import() -> None:
    global _configured_before_torch
    if "torch" not in sys.modules:
        _configured_before_torch = configure_openmp_wait() is not None
