"""`pagellm serve`'s OpenMP set-up: releasing the loading thread's team, so that one team is left."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from pagellm.entrypoints import openmp
from tests.server.utils import REPO_ROOT


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
