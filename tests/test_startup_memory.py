"""Start-up memory: the profiling peak stays near the steady footprint, and a machine with too little memory gets a
refusal naming the figures before the weights or the pool are allocated, or a default pool sized to what fits.

The small machine is simulated through pagellm.worker.kv_cache.cpu_available_memory (no real memory pressure);
the reading of MemAvailable and cgroup limits is tested on fake /proc and /sys/fs/cgroup trees.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.worker import kv_cache
from pagellm.worker.kv_cache import GiB, cpu_available_memory

MiB = 1 << 20
BIG_VOCAB = 262_144  # Gemma 3's vocabulary
MAX_NUM_SEQS = 256  # the default
UTILIZATION = EngineArgs().gpu_memory_utilization  # the default


@pytest.fixture(scope="module")
def big_vocab_llama_dir(module_tmp_path_factory, default_tokenizer) -> str:
    """A tiny random Llama with Gemma 3's vocabulary: the logits of a full decode step (256 x 262k) dwarf it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=BIG_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=default_tokenizer.bos_token_id,
                         eos_token_id=default_tokenizer.eos_token_id)
    path = module_tmp_path_factory.mktemp("big-vocab-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return str(path)


_MEASURE = textwrap.dedent("""
    import json, sys
    from pagellm import LLM

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=int(sys.argv[2]), kv_cache_memory_bytes=8 << 20,
              kv_prefault_seconds=0)
    print(json.dumps({"peak": status("VmHWM"), "steady": status("VmRSS"),
                      "decode_peak": llm.llm_engine.core.executor.driver.decode_peak}))
""")


def test_the_start_up_peak_stays_within_1_2x_of_the_steady_footprint(big_vocab_llama_dir):
    """In a fresh process: VmHWM (the peak, loading and profiling included) against VmRSS once LLM() returned.

    A full decode step's logits (max_num_seqs x vocab float32, 256 MiB here) are computed and sampled a chunk of
    rows at a time (pagellm/worker/logits.py), and the sampler works in chunks too, so what the profiled step
    adds is one chunk of logits and the sampler's buffers, whatever max_num_seqs; before the sampler was chunked
    the step added ~10x the whole logits (2.7 GiB here), and before the LM head was, the whole logits. The 32 MiB
    is the C heap's and the thread stacks' slack around a step.
    """
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run([sys.executable, "-c", _MEASURE, big_vocab_llama_dir, str(MAX_NUM_SEQS)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    peak, steady = figures["peak"], figures["steady"]
    assert peak <= 1.2 * steady + 32 * MiB, {k: v / MiB for k, v in figures.items()}
    # What the profile measured for the decode step: a chunk of logits and the sampler's buffers, not the batch's
    # (256 MiB of logits alone). Measured 121-131 MiB across runs (the heap's layout moves it): half the whole
    # logits was too tight a bound, one run in four crossed it.
    whole_logits = MAX_NUM_SEQS * BIG_VOCAB * 4
    assert figures["decode_peak"] <= whole_logits * 5 // 8, figures["decode_peak"] / MiB


def simulate_available(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(kv_cache, "cpu_available_memory", lambda: (nbytes, f"simulated {nbytes / GiB:.2f} GiB"))


_REFUSE = textwrap.dedent("""
    import sys
    from pagellm import LLM
    from pagellm.worker import kv_cache

    kv_cache.cpu_available_memory = lambda: (400 << 20, "simulated 0.39 GiB")
    try:
        LLM(sys.argv[1], dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=347 << 20)
    except ValueError as refused:
        print(refused)
    else:
        print("started")
""")


def test_an_explicit_pool_that_cannot_fit_beside_the_activation_peak_is_refused_with_the_figures(tiny_llama_dir):
    # Weights (~50 MiB of parameters) and pool fit, 3 MiB to spare; with the activation peak (8-11 MiB measured)
    # they do not. In a fresh process: the peak is the growth of its resident memory, and one whose heap earlier
    # engines grew and freed reads ~0 (where float32 weights keep no second, packed copy, nothing else fails).
    result = subprocess.run([sys.executable, "-c", _REFUSE, tiny_llama_dir], capture_output=True, text=True,
                            timeout=300, check=True)
    message = result.stdout
    for figure in ("kv_cache_memory_bytes asks for a 0.34 GiB KV cache", "weights", "activation peak",
                   "decode of 8 sequences", "0.39 GiB this process may use (simulated 0.39 GiB)",
                   "lower kv_cache_memory_bytes to at most"):
        assert figure in message, message + result.stderr[-2000:]


def test_an_explicit_pool_larger_than_memory_is_refused_before_loading(tiny_llama_dir, monkeypatch):
    from pagellm.models import loader

    monkeypatch.setattr(loader, "load_model", _fail("the weights were loaded"))
    simulate_available(monkeypatch, 400 * MiB)
    with pytest.raises(ValueError, match=r"and the KV cache at least 1\.00 GiB \(kv_cache_memory_bytes=1073741824\), "
                                         r".* lower kv_cache_memory_bytes"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 * GiB)


def _fail(what: str):
    def fail(*args, **kwargs):
        raise AssertionError(what)

    return fail


def test_the_default_pool_is_sized_down_to_what_fits_and_says_so(tiny_llama_dir, monkeypatch, caplog):
    simulate_available(monkeypatch, 1 * GiB)
    with caplog.at_level(logging.WARNING, logger="pagellm.worker.memory_fit"):
        llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, max_num_seqs=8)
    worker = llm.llm_engine.core.executor.driver
    beside_pool = worker.weights_bytes + worker.activation_peak
    usable = UTILIZATION * GiB
    assert 0 < worker.kv_bytes <= usable - beside_pool
    assert worker.kv_bytes > usable - beside_pool - worker.kv_bytes / worker.num_blocks  # all that fits
    assert "sized down from the CPU default of 4 GiB" in worker.kv_reason
    assert "sized down from the CPU default of 4 GiB" in caplog.text
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_too_little_memory_for_one_request_is_refused_after_profiling(tiny_llama_dir, monkeypatch):
    from pagellm.executor import model_worker

    allocated = []
    real_allocate = model_worker.allocate_kv_cache
    monkeypatch.setattr(model_worker, "allocate_kv_cache",
                        lambda spec, *args: allocated.append(spec.num_layers) or real_allocate(spec, *args))
    # Room for the parameters and one request's blocks, but not within the default gpu_memory_utilization of it.
    simulate_available(monkeypatch, _parameter_bytes(tiny_llama_dir) + 2 * MiB)
    with pytest.raises(ValueError) as refused:
        LLM(tiny_llama_dir, dtype="float32", max_model_len=256, max_num_seqs=8)
    message = str(refused.value)
    for figure in ("cannot hold one request of max_model_len=256", "weights", "activation peak",
                   f"gpu_memory_utilization={UTILIZATION}", "Lower max_model_len, max_num_seqs"):
        assert figure in message, message
    assert allocated == [1], "only the profiling steps' one-layer scratch pool, never the pool itself"


def _parameter_bytes(model_dir: str) -> int:
    import torch
    from transformers import AutoConfig

    from pagellm.distributed.parallel_state import SINGLE
    from pagellm.worker.memory_fit import planned_model

    return planned_model(AutoConfig.from_pretrained(model_dir), 256, torch.float32, SINGLE, None).parameter_bytes


def test_weights_that_cannot_fit_are_refused_before_loading(tiny_llama_dir, monkeypatch):
    from pagellm.models import loader

    monkeypatch.setattr(loader, "load_model", _fail("the weights were loaded"))
    simulate_available(monkeypatch, 20 * MiB)
    with pytest.raises(ValueError, match=r"its weights need at least 0\.\d\d GiB \(\d+M parameters in float32\) "
                                         r"and the KV cache at least .* \(one request of max_model_len=256\)"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=256)


def test_a_gguf_file_larger_than_memory_is_refused_before_it_is_read(monkeypatch):
    from pagellm.models import loader

    monkeypatch.setattr(loader, "load_hf_config", _fail("the file was read"))
    simulate_available(monkeypatch, 8 * MiB)
    with pytest.raises(ValueError, match=r"weights need at least .* \(the size of .*\.gguf\).* kv_cache_memory_bytes"):
        LLM(kv_cache_memory_bytes=64 * MiB)


# ---- quantized checkpoints ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_llama_dirs(module_tmp_path_factory, default_tokenizer) -> dict[str, tuple[str, str | None]]:
    """A random Llama whose linear layers outweigh its embedding (vocab 512, tied), as a float checkpoint and in
    each quantized format pagellm loads: name -> (directory, quantization=)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests import w8a8_checkpoints
    from tests.quant_checkpoints import QuantSpec, write_quantized

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True)
    root = module_tmp_path_factory.mktemp("wide-llama")
    float_dir = root / "float"
    LlamaForCausalLM(config).save_pretrained(float_dir)
    default_tokenizer.save_pretrained(float_dir)
    dirs = {"float": (str(float_dir), None), "online int8": (str(float_dir), "int8")}
    for name, spec in (("awq", QuantSpec("awq")), ("gptq", QuantSpec("gptq", bits=8))):
        write_quantized(float_dir, root / name, root / f"{name}-dequantized", spec)
        dirs[name] = (str(root / name), None)
    for name, scheme, fmt in (("compressed-tensors int8", "int8-channel-dynamic", "compressed-tensors"),
                              ("fp8 block", "fp8-block-dynamic", "fp8")):
        dirs[name] = (w8a8_checkpoints.write_quantized(str(float_dir), root / name, scheme, fmt)[0], None)
    return dirs


def _planned(model_dir: str, quantization: str | None):
    import torch
    from transformers import AutoConfig

    from pagellm.distributed.parallel_state import SINGLE
    from pagellm.layers.quantization import quantization_config_for
    from pagellm.worker.memory_fit import planned_model

    config = AutoConfig.from_pretrained(model_dir)
    return planned_model(config, 256, torch.float32, SINGLE, quantization_config_for(config, quantization))


@pytest.mark.parametrize("name", ["awq", "gptq", "compressed-tensors int8", "fp8 block", "online int8"])
def test_the_planned_weights_of_a_quantized_checkpoint_are_its_own_and_at_most_what_loading_takes(
        name, wide_llama_dirs):
    import torch

    from pagellm.models import loader

    model_dir, quantization = wide_llama_dirs[name]
    planned = _planned(model_dir, quantization)
    config = loader.load_hf_config(loader.resolve_model(model_dir))[0]
    model = loader.load_model(loader.resolve_model(model_dir), config, None, torch.float32, torch.device("cpu"), 256,
                              quantization=quantization)
    assert planned.parameter_bytes <= model.weights_bytes(), "a refusal of a model that fits"
    # Counted in the checkpoint's dtypes (8 bits or fewer a weight), not as float32: the linear layers are ~94% of
    # the float model.
    assert planned.parameter_bytes < 0.4 * _planned(*wide_llama_dirs["float"]).parameter_bytes
    if quantization is None:
        assert f"the {config.quantization_config['quant_method']} layers' in the dtypes they load in" in \
            planned.described


@pytest.mark.parametrize("name", ["awq", "fp8 block"])
def test_a_quantized_model_that_fits_is_loaded_where_its_float_parameter_count_would_not(
        name, wide_llama_dirs, monkeypatch):
    from pagellm.models import loader

    class Loading(Exception):
        pass

    def loading(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(loader, "load_model", loading)
    pool = 1 * MiB
    float_bytes = _planned(*wide_llama_dirs["float"]).parameter_bytes
    simulate_available(monkeypatch, _planned(wide_llama_dirs[name][0], None).parameter_bytes + pool + MiB)
    assert float_bytes + pool > kv_cache.cpu_available_memory()[0]
    with pytest.raises(Loading):
        LLM(wide_llama_dirs[name][0], dtype="float32", max_model_len=256, kv_cache_memory_bytes=pool)
    with pytest.raises(ValueError, match=r"its weights need at least .*parameters in float32"):
        LLM(wide_llama_dirs["float"][0], dtype="float32", max_model_len=256, kv_cache_memory_bytes=pool)


# ---- reading what the process may use ----------------------------------------------------------------------


def fake_proc(tmp_path, available_kib: int, cgroup_lines: str):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    return proc


def write_files(directory, **files) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text)


def test_mem_available_is_the_limit_without_cgroup_limits(tmp_path):
    proc = fake_proc(tmp_path, 4 * 1024 * 1024, "0::/user.slice\n")
    cgroup = tmp_path / "cgroup"
    write_files(cgroup / "user.slice", memory__max="max\n", memory__current="123\n")
    assert cpu_available_memory(proc, cgroup) == (4 * GiB, "MemAvailable 4.00 GiB")


def test_the_tightest_cgroup_v2_limit_up_the_tree_wins_less_its_usage_but_not_its_page_cache(tmp_path):
    proc = fake_proc(tmp_path, 16 * 1024 * 1024, "0::/a/b\n")
    cgroup = tmp_path / "cgroup"
    write_files(cgroup / "a", memory__max=f"{3 * GiB}\n", memory__current=f"{1 * GiB}\n",
                memory__stat=f"anon 1\ninactive_file {GiB // 2}\n")
    write_files(cgroup / "a" / "b", memory__max="max\n", memory__current="5\n")
    available, described = cpu_available_memory(proc, cgroup)
    assert available == 3 * GiB - (GiB - GiB // 2)
    assert described.startswith("cgroup limit 3.00 GiB - 0.50 GiB in use")


def test_a_cgroup_v1_limit_at_the_mount_root_counts_inside_a_container(tmp_path):
    # Without a cgroup namespace the process's path names a directory the container's mount does not have.
    proc = fake_proc(tmp_path, 16 * 1024 * 1024, "5:cpu,cpuacct:/docker/x\n4:memory:/docker/x\n")
    memory = tmp_path / "cgroup" / "memory"
    write_files(memory, memory__limit_in_bytes=f"{2 * GiB}\n", memory__usage_in_bytes=f"{GiB // 4}\n",
                memory__stat="total_inactive_file 0\n")
    assert cpu_available_memory(proc, tmp_path / "cgroup")[0] == 2 * GiB - GiB // 4


def test_an_unlimited_cgroup_v1_reads_as_no_limit(tmp_path):
    proc = fake_proc(tmp_path, 1024, "4:memory:/\n")
    write_files(tmp_path / "cgroup" / "memory", memory__limit_in_bytes="9223372036854771712\n",
                memory__usage_in_bytes="5\n")
    assert cpu_available_memory(proc, tmp_path / "cgroup")[0] == 1024 * 1024
