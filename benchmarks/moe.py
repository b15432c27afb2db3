"""A mixture-of-experts engine step against a dense model with the same active parameters, on the CPU.

Two shapes, scaled down to fit a small machine (random weights, load_format="dummy", float32 or `--dtype
bfloat16`):
- Qwen3-30B-A3B's: hidden 2048 -> 1024, 128 experts of 768 -> 384 features, 8 per token, 16 query / 2 KV heads
  of 64 (from 32 / 4 of 128);
- Mixtral-8x7B's: hidden 4096 -> 1024, 8 experts of 14336 -> 3584 features, 2 per token, 8 query / 2 KV heads
  of 128 (from 32 / 8).
Each runs `--layers` layers and a `--vocab`-token head (small, so that the LM head does not hide the layers).
Its dense twin has the same attention and one MLP of top_k * expert features: the parameters a token reads.

For each model: one decode step of `--batch` sequences (median of `--steps` steps) and the prefill step of one
`--prompt-len`-token prompt, as whole engine steps and as the time spent inside the layers' MLPs (forward hooks:
the MoE block's router, grouping and experts against the dense MLP). The MoE and dense engines run interleaved,
`--repeats` rounds, best kept, so load from other processes hits both alike; the load average is printed.

A decode batch of B tokens with k of E experts each touches about E (1 - (1 - k/E)^B) distinct experts, whose
weights must all be read, where the dense twin reads k experts' worth: beyond batch 1 the MoE step reads more
memory than its dense twin by that factor, whatever the kernels (the table prints the experts touched).

    PYTHONPATH=$PWD python benchmarks/moe.py
    PYTHONPATH=$PWD python benchmarks/moe.py --shapes qwen3-30b-a3b --batch 1 8 --layers 4
    PYTHONPATH=$PWD python benchmarks/moe.py --cpus 1     # one thread: steadier where other processes load the CPUs
    PYTHONPATH=$PWD python benchmarks/moe.py --dtype bfloat16

Against vLLM-CPU: `--save-configs DIR` writes each shape's MoE config (with the default model's tokenizer) and
exits; benchmarks/throughput.py then runs the same offline workload on both engines with random weights:

    PYTHONPATH=$PWD python benchmarks/moe.py --save-configs /tmp/moe-configs --layers 4
    PYTHONPATH=$PWD python benchmarks/throughput.py --model /tmp/moe-configs/qwen3-30b-a3b-moe --load-format dummy \
        --dtype float32 --num-prompts 32 --input-len 128 --output-len 64
    /tmp/vllm-venv/bin/python benchmarks/throughput.py --engine vllm --model /tmp/moe-configs/qwen3-30b-a3b-moe \
        --load-format dummy --dtype float32 --num-prompts 32 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

SHAPES = {
    "qwen3-30b-a3b": dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=64,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=384),
    "mixtral-8x7b": dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=3584),
}


def configs(shape: str, layers: int, vocab: int, tokenizer):
    """(MoE config, dense twin config) as transformers configs."""
    from transformers import MistralConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    s = SHAPES[shape]
    common = dict(hidden_size=s["hidden_size"], num_attention_heads=s["num_attention_heads"],
                  num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], num_hidden_layers=layers,
                  vocab_size=vocab, max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    active = s["num_experts_per_tok"] * s["moe_intermediate_size"]
    if shape == "qwen3-30b-a3b":
        moe = Qwen3MoeConfig(**common, num_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
                             moe_intermediate_size=s["moe_intermediate_size"], intermediate_size=active,
                             norm_topk_prob=True)
        return moe, Qwen3Config(**common, intermediate_size=active)
    moe = MixtralConfig(**common, num_local_experts=s["num_experts"], num_experts_per_tok=s["num_experts_per_tok"],
                        intermediate_size=s["moe_intermediate_size"], sliding_window=None)
    return moe, MistralConfig(**common, intermediate_size=active, sliding_window=None)


def model_dir(root: Path, name: str, config, tokenizer) -> str:
    path = root / name
    # Named as a checkpoint names it: an engine that guesses the model class from a bare config (vLLM) may
    # otherwise pick an embedding model.
    config.architectures = [type(config).__name__.removesuffix("Config") + "ForCausalLM"]
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@dataclass
class MlpClock:
    """Seconds spent inside the layers' MLP forwards, and the distinct experts each MoE layer ran."""

    seconds: float = 0.0
    experts: list[int] = field(default_factory=list)
    _started: float = 0.0

    def attach(self, model) -> None:
        from pagellm.layers.fused_moe import FusedMoE

        for layer in model.model.layers:
            layer.mlp.register_forward_pre_hook(self._start)
            layer.mlp.register_forward_hook(self._stop)
        for module in model.modules():
            if isinstance(module, FusedMoE):
                select = module.select_experts

                def counted(logits, select=select):
                    weights, ids = select(logits)
                    self.experts.append(int(ids.unique().numel()))
                    return weights, ids

                module.select_experts = counted

    def _start(self, *_):
        self._started = time.perf_counter()

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._started

    def reset(self) -> None:
        self.seconds, self.experts = 0.0, []


@dataclass
class Timing:
    step: float
    mlp: float
    experts: float


class Bench:
    def __init__(self, name: str, path: str, args, **engine_args) -> None:
        """`engine_args` over the defaults (random weights: load_format "dummy")."""
        from pagellm import LLM

        self.name = name
        self.llm = LLM(path, **{**dict(dtype=args.dtype, load_format="dummy",
                                       max_model_len=args.prompt_len + args.steps + 64, max_num_seqs=max(args.batch),
                                       max_num_batched_tokens=max(args.prompt_len, 256),
                                       kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False),
                                **engine_args})
        self.engine = self.llm.llm_engine
        self.clock = MlpClock()
        self.clock.attach(self.engine.core.runner.model)
        self.serial = 0

    def _timed_step(self) -> tuple[float, float, float]:
        self.clock.reset()
        start = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - start
        experts = statistics.mean(self.clock.experts) if self.clock.experts else 0.0
        return seconds, self.clock.seconds, experts

    def decode(self, batch: int, context: int, steps: int) -> Timing:
        from pagellm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        generator = torch.Generator().manual_seed(batch)
        vocab = self.engine.vocab_size
        for _ in range(batch):
            self.serial += 1
            prompt = torch.randint(3, vocab, (context,), generator=generator).tolist()
            self.engine.add_request(f"d{self.serial}", {"prompt_token_ids": prompt}, params)
        scheduler = self.engine.core.scheduler
        while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
            self.engine.step()
        samples = [self._timed_step() for _ in range(steps - 1)]
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return Timing(*(statistics.median(column) for column in zip(*samples)))

    def prefill(self, prompt_len: int) -> Timing:
        from pagellm import SamplingParams

        self.serial += 1
        generator = torch.Generator().manual_seed(self.serial)
        prompt = torch.randint(3, self.engine.vocab_size, (prompt_len,), generator=generator).tolist()
        self.engine.add_request(f"p{self.serial}", {"prompt_token_ids": prompt},
                                SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        timing = Timing(*self._timed_step())
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return timing


def best(timings: list[Timing]) -> Timing:
    return min(timings, key=lambda t: t.step)


def add_step_arguments(parser: argparse.ArgumentParser, prompt_len: int) -> None:
    """The timed steps' arguments the MoE benchmarks share."""
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    parser.add_argument("--context", type=int, default=64, help="prompt length of each decoding sequence")
    parser.add_argument("--prompt-len", type=int, default=prompt_len)
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per batch (median kept)")
    parser.add_argument("--repeats", type=int, default=3)


def print_cpu() -> None:
    from pagellm.cpu_features import cpu_description, cpu_flags

    isa = sorted(flag for flag in cpu_flags() if flag.startswith(("avx", "amx", "fma", "f16c")))
    print(f"CPU: {cpu_description()}; flags: {' '.join(isa)}; CPUs used: {len(os.sched_getaffinity(0))}")


def workloads(args) -> list[str]:
    return [f"decode x{b}" for b in args.batch] + [f"prefill {args.prompt_len}"]


def interleaved_rounds(benches: list[Bench], args) -> dict[tuple[str, str], Timing]:
    """(bench, workload) -> the best of `args.repeats` rounds, each running every bench in turn, so that all see
    the same load: decode steps of each `args.batch`, then one prefill step."""
    results: dict[tuple[str, str], list[Timing]] = {}
    for _ in range(args.repeats):
        for bench in benches:
            for batch in args.batch:
                results.setdefault((bench.name, f"decode x{batch}"), []).append(
                    bench.decode(batch, args.context, args.steps))
            results.setdefault((bench.name, f"prefill {args.prompt_len}"), []).append(bench.prefill(args.prompt_len))
    return {key: best(timings) for key, timings in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    add_step_arguments(parser, prompt_len=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--cpus", type=int, default=None,
                        help="pin to the first N CPUs of the affinity mask (the engine runs that many threads)")
    parser.add_argument("--save-configs", type=Path, default=None,
                        help="write each shape's MoE and dense HF directories (config and tokenizer) here and exit")
    args = parser.parse_args()
    if args.cpus is not None:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])

    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    print_cpu()
    if args.save_configs is not None:
        for shape in args.shapes:
            for name, config in zip(("moe", "dense"), configs(shape, args.layers, args.vocab, tokenizer)):
                print(model_dir(args.save_configs, f"{shape}-{name}", config, tokenizer))
        return
    root = Path(tempfile.mkdtemp(prefix="pagellm-moe-bench-"))
    rows = []
    for shape in args.shapes:
        moe_config, dense_config = configs(shape, args.layers, args.vocab, tokenizer)
        benches = [Bench("moe", model_dir(root, f"{shape}-moe", moe_config, tokenizer), args),
                   Bench("dense", model_dir(root, f"{shape}-dense", dense_config, tokenizer), args)]
        results = interleaved_rounds(benches, args)
        for workload in workloads(args):
            rows.append((shape, workload, results[("moe", workload)], results[("dense", workload)]))
        for bench in benches:
            bench.engine.shutdown()
    print(f"{args.dtype}; load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    header = ("shape", "step", "MoE step ms", "dense step ms", "ratio", "MoE MLP ms", "dense MLP ms", "MLP ratio",
              "experts/layer")
    print(" | ".join(header))
    for shape, workload, moe, dense in rows:
        print(" | ".join((shape, workload, f"{moe.step * 1e3:.2f}", f"{dense.step * 1e3:.2f}",
                          f"{moe.step / dense.step:.2f}x", f"{moe.mlp * 1e3:.2f}", f"{dense.mlp * 1e3:.2f}",
                          f"{moe.mlp / dense.mlp:.2f}x", f"{moe.experts:.1f}")))


if __name__ == "__main__":
    main()
