"""KV-cache memory: paged blocks against contiguous per-request reservation, on the benchmark workload.

For block sizes 8, 16 and 32 the whole workload (everything submitted at once, EOS ignored) runs through
pagellm's real scheduler and KV-cache manager, recording after every schedule() the blocks in use, the
token slots they hold filled, and the running requests. At the peak (the step with the most blocks in
use) it reports:

  paged waste                    1 - tokens stored / slots in allocated blocks (the half-empty last block
                                 of each sequence, nothing else);
  contiguous waste, max_model_len  1 - tokens stored / (running requests x max_model_len): every request
                                 reserves max_model_len slots up front, as a contiguous-KV server must when
                                 it cannot know the output length;
  contiguous waste, exact        the same when each request reserves exactly prompt + max_tokens (a
                                 best case that still holds the future tokens' slots from the start).

and how many of the workload's requests fit in one fixed KV budget at once each way (requests taken in
order, cycling through the workload, each at its final length: the paged scheme's worst moment).

Two ways to run the scheduler:
  --simulate (default)  a fake model runner that samples a fixed token: fast, and exact for accounting,
                        since with EOS ignored and no hits on random prompts the schedule does not depend
                        on which tokens the model produces;
  --engine              the real engine on the model (minutes on CPU). Both together cross-check.

    .venv/bin/python benchmarks/memory.py                       # simulated, default model's shapes
    .venv/bin/python benchmarks/memory.py --engine --simulate   # both, compared
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file (python benchmarks/memory.py): make the `benchmarks` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import (
    Workload,
    WorkloadSpec,
    add_workload_arguments,
    format_table,
    generate_workload,
    load_tokenizer,
    sampleable_token_ids,
)
from pagellm.core.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.request import Request
from pagellm.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput
from pagellm.sampling_params import SamplingParams

DEFAULT_BLOCK_SIZES = (8, 16, 32)
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # the engine's CPU default
# Any id does: EOS is ignored, so the token a fake runner samples never stops a request.
FAKE_TOKEN_ID = 0


# ---- recording the KV cache -------------------------------------------------------------------------


@dataclass(frozen=True)
class KVSnapshot:
    """The KV cache right after one schedule(): its slots are allocated for the tokens this step writes."""

    step: int
    num_running: int
    num_used_blocks: int
    block_size: int
    num_stored_tokens: int
    # What the running requests would hold had each reserved prompt + max_tokens up front.
    exact_reserved_tokens: int

    @property
    def allocated_slots(self) -> int:
        return self.num_used_blocks * self.block_size

    @property
    def paged_waste(self) -> float:
        return 0.0 if self.allocated_slots == 0 else 1 - self.num_stored_tokens / self.allocated_slots

    def contiguous_waste(self, max_model_len: int) -> float:
        reserved = self.num_running * max_model_len
        return 0.0 if reserved == 0 else 1 - self.num_stored_tokens / reserved

    @property
    def exact_reservation_waste(self) -> float:
        return 0.0 if self.exact_reserved_tokens == 0 else 1 - self.num_stored_tokens / self.exact_reserved_tokens


class KVTrace:
    """Wraps a scheduler's schedule() on that one instance, snapshotting the KV cache after each call."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.snapshots: list[KVSnapshot] = []
        self._scheduler = scheduler
        self._schedule = scheduler.schedule
        scheduler.schedule = self._schedule_and_record

    def _schedule_and_record(self) -> SchedulerOutput:
        output = self._schedule()
        stats = self._scheduler.kv.stats()
        running = self._scheduler.running
        self.snapshots.append(KVSnapshot(
            step=len(self.snapshots),
            num_running=len(running),
            num_used_blocks=stats.num_used_blocks,
            block_size=stats.block_size,
            num_stored_tokens=stats.num_stored_tokens,
            exact_reserved_tokens=sum(r.num_prompt_tokens + r.max_output_tokens for r in running),
        ))
        return output

    @property
    def peak(self) -> KVSnapshot:
        """The first step with the most blocks in use."""
        return max(self.snapshots, key=lambda s: s.num_used_blocks)


@dataclass(frozen=True)
class RunResult:
    mode: str
    block_size: int
    num_blocks: int
    max_model_len: int
    peak: KVSnapshot
    max_running: int
    num_steps: int
    num_preemptions: int
    trace: list[KVSnapshot]

    def as_json(self) -> dict:
        peak = self.peak
        return {
            "mode": self.mode, "block_size": self.block_size, "num_blocks": self.num_blocks,
            "max_model_len": self.max_model_len, "peak_step": peak.step, "peak_running": peak.num_running,
            "peak_used_blocks": peak.num_used_blocks, "peak_allocated_slots": peak.allocated_slots,
            "peak_stored_tokens": peak.num_stored_tokens, "paged_waste": round(peak.paged_waste, 6),
            "contiguous_max_model_len_waste": round(peak.contiguous_waste(self.max_model_len), 6),
            "contiguous_exact_waste": round(peak.exact_reservation_waste, 6),
            "max_running": self.max_running, "num_steps": self.num_steps, "num_preemptions": self.num_preemptions,
        }


def _result(mode: str, trace: KVTrace, scheduler: Scheduler, num_blocks: int, max_model_len: int) -> RunResult:
    return RunResult(
        mode=mode,
        block_size=scheduler.kv.block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        peak=trace.peak,
        max_running=max(s.num_running for s in trace.snapshots),
        num_steps=len(trace.snapshots),
        num_preemptions=scheduler.num_preemptions,
        trace=trace.snapshots,
    )


@dataclass(frozen=True)
class SchedulerKnobs:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS


def greedy_ignore_eos(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


# ---- simulated: the real core, a fake runner ---------------------------------------------------------


def fake_runner_output(scheduler: Scheduler, output: SchedulerOutput) -> ModelRunnerOutput:
    """A token for every request whose scheduled tokens reach the end of its sequence, as the runner does."""
    sampled = {}
    for request_id, num_tokens in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        if request.num_computed_tokens + num_tokens >= request.num_tokens:
            sampled[request_id] = FAKE_TOKEN_ID
    return ModelRunnerOutput(sampled_token_ids=sampled)


def simulate(workload: Workload, block_size: int, num_blocks: int, max_model_len: int,
             knobs: SchedulerKnobs, enable_prefix_caching: bool = True) -> RunResult:
    config = SchedulerConfig(knobs.max_num_batched_tokens, knobs.max_num_seqs, max_model_len)
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching))
    for index, item in enumerate(workload.requests):
        scheduler.add_request(Request(
            request_id=str(index),
            prompt_token_ids=list(item.prompt_token_ids),
            sampling_params=greedy_ignore_eos(item.output_len),
            arrival_index=index,
            max_output_tokens=item.output_len,
        ))
    trace = KVTrace(scheduler)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        if output.is_empty:
            raise RuntimeError(f"the scheduler could schedule nothing although requests wait: {scheduler.get_stats()}")
        scheduler.update_from_output(output, fake_runner_output(scheduler, output))
    return _result("simulate", trace, scheduler, num_blocks, max_model_len)


# ---- the real engine ---------------------------------------------------------------------------------


def run_engine(workload: Workload, block_size: int, num_blocks: int, max_model_len: int, knobs: SchedulerKnobs,
               model: str | None, dtype: str) -> RunResult:
    from pagellm.config import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(
        model=model, dtype=dtype, block_size=block_size, num_gpu_blocks_override=num_blocks,
        max_model_len=max_model_len, max_num_seqs=knobs.max_num_seqs,
        max_num_batched_tokens=knobs.max_num_batched_tokens,
    ))
    scheduler = engine.core.scheduler
    trace = KVTrace(scheduler)
    for index, item in enumerate(workload.requests):
        engine.add_request(str(index), {"prompt_token_ids": item.prompt_token_ids}, greedy_ignore_eos(item.output_len))
    while engine.has_unfinished_requests():
        engine.step()
    result = _result("engine", trace, scheduler, num_blocks, max_model_len)
    del engine, scheduler, trace
    gc.collect()  # the pool goes before the next block size allocates its own
    return result


# ---- how many requests fit at once ----------------------------------------------------------------


def requests_that_fit(footprints: Sequence[int], capacity: int) -> int:
    """How many requests fit in `capacity` units, taken in order and cycling through `footprints`."""
    if not footprints or min(footprints) < 1:
        raise ValueError("footprints must be a non-empty list of positive sizes")
    cycle = sum(footprints)
    count = (capacity // cycle) * len(footprints)
    left = capacity % cycle
    for footprint in footprints:
        if footprint > left:
            break
        left -= footprint
        count += 1
    return count


@dataclass(frozen=True)
class FitRow:
    scheme: str
    num_requests: int
    reserved_per_request: float
    plot_label: str


def fit_table(workload: Workload, budget_tokens: int, block_sizes: Sequence[int], max_model_len: int) -> list[FitRow]:
    totals = [request.total_len for request in workload.requests]

    def row(scheme: str, label: str, footprint: Callable[[int], int], capacity: int, unit: int) -> FitRow:
        sizes = [footprint(total) for total in totals]
        return FitRow(scheme, requests_that_fit(sizes, capacity), unit * sum(sizes) / len(sizes), label)

    rows = [row(f"paged, block size {bs}", f"paged\nblock {bs}", lambda total, bs=bs: cdiv(total, bs),
                budget_tokens // bs, bs) for bs in block_sizes]
    rows.append(row("contiguous, prompt + max_tokens", "contiguous\nexact", lambda total: total, budget_tokens, 1))
    rows.append(FitRow(f"contiguous, max_model_len={max_model_len}", budget_tokens // max_model_len,
                       float(max_model_len), f"contiguous\n{max_model_len}"))
    return rows


# ---- model shapes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    max_model_len: int
    kv_bytes_per_token: int
    dtype: str


def model_shape(model: str | None, dtype_name: str) -> ModelShape:
    """The model's longest sequence and KV bytes per token at the dtype the engine would pick."""
    import torch

    from pagellm.engine.engine_core import resolve_dtype, resolve_max_model_len
    from pagellm.models.llama import head_dim_of
    from pagellm.models.loader import load_hf_config, resolve_model

    config, _ = load_hf_config(resolve_model(model))
    dtype = resolve_dtype(dtype_name, config, torch.device("cpu"))
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(config) * element
    return ModelShape(resolve_max_model_len(None, config), per_token, str(dtype).removeprefix("torch."))


def default_budget_tokens(shape: ModelShape) -> int:
    """Tokens the engine's default CPU pool (4 GiB) holds for this model."""
    from pagellm.config import CPU_DEFAULT_KV_CACHE_BYTES

    return CPU_DEFAULT_KV_CACHE_BYTES // shape.kv_bytes_per_token


# ---- report ----------------------------------------------------------------------------------------


def print_waste_table(results: Sequence[RunResult]) -> None:
    max_model_len = results[0].max_model_len
    headers = ["block size", "mode", "peak step", "running", "blocks", "slots", "stored", "paged waste",
               f"contig. waste (max_model_len={max_model_len})", "contig. waste (exact)", "preemptions"]
    rows = [[r.block_size, r.mode, r.peak.step, r.peak.num_running, r.peak.num_used_blocks, r.peak.allocated_slots,
             r.peak.num_stored_tokens, f"{r.peak.paged_waste:.2%}", f"{r.peak.contiguous_waste(max_model_len):.2%}",
             f"{r.peak.exact_reservation_waste:.2%}", r.num_preemptions] for r in results]
    print(format_table(headers, rows))


def print_fit_table(rows: Sequence[FitRow], budget_tokens: int) -> None:
    print(f"Requests of this workload that fit at once in a KV budget of {budget_tokens:,} tokens "
          "(each at its final length):")
    print(format_table(["scheme", "requests", "slots per request (mean)"],
                       [[row.scheme, row.num_requests, row.reserved_per_request] for row in rows]))
    print("(At final lengths paged loses only each sequence's last partial block; exact reservation needs every "
          "output length known in advance, and holds those slots empty from the start: its waste above.)")


def plot(results: Sequence[RunResult], fits: Sequence[FitRow], budget_tokens: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r.mode == results[0].mode]  # one mode: an engine run repeats the simulation
    max_model_len = shown[0].max_model_len
    fig, (waste_ax, fit_ax, time_ax) = plt.subplots(1, 3, figsize=(16, 4.8))

    labels = [f"paged\nblock {r.block_size}" for r in shown] + ["contiguous\nexact", f"contiguous\n{max_model_len}"]
    peak = shown[0].peak
    values = [r.peak.paged_waste for r in shown] + [peak.exact_reservation_waste, peak.contiguous_waste(max_model_len)]
    colors = ["tab:blue"] * len(shown) + ["tab:orange", "tab:red"]
    bars = waste_ax.bar(labels, [v * 100 for v in values], color=colors)
    waste_ax.bar_label(bars, fmt="%.1f%%")
    waste_ax.set_ylabel("KV slots reserved but empty at peak (%)")
    waste_ax.set_title(f"Waste at peak ({peak.num_running} requests running)")

    bars = fit_ax.bar([row.plot_label for row in fits], [row.num_requests for row in fits],
                      color=["tab:blue"] * (len(fits) - 2) + ["tab:orange", "tab:red"])
    fit_ax.bar_label(bars)
    fit_ax.set_ylabel("requests that fit at once")
    fit_ax.set_title(f"In a {budget_tokens:,}-token KV budget")

    for r in shown:
        time_ax.plot([s.step for s in r.trace], [s.paged_waste * 100 for s in r.trace], label=f"block {r.block_size}")
    time_ax.set_xlabel("engine step")
    time_ax.set_ylabel("paged waste (%)")
    time_ax.set_title("Paged waste over the run")
    time_ax.legend()
    fig.suptitle(f"KV cache: paged vs contiguous ({shown[0].mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    runs = parser.add_argument_group("runs")
    runs.add_argument("--simulate", action="store_true",
                      help="drive the real scheduler and KV-cache manager with a fake model runner (the default "
                           "when --engine is not given)")
    runs.add_argument("--engine", action="store_true",
                      help="run the real engine on the model; with --simulate too, both run and are compared")
    runs.add_argument("--block-sizes", type=int, nargs="+", default=list(DEFAULT_BLOCK_SIZES),
                      help="paged block sizes to measure (default: 8 16 32)")
    runs.add_argument("--kv-budget-tokens", type=int, default=None,
                      help="KV pool size in tokens, the same for every scheme (default: what the engine's default "
                           "4 GiB CPU pool holds for the model at its dtype: 93,206 tokens for SmolLM2 in float32)")
    runs.add_argument("--max-model-len", type=int, default=None,
                      help="what a contiguous scheme reserves per request, and the engine's limit (default: the "
                           "model's max_position_embeddings, 8192 for SmolLM2)")
    runs.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                      help="most requests running at once (default: %(default)s, the engine's)")
    runs.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                      help="token budget per step (default: %(default)s, the engine's on CPU)")
    runs.add_argument("--model", default=None,
                      help="local HF directory or .gguf file: its shapes size the KV budget, and --engine runs it "
                           "(default: the embedded SmolLM2-135M-Instruct)")
    runs.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="KV dtype, for the default budget and --engine (default: %(default)s, the engine's choice)")
    runs.add_argument("--plot", default="benchmarks/memory.png", help="where to save the PNG (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.engine:
        args.simulate = True
    return args


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    args = parse_args(argv)
    workload = generate_workload(WorkloadSpec.from_args(args), sampleable_token_ids(load_tokenizer(args.model)))
    shape = model_shape(args.model, args.dtype)
    max_model_len = args.max_model_len or shape.max_model_len
    budget = args.kv_budget_tokens or default_budget_tokens(shape)
    if workload.max_total_len > max_model_len:
        sys.exit(f"the workload's longest request ({workload.max_total_len} tokens) exceeds max_model_len="
                 f"{max_model_len}; raise --max-model-len or shorten the workload")
    knobs = SchedulerKnobs(args.max_num_seqs, args.max_num_batched_tokens)
    print(f"Workload: {workload.describe()}; everything submitted at once, EOS ignored.")
    print(f"KV budget {budget:,} tokens ({budget * shape.kv_bytes_per_token / 2**30:.2f} GiB at "
          f"{shape.kv_bytes_per_token:,} bytes/token, {shape.dtype}), max_model_len={max_model_len}, "
          f"max_num_seqs={knobs.max_num_seqs}, max_num_batched_tokens={knobs.max_num_batched_tokens}")

    results: list[RunResult] = []
    for block_size in args.block_sizes:
        num_blocks = budget // block_size
        if args.simulate:
            results.append(simulate(workload, block_size, num_blocks, max_model_len, knobs))
        if args.engine:
            results.append(run_engine(workload, block_size, num_blocks, max_model_len, knobs, args.model, args.dtype))

    print()
    print_waste_table(results)
    fits = fit_table(workload, budget, args.block_sizes, max_model_len)
    print()
    print_fit_table(fits, budget)
    if args.simulate and args.engine:
        report_agreement(results)
    plot(results, fits, budget, args.plot)
    print(f"plot: {args.plot}")
    for result in results:
        print(json.dumps(result.as_json()))
    print(json.dumps({"kv_budget_tokens": budget, "fit": {row.scheme: row.num_requests for row in fits}}))
    return results


def report_agreement(results: Sequence[RunResult]) -> None:
    by_key = {(r.mode, r.block_size): r for r in results}
    for block_size in sorted({r.block_size for r in results}):
        simulated, real = by_key[("simulate", block_size)], by_key[("engine", block_size)]
        same = simulated.trace == real.trace
        print(f"block size {block_size}: simulated and engine traces {'match step for step' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
