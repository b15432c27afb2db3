"""`pagellm serve`'s OpenMP set-up: the wait policy it asks for, and releasing the loading thread's team."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pagellm.entrypoints import openmp
from tests.server.utils import REPO_ROOT


def test_the_server_waits_passively_unless_told_otherwise():
    environ: dict[str, str] = {}
    assert openmp.choose_wait_policy(environ, torch_loaded=False) == "PASSIVE"
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("variable, value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "30000")])
def test_a_wait_policy_the_user_set_is_kept(variable, value):
    environ = {variable: value}
    assert openmp.choose_wait_policy(environ, torch_loaded=False) is None
    assert environ == {variable: value}


def test_nothing_is_set_once_torch_is_loaded():
    # libgomp has read its variables by then: setting one would only claim an effect it cannot have.
    environ: dict[str, str] = {}
    assert openmp.choose_wait_policy(environ, torch_loaded=True) is None
    assert environ == {}


def test_releasing_the_team_ends_its_worker_threads():
    # In a process of its own: the test process's OpenMP teams are not this test's to end.
    script = textwrap.dedent("""
        import os, time
        import sentencepiece  # a dependency with a libgomp of its own, loaded first here: not the one to ask
        import torch
        from pagellm.entrypoints import openmp

        def threads():
            return len(os.listdir("/proc/self/task"))

        torch.set_num_threads(2)
        x = torch.randn(256, 256)
        x @ x  # a parallel region: this thread's team now has a worker
        with_team = threads()
        assert openmp.release_thread_team()
        deadline = time.monotonic() + 10
        while threads() >= with_team and time.monotonic() < deadline:
            time.sleep(0.01)
        released = threads()
        x @ x  # the next region starts a team again
        print(with_team, released, threads())
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    with_team, released, again = map(int, result.stdout.split())
    assert released == with_team - 1 and again == with_team


def test_without_libgomp_there_is_nothing_to_release(monkeypatch):
    monkeypatch.setattr(openmp, "loaded_libgomp", lambda: None)
    assert openmp.release_thread_team() is False
