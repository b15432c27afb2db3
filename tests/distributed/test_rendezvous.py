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
from tests.distributed.test_tensor_parallel import BATCH
from tests.distributed.test_tensor_parallel import ENGINE as TP_ENGINE
from tests.server.utils import REPO_ROOT, free_port

# The equality run of test_tensor_parallel.py (preempting, chunking, prefix-cache hits), here on 4 ranks over
# two "hosts", with the LM head split by vocabulary: greedy tokens and seeded n=3 samples must equal TP=1's.
ENGINE = {**TP_ENGINE, "max_model_len": 128}
GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = dict(n=3, temperature=0.9, top_p=0.95, seed=7, max_tokens=6, ignore_eos=True)

# The driver: rank 0 of 4, two ranks per node. It prints its outputs and its local worker's pid, waits for
# a line on stdin, then exits without shutting the engine down (the interpreter's exit must do it).
DRIVER = textwrap.dedent("""
    import json, sys
    from pagellm import LLM, SamplingParams
    from tests.distributed.test_rendezvous import outputs
    model, port, engine, prompts, greedy, sampled = sys.argv[1:]
    llm = LLM(model, tensor_parallel_size=4, nnodes=2, node_rank=0, master_addr="127.0.0.1",
              master_port=int(port), **json.loads(engine))
    print(json.dumps({**outputs(llm, json.loads(prompts), SamplingParams(**json.loads(greedy)),
                                SamplingParams(**json.loads(sampled))),
                      "preemptions": llm.llm_engine.get_stats().num_preemptions,
                      "workers": [p.pid for p in llm.llm_engine.core.executor.processes]}), flush=True)
    sys.stdin.readline()
""")


def outputs(llm, prompts, greedy, sampled) -> dict:
    return {"greedy": [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)],
            "sampled": [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[:2], sampled, use_tqdm=False)]}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def _pagellm_worker(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pagellm.entrypoints.cli", "worker", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]


def test_two_groups_meet_only_through_the_store(tiny_4kv_dir):
    reference = LLM(tiny_4kv_dir, **ENGINE)
    expected = outputs(reference, BATCH, SamplingParams(**GREEDY), SamplingParams(**SAMPLED))
    assert reference.llm_engine.get_stats().num_preemptions > 0
    port = free_port()
    env = {**_env(), "PAGELLM_TP_LM_HEAD": "vocab_parallel"}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, tiny_4kv_dir, str(port), json.dumps(ENGINE), json.dumps(BATCH),
         json.dumps(GREEDY), json.dumps(SAMPLED)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    node = subprocess.Popen(_pagellm_worker(port, "--distributed-timeout-seconds", "120"), env=env)
    try:
        line = driver.stdout.readline()
        assert line, f"the driver exited with {driver.wait()} before printing its tokens"
        result = json.loads(line)
        assert result["greedy"] == expected["greedy"]
        assert result["sampled"] == expected["sampled"]
        assert result["preemptions"] > 0
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
            **{**ENGINE, "distributed_timeout_seconds": 1})


def test_worker_without_a_driver_fails_naming_the_address():
    port = free_port()
    result = subprocess.run(_pagellm_worker(port, "--distributed-timeout-seconds", "1"), env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "distributed_timeout_seconds=1" in result.stderr
