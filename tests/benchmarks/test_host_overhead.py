"""benchmarks/host_overhead.py runs the engine loop and prints one row of stage timings per size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_overhead_prints_every_stage_per_size():
    command = [sys.executable, "benchmarks/host_overhead.py", "--sizes", "2", "3", "--input-len", "20", "--steps", "2",
               "--repeats", "1", "--warmup", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["sequences"] for row in rows] == [2, 3]
    for row in rows:
        # Each stage that does work every step was timed (residual stages can round to either side of 0).
        for stage in ("scheduler", "runner prep", "forward+sample", "scheduler update", "output"):
            assert row[stage] > 0, (stage, row)
        assert {"runner rest", "other"} <= set(row)
        assert row["host total"] > 0 and row["step"] >= row["host total"]
    assert "| sequences | scheduler |" in result.stdout
