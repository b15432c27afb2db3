"""Threads and OpenMP waiting from what the process gets (pagellm/cpu_threads.py): cgroup quotas in v1 and v2
layouts, the thread count they give, and the bounded spin set before torch loads libgomp unless the user chose."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagellm import cpu_threads
from pagellm.cpu_threads import BOUNDED_SPIN_COUNT, CpuShare, cgroup_cpu_quota, configure_openmp_wait


@pytest.fixture
def cgroup_root(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_threads, "_CGROUP_ROOT", tmp_path)
    return tmp_path


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_smallest_on_the_path(cgroup_root):
    _write(cgroup_root / "cpu.max", "max 100000\n")
    _write(cgroup_root / "kubepods" / "cpu.max", "300000 100000\n")
    _write(cgroup_root / "kubepods" / "pod1" / "cpu.max", "150000 100000\n")
    _write(cgroup_root / "kubepods" / "pod1" / "app" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota("0::/kubepods/pod1/app\n") == 1.5
    assert cgroup_cpu_quota("0::/kubepods\n") == 3.0
    assert cgroup_cpu_quota("0::/\n") is None


def test_cgroup_v1_quota_from_the_cpu_controller(cgroup_root):
    _write(cgroup_root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "50000\n")
    _write(cgroup_root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    _write(cgroup_root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    _write(cgroup_root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    proc = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n"
    assert cgroup_cpu_quota(proc) == 0.5
    # No quota anywhere, or no cgroup files at all (the machine's own cgroup, a bare container).
    assert cgroup_cpu_quota("4:cpu,cpuacct:/\n") is None
    assert cgroup_cpu_quota("0::/nowhere\n") is None
    assert cgroup_cpu_quota("garbage") is None


@pytest.mark.parametrize(("affinity", "quota", "threads"), [
    (2, None, 2), (64, 1.5, 2), (64, 0.5, 1), (4, 8.0, 4), (8, 2.0, 2), (8, 2.0000001, 3),
])
def test_threads_are_the_mask_capped_by_the_quota_rounded_up(affinity, quota, threads):
    share = CpuShare(affinity, quota)
    assert share.threads == threads
    assert f"{threads} threads" in share.describe()


def test_the_bounded_spin_is_set_only_on_busy_cpus_and_where_the_user_chose_nothing():
    environ: dict[str, str] = {}
    assert configure_openmp_wait(environ, busy_cpus=1.0) == str(BOUNDED_SPIN_COUNT)
    assert environ == {"GOMP_SPINCOUNT": str(BOUNDED_SPIN_COUNT)}
    environ = {}
    assert configure_openmp_wait(environ, busy_cpus=0.1) is None and environ == {}  # quiet: libgomp's default
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        environ = dict(chosen)
        assert configure_openmp_wait(environ, busy_cpus=2.0) is None
        assert environ == chosen


def test_the_probe_sees_a_busy_neighbour():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # The loop keeps one CPU busy from its first instant; the probe watches for 0.2 s.
        assert cpu_threads.busy_cpus_elsewhere(0.2) >= 0.7
    finally:
        busy.kill()
        busy.wait()


def _in_fresh_python(code: str, **environ: str) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(environ)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


PROBE = ("import sys, os; import pagellm; before = 'torch' in sys.modules; "
         "from pagellm.cpu_threads import openmp_wait_description as d; "
         "print(before, os.environ.get('GOMP_SPINCOUNT'), d(), sep='|')")


def test_import_pagellm_sets_the_spin_before_torch_loads_libgomp_beside_a_busy_process():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        before, spin, description = _in_fresh_python(PROBE).split("|")
    finally:
        busy.kill()
        busy.wait()
    assert (before, spin) == ("False", str(BOUNDED_SPIN_COUNT))
    assert description.startswith(f"GOMP_SPINCOUNT={BOUNDED_SPIN_COUNT} (pagellm's bounded spin; other processes kept")


def test_the_user_s_choice_and_a_late_import_are_left_alone():
    assert _in_fresh_python(PROBE, OMP_WAIT_POLICY="PASSIVE").split("|") == ["False", "None", "OMP_WAIT_POLICY=PASSIVE"]
    assert _in_fresh_python(PROBE, GOMP_SPINCOUNT="5").split("|") == ["False", "5", "GOMP_SPINCOUNT=5"]
    # torch first: libgomp has read its environment already, so pagellm neither probes nor sets anything.
    assert _in_fresh_python("import torch; " + PROBE).split("|") == ["True", "None", "libgomp's default spin"]
