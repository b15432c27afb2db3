"""Quantized weights: memory, perplexity and speed of each format pagellm runs, beside llama.cpp on the GGUFs.

Formats, all of the default model (SmolLM2-135M-Instruct) unless named:
- `fp32`, `bf16`: its HF export (benchmarks/export_hf.py: the GGUF's weights dequantized), the float reference;
- `gguf Q4_1`: the GGUF file itself (the blocks kept as they are);
- `gguf Q8_0 (requant)`, `gguf Q4_K_M (requant)` (with --llama-python): that file requantized by llama.cpp's own
  quantizer (llama_model_quantize, allow_requantize), so the same weights as bf16's; SmolLM2's 576-wide rows are not
  a multiple of 256, so llama.cpp's Q4_K_M falls back to Q5_0 (and Q8_0) there and keeps Q4_K/Q6_K for the
  1536-wide down projections, as published SmolLM2 Q4_K_M files do;
- `gguf Q8_0 (requant), fp32` and `gguf Q8_0 (requant), fp32 + bf16 KV`: the Q8_0 file with float32 activations,
  its KV cache in float32 or in bfloat16 (kv_cache_dtype="bfloat16");
- `int8 online`, `fp8 online`: the HF export with quantization="int8" (W8A8) / "fp8", quantized as it loads;
  `fp8_per_channel online`, `fp8_per_block online`, `mxfp8 online`: with vLLM's online shorthands of those names
  (fp8 weights with a scale per output channel, per 128 x 128 block, per 32 inputs as a power of two);
  `rtn online`: quantization="rtn" (vLLM's round to nearest; RTN_NUM_BITS / RTN_GROUP_SIZE from the environment,
  8 bits in groups of 128 by default);
- `awq 4-bit`, `gptq 4-bit act-order`, `gptq 8-bit`: the HF export packed as AutoAWQ / AutoGPTQ pack it
  (round-to-nearest groups of 64, as 576 input features take: tests/quant_checkpoints.py);
- `w8a8 int8 (c-t)`, `fp8 (c-t)`: compressed-tensors checkpoints of the export (tests/w8a8_checkpoints.py);
  `fp8 (fbgemm)`: the same per-channel fp8 weights as Meta's FP8 releases store them (quant_method fbgemm_fp8);
- `fp8 (modelopt)`: an NVIDIA ModelOpt FP8 checkpoint of the export (per-tensor scales, static input scales from
  the calibration prompts; tests/w8a8_checkpoints.py's write_modelopt);
- `w4a16 (c-t)`: a compressed-tensors pack-quantized checkpoint of the export (4-bit, groups of 64, zero points, as
  llm-compressor writes it: tests/quant_checkpoints.py);
- `nvfp4 (c-t)`, `nvfp4 (modelopt)`: the export in NVFP4 (e2m1 weights in groups of 16 with fp8 scales and a global
  scale, rounded to nearest by compressed-tensors' own code: tests/nvfp4_checkpoints.py), as llm-compressor writes
  NVFP4A16 and as ModelOpt exports NVFP4 (the same codes and scales); `nvfp4 (c-t), fp32` the former with float32
  activations, beside `nvfp4 dequantized, fp32`, a float32 checkpoint of its weights as compressed-tensors
  dequantizes them (what the kernels' roundings cost);
- `bnb nf4`, `bnb 8-bit`: bitsandbytes checkpoints of the export as transformers saves a load_in_4bit model
  (NF4, blocks of 64, double quantization, as unsloth's -bnb-4bit models) and a load_in_8bit one (LLM.int8), written by
  tests/bnb_checkpoints.py; `bnb nf4 in flight`: the export with quantization="bitsandbytes";
- `hqq 4-bit`: an HQQ checkpoint of the export (4-bit, groups of 64, rounded to nearest with integer zeros:
  tests/hqq_checkpoints.py);
- `fp8 (pagellm quantize)`, `w4a16 (pagellm quantize)`, `nvfp4 (pagellm quantize)`: the export written by `pagellm
  quantize` (GPTQ over its default calibration, 64 samples of 256 tokens the model writes itself; FP8_DYNAMIC,
  W4A16_ASYM in groups of 64, the grid of `w4a16 (c-t)` rounded to nearest, and NVFP4A16, the grid of `nvfp4 (c-t)`);
- `gemma3 Q4_K_M` (with --gemma): the real Gemma 3 270M Q4_K_M GGUF, for memory against a mixed K-quant file;
- `llama 1B Q4_1 (synthetic)`: a Llama-3.2-1B-shaped GGUF of random Q4_1 blocks with the default model's tokenizer
  (benchmarks/synthetic_gguf.py), for memory at a size where the fixed costs (tokenizer, sampler workspace, code)
  weigh less; its perplexity and text are noise.

Each format runs in a fresh process that has imported torch and nothing else when it reads its baseline (the
checkpoint's path comes from the parent): what LLM() adds to its RSS (VmRSS from then to after LLM(), again after
the format's runs below, and the process's peak: VmHWM, or the peak before the engine reset VmHWM to measure its
activations), the engine's
weight bytes, the perplexity of a fixed text (exp of the mean negative log-likelihood of its tokens after the
first, prompt_logprobs), single-stream decode tok/s (one request, greedy, EOS ignored, its decode steps after the
prefill's; the best of --repeats runs) and batched output tok/s (--batch requests at once), and batched prefill
tok/s (those requests' prompt tokens per second, evaluated together for one output token each; best of
--repeats). With --llama-python (a venv with
llama-cpp-python, built for this CPU: `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`), llama.cpp
runs the GGUFs on the same cores: its perplexity of the same tokens, its single-stream decode tok/s (best of as many runs), and its
batched output tok/s over the same number of sequences through its own batching (every sequence in one
llama_decode per step over a shared KV cache; the best of two micro-batch sizes).
Writes a PNG of memory per format (--plot).

    .venv/bin/python benchmarks/quantized.py
    .venv/bin/python benchmarks/quantized.py --formats "gguf Q4_1" bf16 --llama-python /tmp/llama-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.texts import PERPLEXITY_TEXT

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
KV_CACHE_BYTES = 256 << 20
MAX_MODEL_LEN = 1024
PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Format:
    name: str
    source: str  # "gguf", "gemma", "hf" or a checkpoint writer's key
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"


FORMATS = [
    Format("fp32", "hf", "float32"),
    Format("bf16", "hf", "bfloat16"),
    Format("gguf Q4_1", "gguf"),
    Format("gguf Q8_0 (requant)", "requant-Q8_0"),
    # The same file with float32 activations (the int8 kernels quantize them per 32 from float32, as llama.cpp's do),
    # its KV cache in float32 or kept in bfloat16 (kv_cache_dtype="bfloat16": the bfloat16 model's tokens per GiB).
    Format("gguf Q8_0 (requant), fp32", "requant-Q8_0", "float32"),
    Format("gguf Q8_0 (requant), fp32 + bf16 KV", "requant-Q8_0", "float32", kv_cache_dtype="bfloat16"),
    Format("gguf Q4_K_M (requant)", "requant-Q4_K_M"),
    # IQ types: IQ4_NL on its kernels, the others kept as another type's blocks (gguf_quants.transcode_blocks).
    Format("gguf IQ4_XS (requant)", "requant-IQ4_XS"),
    Format("gguf IQ4_NL (requant)", "requant-IQ4_NL"),
    # The online formats run in the dtype a user gets (float32 on CPUs without bf16 instructions, else bfloat16).
    Format("int8 online", "hf", "auto", "int8"),
    Format("fp8 online", "hf", "auto", "fp8"),
    Format("fp8_per_channel online", "hf", "auto", "fp8_per_channel"),
    Format("fp8_per_block online", "hf", "auto", "fp8_per_block"),
    Format("mxfp8 online", "hf", "auto", "mxfp8"),
    Format("rtn online", "hf", "auto", "rtn"),
    Format("awq 4-bit", "awq"),
    Format("gptq 4-bit act-order", "gptq4"),
    Format("gptq 8-bit", "gptq8"),
    Format("w8a8 int8 (c-t)", "ct-int8"),
    Format("fp8 (c-t)", "ct-fp8"),
    Format("fp8 (fbgemm)", "fbgemm-fp8"),
    Format("fp8 (modelopt)", "modelopt-fp8"),
    Format("w4a16 (c-t)", "ct-w4a16"),
    Format("nvfp4 (c-t)", "ct-nvfp4"),
    Format("nvfp4 (modelopt)", "modelopt-nvfp4"),
    # What the blocks' kernels cost: the same checkpoint in float32, beside a float32 checkpoint of its weights as
    # compressed-tensors dequantizes them.
    Format("nvfp4 (c-t), fp32", "ct-nvfp4", "float32"),
    Format("nvfp4 dequantized, fp32", "ct-nvfp4-dequantized", "float32"),
    Format("bnb nf4", "bnb-nf4"),
    Format("bnb 8-bit", "bnb-int8"),
    Format("bnb nf4 in flight", "hf", "auto", "bitsandbytes"),
    Format("hqq 4-bit", "hqq4"),
    Format("fp8 (pagellm quantize)", "gptq-FP8_DYNAMIC"),
    Format("w4a16 (pagellm quantize)", "gptq-W4A16_ASYM"),
    Format("nvfp4 (pagellm quantize)", "gptq-NVFP4A16"),
    Format("gemma3 Q4_K_M", "gemma"),
    Format("llama 1B Q4_1 (synthetic)", "synthetic"),
]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def gemma_path() -> str:
    sys.path.insert(0, str(ROOT))
    from tests.test_gguf_gemma3 import gemma3_270m_path  # assembles the file from its package once, cached

    return str(gemma3_270m_path())


# Run by the llama-cpp-python interpreter: argv = input GGUF, output GGUF, llama.cpp's file type name.
LLAMA_QUANTIZE = """
import ctypes, os, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
params.allow_requantize = True
params.nthread = len(os.sched_getaffinity(0))
status = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(status)
"""


def requantized(source: Path, kind: str, out: Path, llama_python: str | None) -> str:
    """`source` requantized to llama.cpp file type `kind` (Q8_0, Q4_K_M) by llama.cpp itself, written once."""
    if not out.exists():
        if llama_python is None:
            raise SystemExit(f"the {kind} requantization runs llama.cpp's quantizer: pass --llama-python")
        partial = out.with_suffix(".partial")
        subprocess.run([llama_python, "-c", LLAMA_QUANTIZE, str(source), str(partial), kind], check=True,
                       capture_output=True)
        partial.rename(out)
    return str(out)


def checkpoint(fmt: Format, workdir: Path, llama_python: str | None = None) -> str:
    """The model path for `fmt`, written under workdir on first use."""
    from pagellm.models.gguf_loader import default_model_path

    if fmt.source == "gguf":
        return str(default_model_path())
    if fmt.source.startswith("requant-"):
        kind = fmt.source.removeprefix("requant-")
        return requantized(default_model_path(), kind, workdir / f"smollm2-{kind}.gguf", llama_python)
    if fmt.source == "gemma":
        return gemma_path()
    if fmt.source == "synthetic":
        from benchmarks.synthetic_gguf import write_synthetic_gguf

        return str(write_synthetic_gguf(workdir / "llama-1b-q4_1.gguf"))
    hf = workdir / "hf"
    if not (hf / "config.json").exists():
        from benchmarks.export_hf import export

        export(default_model_path(), hf)
    if fmt.source == "hf":
        return str(hf)
    out = workdir / fmt.source
    if (out / "quantized" / "config.json").exists():
        return str(out / "quantized")
    sys.path.insert(0, str(ROOT))
    if fmt.source.startswith("gptq-"):
        from pagellm.compression.oneshot import QuantizeArgs, quantize

        scheme = fmt.source.removeprefix("gptq-")
        shutil.rmtree(out, ignore_errors=True)
        written = quantize(QuantizeArgs(str(hf), str(out / "partial"), scheme,
                                        group_size=64 if scheme.startswith("W4A16") else None))
        return str(written.rename(out / "quantized"))
    if fmt.source == "modelopt-fp8":
        from tests.w8a8_checkpoints import write_modelopt

        return write_modelopt(str(hf), out, "FP8")[0]
    if fmt.source == "hqq4":
        from tests.hqq_checkpoints import write_hqq

        shutil.rmtree(out, ignore_errors=True)
        return str(write_hqq(str(hf), out, 4, 64)[0])
    if fmt.source.startswith("bnb-"):
        from safetensors.torch import load_file

        from tests.bnb_checkpoints import write_bnb

        shutil.rmtree(out, ignore_errors=True)
        if fmt.source == "bnb-int8":
            write_bnb(hf, out / "quantized", 8)
        else:  # bitsandbytes' own 8-bit code map for the scales (tests/data/make_bnb_reference.py)
            nested = load_file(str(ROOT / "tests" / "data" / "bnb_reference.safetensors"))
            write_bnb(hf, out / "quantized", 4, "nf4", 64, nested["nf4_b64_dq.weight.nested_quant_map"])
        return str(out / "quantized")
    if fmt.source in ("ct-nvfp4", "modelopt-nvfp4", "ct-nvfp4-dequantized"):
        from tests.nvfp4_checkpoints import compressed_checkpoint, write_checkpoint, write_float

        shutil.rmtree(out, ignore_errors=True)
        modules, dequantized = compressed_checkpoint(str(hf))
        if fmt.source == "ct-nvfp4-dequantized":
            return write_float(str(hf), out / "quantized", dequantized)
        flavour = "compressed-tensors" if fmt.source == "ct-nvfp4" else "modelopt"
        return write_checkpoint(str(hf), out / "quantized", modules, flavour,
                                "NVFP4A16" if flavour == "compressed-tensors" else "NVFP4")
    if fmt.source in ("ct-int8", "ct-fp8"):
        from tests.w8a8_checkpoints import write_quantized as write_w8a8

        scheme = "int8-channel-dynamic" if fmt.source == "ct-int8" else "fp8-channel-dynamic"
        return write_w8a8(str(hf), out, scheme)[0]
    if fmt.source == "fbgemm-fp8":
        from tests.w8a8_checkpoints import write_quantized as write_w8a8

        return write_w8a8(str(hf), out, "fp8-channel-dynamic", fmt="fbgemm_fp8")[0]
    from tests.quant_checkpoints import QuantSpec, write_quantized

    spec = {"awq": QuantSpec("awq", group_size=64),
            "gptq4": QuantSpec("gptq", bits=4, group_size=64, desc_act=True),
            "gptq8": QuantSpec("gptq", bits=8, group_size=64, sym=False),
            "ct-w4a16": QuantSpec("compressed-tensors", bits=4, group_size=64, sym=False)}[fmt.source]
    write_quantized(hf, out / "quantized", out / "dequantized", spec)
    return str(out / "quantized")


def size_on_disk(path: str) -> int:
    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))


def prompts_of(tokenizer_ids: list[int], count: int) -> list[list[int]]:
    """`count` prompts of PROMPT_TOKENS tokens, windows of the text's tokens (distinct, so no prefix is shared)."""
    span = len(tokenizer_ids) - PROMPT_TOKENS
    return [tokenizer_ids[(i * 7) % span:(i * 7) % span + PROMPT_TOKENS] for i in range(count)]


def run_pagellm(fmt: Format, path: str, args: argparse.Namespace) -> dict:
    """One format in this process (a fresh one): the figures as a dict."""
    import torch  # noqa: F401 - the baseline RSS includes torch, as any engine process has it

    from pagellm import LLM, SamplingParams
    from pagellm.worker.kv_cache import process_peak_rss

    rss_before = _status_kib("VmRSS")
    started = time.perf_counter()
    llm = LLM(path, dtype=fmt.dtype, quantization=fmt.quantization, kv_cache_dtype=fmt.kv_cache_dtype,
              kv_cache_memory_bytes=KV_CACHE_BYTES,
              max_model_len=MAX_MODEL_LEN, max_num_seqs=max(args.batch, 8), enable_prefix_caching=False, seed=0)
    load_s = time.perf_counter() - started
    # The engine resets VmHWM to measure its activation peak: the process's peak is kept beside it.
    rss_loaded, peak = _status_kib("VmRSS"), process_peak_rss() // 1024
    startup = llm.llm_engine.core.startup
    scored = llm.generate([PERPLEXITY_TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = scored.prompt_token_ids
    logprobs = [position[token].logprob for token, position in zip(ids[1:], scored.prompt_logprobs[1:])]
    perplexity = float(torch.tensor(logprobs, dtype=torch.float64).neg().mean().exp())
    row = {"format": fmt.name, "weight_format": llm.llm_engine.core.runner.model.weight_format,
           "file_mib": size_on_disk(path) / MiB, "weights_mib": startup.weights_bytes / MiB,
           "kv_mib": startup.kv_cache_bytes / MiB, "rss_added_mib": (rss_loaded - rss_before) / 1024,
           "peak_added_mib": (peak - rss_before) / 1024, "load_s": load_s, "tokens": len(ids),
           "perplexity": perplexity, "single_tok_s": None, "batched_tok_s": None,
           "prefill_tok_s": None}
    if args.skip_speed:
        return {**row, "rss_served_mib": (_status_kib("VmRSS") - rss_before) / 1024}
    greedy = SamplingParams(temperature=0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in prompts_of(ids, args.batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    # The best run: other tenants of a shared machine only ever slow one down.
    single = max(decode_rate(llm, prompts[0], greedy) for _ in range(args.repeats))
    batched_params = SamplingParams(temperature=0, max_tokens=args.batch_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, batched_params, use_tqdm=False)
    batched = args.batch * args.batch_tokens / (time.perf_counter() - started)
    prefill = max(prefill_rate(llm, prompts) for _ in range(args.repeats))
    return {**row, "single_tok_s": single, "batched_tok_s": batched, "prefill_tok_s": prefill,
            "rss_served_mib": (_status_kib("VmRSS") - rss_before) / 1024}


def prefill_rate(llm, prompts: list[dict]) -> float:
    """Prompt tokens per second of the batch's prompts evaluated together (one output token each)."""
    from pagellm import SamplingParams

    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return sum(len(p["prompt_token_ids"]) for p in prompts) / (time.perf_counter() - started)


def decode_rate(llm, prompt: dict, params) -> float:
    """Decode steps per second of one request: the engine's steps after the prefill's, until it finishes (the
    prompt's evaluation and first token excluded, as llama.cpp's loop below excludes them)."""
    engine = llm.llm_engine
    request_id = f"single-{time.monotonic_ns()}"
    engine.add_request(request_id, prompt, params)
    engine.step()  # the prefill, which samples the first token
    started, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - started)


LLAMA_WORKER = r"""
import json, sys, time
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as bindings
from llama_cpp import Llama

path, text, decode_tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if sys.argv[9] == "0":  # no extra buffer types (the AMX repacking): every model load below takes these params
    default_params = bindings.llama_model_default_params

    def without_extra_buffers():
        params = default_params()
        params.use_extra_bufts = False
        return params

    # Llama() calls the bindings module's function, the batched runs the package's re-export.
    bindings.llama_model_default_params = llama_cpp.llama_model_default_params = without_extra_buffers
scorer = Llama(path, n_ctx=2048, n_batch=512, n_threads=threads, logits_all=True, verbose=False)
ids = scorer.tokenize(text.encode(), add_bos=True, special=False)
scorer.eval(ids)
logits = np.asarray(scorer.scores[: len(ids)], dtype=np.float64)
logits -= logits.max(axis=1, keepdims=True)
logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
nll = -np.mean([logprobs[i - 1, ids[i]] for i in range(1, len(ids))])
del scorer
llm = Llama(path, n_ctx=2048, n_batch=512, n_threads=threads, verbose=False)
prompt = ids[:32]
single = 0.0
for _ in range(int(sys.argv[8])):  # the best of the repeats, as pagellm's
    llm.reset()
    llm.eval(prompt)
    started = time.perf_counter()
    for _ in range(decode_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
    single = max(single, decode_tokens / (time.perf_counter() - started))
del llm


def batched(ids, batch, batch_tokens, prompt_tokens, n_ubatch):
    # `batch` sequences at once through llama.cpp's own batching (one llama_decode per step over every sequence,
    # one KV cache they share): the prompts in one call, then one token per sequence per call, greedy.
    import llama_cpp as L

    span = len(ids) - prompt_tokens
    prompts = [ids[(i * 7) % span:(i * 7) % span + prompt_tokens] for i in range(batch)]
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx = batch * (prompt_tokens + batch_tokens) + 64
    params.n_batch = batch * prompt_tokens
    params.n_ubatch = n_ubatch
    params.n_seq_max = batch
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True
    ctx = L.llama_init_from_model(model, params)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    step = L.llama_batch_init(batch * prompt_tokens, 0, 1)

    def decode(entries):  # (token, position, sequence, wants logits)
        step.n_tokens = len(entries)
        for i, (token, position, sequence, logits) in enumerate(entries):
            step.token[i], step.pos[i], step.n_seq_id[i], step.logits[i] = token, position, 1, logits
            step.seq_id[i][0] = sequence
        if L.llama_decode(ctx, step) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [i for i, entry in enumerate(entries) if entry[3]]
        return [int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,)))) for i in rows]

    started = time.perf_counter()
    tokens = decode([(t, p, s, p == prompt_tokens - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)])
    for index in range(batch_tokens - 1):
        tokens = decode([(tokens[s], prompt_tokens + index, s, True) for s in range(batch)])
    rate = batch * batch_tokens / (time.perf_counter() - started)
    L.llama_batch_free(step)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return rate


batch, batch_tokens, prompt_tokens = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
# llama.cpp splits a call into micro-batches of n_ubatch tokens; its best of two settings counts.
rates = {n: batched(ids, batch, batch_tokens, prompt_tokens, n) for n in (512, batch * prompt_tokens)} if batch else {}
print(json.dumps({"tokens": len(ids), "perplexity": float(np.exp(nll)), "single_tok_s": single,
                  "extra_buffers": sys.argv[9] == "1",
                  "batched_tok_s": max(rates.values()) if rates else None,
                  "batched_n_ubatch": max(rates, key=rates.get) if rates else None}))
"""


def run_llama(path: str, args: argparse.Namespace) -> dict | None:
    """llama.cpp's figures, with its default extra buffer types (on CPUs with AMX, weights repacked for its AMX
    kernels) and, where that run dies of a signal, again without them, saying so."""
    threads = len(os.sched_getaffinity(0))
    batch = 0 if args.skip_speed else args.batch
    for extra_buffers in ("1", "0"):
        done = subprocess.run([args.llama_python, "-c", LLAMA_WORKER, path, PERPLEXITY_TEXT, str(args.decode_tokens),
                               str(threads), str(batch), str(args.batch_tokens), str(PROMPT_TOKENS),
                               str(args.repeats), extra_buffers], capture_output=True, text=True,
                              timeout=args.timeout)
        if done.returncode >= 0:
            break
        print(f"llama.cpp on {path} died of signal {-done.returncode} with its extra buffer types; "
              "running it without them (use_extra_bufts=False)", file=sys.stderr)
    if done.returncode != 0:
        print(f"llama.cpp on {path} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(fmt: Format, workdir: Path, args: argparse.Namespace) -> dict:
    path = checkpoint(fmt, workdir, args.llama_python)
    command = [sys.executable, __file__, "--worker", fmt.name, "--path", path, "--batch", str(args.batch),
               "--batch-tokens", str(args.batch_tokens), "--decode-tokens", str(args.decode_tokens),
               "--repeats", str(args.repeats)]
    if args.skip_speed:
        command.append("--skip-speed")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{fmt.name} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if args.llama_python and (fmt.source in ("gguf", "gemma") or fmt.source.startswith("requant-")):
        row["llama_cpp"] = run_llama(path, args)
    return row


def print_tables(rows: list[dict], reference: float | None) -> None:
    print("\n## Memory (MiB; what LLM() adds to the process, KV pool of "
          f"{KV_CACHE_BYTES >> 20} MiB included)\n")
    print("| format | weight format | file | weights | RSS added | peak added | RSS added - KV | "
          "(- KV) / file | after the runs - KV |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        beside = r["rss_added_mib"] - r["kv_mib"]
        print(f"| {r['format']} | {r['weight_format']} | {r['file_mib']:.0f} | {r['weights_mib']:.0f} | "
              f"{r['rss_added_mib']:.0f} | {r['peak_added_mib']:.0f} | {beside:.0f} | {beside / r['file_mib']:.2f}x | "
              f"{r['rss_served_mib'] - r['kv_mib']:.0f} |")
    print(f"\n## Perplexity of a fixed text ({rows[0]['tokens']} tokens) and speed\n")
    print("| format | perplexity | vs fp32 | decode tok/s (1 stream) | batched output tok/s | batched prefill tok/s | "
          "llama.cpp perplexity | llama.cpp decode tok/s | llama.cpp batched output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        other_model = r["format"].startswith(("gemma", "llama 1B"))  # not the default model: no fp32 reference
        versus = f"{(r['perplexity'] / reference - 1) * 100:+.2f}%" if reference and not other_model else "-"
        llama = r.get("llama_cpp") or {}
        llama_ppl = f"{llama['perplexity']:.3f}" if llama else "-"
        llama_tok = f"{llama['single_tok_s']:.1f}" if llama else "-"
        single = "-" if r["single_tok_s"] is None else f"{r['single_tok_s']:.1f}"
        batched = "-" if r["batched_tok_s"] is None else f"{r['batched_tok_s']:.1f}"
        prefill = "-" if r.get("prefill_tok_s") is None else f"{r['prefill_tok_s']:.0f}"
        llama_batched = f"{llama['batched_tok_s']:.1f}" if llama.get("batched_tok_s") else "-"
        if llama and not llama.get("extra_buffers", True):
            llama_tok, llama_batched = llama_tok + " (a)", llama_batched + " (a)"
        print(f"| {r['format']} | {r['perplexity']:.3f} | {versus} | {single} | {batched} | {prefill} | {llama_ppl} | "
              f"{llama_tok} | {llama_batched} |")
    if any(not (r.get("llama_cpp") or {}).get("extra_buffers", True) for r in rows):
        print("\n(a) llama.cpp without its extra buffer types (use_extra_bufts=False): with them it died of a signal")


def plot(rows: list[dict], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["format"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["weights_mib"] for r in rows], width=0.4, label="weights (engine)")
    ax.bar([x + 0.2 for x in xs], [r["rss_added_mib"] - r["kv_mib"] for r in rows], width=0.4,
           label="RSS added by LLM(), less the KV pool")
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.set_ylabel("MiB")
    ax.set_title(f"Memory per weight format (SmolLM2-135M; Gemma 3 270M last)\n{machine}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", default=None,
                        help=f"formats to run (default: all but gemma3 unless --gemma): {[f.name for f in FORMATS]}")
    parser.add_argument("--gemma", action="store_true", help="also the Gemma 3 270M Q4_K_M GGUF")
    parser.add_argument("--synthetic", action="store_true",
                        help="also the synthetic Llama-1B-shaped Q4_1 GGUF (memory at scale; writes 642 MiB)")
    parser.add_argument("--batch", type=int, default=64, help="requests at once in the batched run")
    parser.add_argument("--batch-tokens", type=int, default=32, help="output tokens per batched request")
    parser.add_argument("--decode-tokens", type=int, default=64, help="output tokens of the single stream")
    parser.add_argument("--repeats", type=int, default=3, help="single-stream runs per engine; the best counts")
    parser.add_argument("--skip-speed", action="store_true", help="memory and perplexity only")
    parser.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python")
    parser.add_argument("--workdir", default=None, help="where the checkpoints are written (default: a temp dir)")
    parser.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "quantized_memory.png")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    by_name = {f.name: f for f in FORMATS}

    if args.worker:
        fmt = by_name[args.worker]
        print(json.dumps(run_pagellm(fmt, args.path, args)))
        return

    names = args.formats or [f.name for f in FORMATS
                             if (f.source != "gemma" or args.gemma) and (f.source != "synthetic" or args.synthetic)
                             and (not f.source.startswith("requant-") or args.llama_python)]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; choose from {list(by_name)}")
    from pagellm.cpu_features import SPEED_FLAGS, cpu_description, cpu_flags

    with tempfile.TemporaryDirectory(prefix="pagellm-quantized-") as tmp:
        workdir = Path(args.workdir or tmp)
        rows = []
        for name in names:
            row = measure(by_name[name], workdir, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    reference = next((r["perplexity"] for r in rows if r["format"] == "fp32"), None)
    flags = " ".join(f for f in SPEED_FLAGS if f in cpu_flags())
    print(f"\n{cpu_description()}, flags: {flags or 'none of ' + ', '.join(SPEED_FLAGS)}; "
          f"{len(os.sched_getaffinity(0))} CPUs; load average {os.getloadavg()[0]:.1f} at the end")
    print_tables(rows, reference)
    if not args.no_plot:
        plot(rows, args.plot, cpu_description())


if __name__ == "__main__":
    main()
