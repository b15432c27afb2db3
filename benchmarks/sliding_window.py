"""The KV memory a sliding window saves: peak blocks of one long prompt with and without freeing.

A tiny random Mistral-shaped model (every layer slides by --window) is saved like a Hugging Face checkpoint and
run by the real engine on one --prompt-len prompt of random tokens, greedily, in float32, twice on the same
engine: once as pagellm runs it (blocks the window has moved past go back to the pool as the sequence runs), and
once with that freeing switched off (the KV-cache manager told the model has no window, so every block stays
until the request ends; attention still reads only the window, so the output must be the same). Prints the
request's peak blocks for each, the saving, whether the outputs agree and the CPU the seconds came from; then
runs the prompt on a pool smaller than the prompt itself, which only freeing makes possible.

    .venv/bin/python benchmarks/sliding_window.py                      # window 64, prompt 2048
    .venv/bin/python benchmarks/sliding_window.py --window 256 --prompt-len 4096
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pagellm import LLM, SamplingParams
from pagellm.core.kv_cache_manager import cdiv, max_blocks_per_sequence
from pagellm.cpu_features import cpu_description


def save_tiny_mistral(path: Path, window: int, max_positions: int) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_positions,
                           sliding_window=window, tie_word_embeddings=False, initializer_range=0.3,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    MistralForCausalLM(config).to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)


def run(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], int, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return output.outputs[0].token_ids, output.kv.peak_blocks, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="prefill chunk size: a sequence holds its window plus one chunk")
    args = parser.parse_args()
    total = args.prompt_len + args.max_tokens
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    common = dict(dtype="float32", block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=False, max_model_len=total)
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_mistral(Path(tmp), args.window, total)
        llm = LLM(tmp, num_gpu_blocks_override=cdiv(total, args.block_size) + 1, **common)
        kv = llm.llm_engine.core.scheduler.kv
        assert kv.sliding_window == args.window
        # The first generate pays one-time costs (kernel loading, first-touch pages): keep them out of both timings.
        run(llm, prompt[: 2 * args.window], 2)
        freed_tokens, freed_peak, freed_seconds = run(llm, prompt, args.max_tokens)
        kv.sliding_window = None  # every block now stays until the request ends
        kept_tokens, kept_peak, kept_seconds = run(llm, prompt, args.max_tokens)
        del llm
        bound = max_blocks_per_sequence(total, args.block_size, args.window, args.max_num_batched_tokens)
        small = LLM(tmp, num_gpu_blocks_override=bound, **common)
        small_tokens, small_peak, _ = run(small, prompt, args.max_tokens)
    report = {
        "cpu": cpu_description(), "window": args.window, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "block_size": args.block_size, "max_num_batched_tokens": args.max_num_batched_tokens,
        "peak_blocks_freeing": freed_peak, "peak_blocks_without_freeing": kept_peak,
        "saving": round(1 - freed_peak / kept_peak, 4), "bound_blocks_per_sequence": bound,
        "outputs_equal": freed_tokens == kept_tokens,
        "seconds_freeing": round(freed_seconds, 2), "seconds_without_freeing": round(kept_seconds, 2),
        f"pool_of_{bound}_blocks_runs_it": small_tokens == freed_tokens, "peak_blocks_small_pool": small_peak,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
