"""Across hosts: two groups of processes on 127.0.0.1 that meet only through the rendezvous store (the
driver's `LLM(..., nnodes=2)` and `pagellm worker --node-rank 1`), and rendezvous that cannot complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagellm import LLM, SamplingParams
from pagellm.distributed.launch import RendezvousError
from tests.distributed.conftest import children_of, is_running
from tests.helpers import PROMPTS
from tests.server.utils import REPO_ROOT, free_port

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)

# The driver: rank 0 of 4, two ranks per node. It prints its tokens and its local worker's pid, waits for
# a line on stdin, then exits without shutting the engine down (the interpreter's exit must do it).
DRIVER = textwrap.dedent("""
    import json, sys
    from pagellm import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=4, nnodes=2, node_rank=0, master_addr="127.0.0.1",
              master_port=int(sys.argv[2]), distributed_timeout_seconds=120, **json.loads(sys.argv[3]))
    outputs = llm.generate(json.loads(sys.argv[4]), SamplingParams(**json.loads(sys.argv[5])), use_tqdm=False)
    workers = [p.pid for p in llm.llm_engine.core.executor.processes]
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outputs], "workers": workers}), flush=True)
    sys.stdin.readline()
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def _pagellm_worker(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pagellm.entrypoints.cli", "worker", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]


def test_two_groups_meet_only_through_the_store(tiny_4kv_dir):
    prompts = PROMPTS[:3]
    expected = [o.outputs[0].token_ids
                for o in LLM(tiny_4kv_dir, **ENGINE).generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)]
    port = free_port()
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, tiny_4kv_dir, str(port), json.dumps(ENGINE), json.dumps(prompts),
         json.dumps(GREEDY)],
        env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    node = subprocess.Popen(_pagellm_worker(port, "--distributed-timeout-seconds", "120"), env=_env())
    try:
        line = driver.stdout.readline()
        assert line, f"the driver exited with {driver.wait()} before printing its tokens"
        result = json.loads(line)
        assert result["tokens"] == expected
        node_ranks = children_of(node.pid)
        assert len(node_ranks) == 2 and len(result["workers"]) == 1
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert driver.wait(60) == 0
        assert node.wait(60) == 0, "the worker node exits once the driver has gone"
        for pid in result["workers"] + node_ranks:
            assert not is_running(pid), f"process {pid} outlived the engine"
    finally:
        for process in (driver, node):
            if process.poll() is None:
                process.kill()
                process.wait()


def test_driver_rendezvous_times_out_naming_the_address(tiny_4kv_dir):
    port = free_port()
    with pytest.raises(RendezvousError, match=rf"127\.0\.0\.1:{port}.*distributed_timeout_seconds=1\b"):
        LLM(tiny_4kv_dir, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port,
            distributed_timeout_seconds=1, **ENGINE)


def test_worker_without_a_driver_fails_naming_the_address():
    port = free_port()
    result = subprocess.run(_pagellm_worker(port, "--distributed-timeout-seconds", "1"), env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "distributed_timeout_seconds=1" in result.stderr
