"""Shared fixtures: a tiny random Llama (with the default model's real tokenizer) saved like a HF checkpoint."""

from __future__ import annotations

import os
import pathlib
import shutil

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: each is the other's busy neighbour, so libgomp's threads (of the
    # workers and of the servers they start, which inherit this) spin briefly and then sleep, as pagellm chooses
    # for shared CPUs (pagellm/cpu_threads.py). Before torch loads libgomp, which reads it once.
    from pagellm.cpu_threads import configure_openmp_wait

    configure_openmp_wait(os.environ, busy_cpus=1.0)

import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Triton's kernels run under its interpreter where there is no GPU (tests/test_triton_kernels.py). Triton reads this
# switch as it decorates its own library functions, at its first import, which some tests trigger indirectly.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

@pytest.fixture(autouse=True)
def _no_step_timings(request, monkeypatch):
    """Engines in tests measure no step times: speculation then sizes drafts by acceptance alone, as it does
    before its first measurement, so that which steps draft never depends on how busy the test machine is.
    Tests marked step_timings (of the cost model itself) keep them."""
    if request.node.get_closest_marker("step_timings"):
        return
    from pagellm.spec_decode.speculator import Speculator

    monkeypatch.setattr(Speculator, "record_step", lambda self, num_tokens, decode_only, seconds: None)


# Reproducible property tests: derandomized, no wall-clock deadline on a loaded 2-core machine.
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=60, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TINY_CONFIG = dict(
    # head_dim 32 (128 / 4): the smallest head size the native CPU decode kernel takes
    # (pagellm/attention/native.py DecodeKernel.supports), so every engine test runs the kernel users run.
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    # A wide init gives peaked logits, so that greedy argmax is not decided by 1e-7 rounding.
    initializer_range=0.3,
)


@pytest.fixture(scope="session")
def default_tokenizer():
    from pagellm.models.gguf_loader import default_model_path, load_gguf_tokenizer

    return load_gguf_tokenizer(default_model_path())


def _save_tiny(path, tokenizer, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **{**TINY_CONFIG, **overrides},
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class ModuleTempPathFactory:
    """`tmp_path_factory.mktemp` for module-scoped fixtures: their directories go when the module's tests are done.

    A checkpoint with the real tokenizer's 49,152-row embedding takes 50-100 MiB, and the suite writes a few
    hundred; kept to the session's end (pytest's default), one run filled ~10 GiB of /tmp and a nearly full disk
    failed it midway."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._made: list[pathlib.Path] = []

    def mktemp(self, basename: str, numbered: bool = True) -> pathlib.Path:
        path = self._factory.mktemp(basename, numbered)
        self._made.append(path)
        return path

    def remove_all(self) -> None:
        for path in self._made:
            shutil.rmtree(path, ignore_errors=True)
        self._made.clear()


@pytest.fixture(scope="module")
def module_tmp_path_factory(tmp_path_factory):
    factory = ModuleTempPathFactory(tmp_path_factory)
    yield factory
    factory.remove_all()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_tokenizer) -> str:
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), default_tokenizer)


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_smollm2():
    from pagellm.models.gguf_loader import default_model_path
    from tests.helpers import hf_load_gguf

    return hf_load_gguf(default_model_path())


@pytest.fixture
def torch_ops_only(monkeypatch):
    """The model without pagellm's C kernels (the families' torch path): PAGELLM_NATIVE_KERNELS=0 and the loaded
    library forgotten for the test's duration."""
    from pagellm.ops import cpu_build

    monkeypatch.setenv("PAGELLM_NATIVE_KERNELS", "0")
    cpu_build.native_library.cache_clear()
    yield
    monkeypatch.delenv("PAGELLM_NATIVE_KERNELS")
    cpu_build.native_library.cache_clear()


@pytest.fixture
def dequantized_tiles(monkeypatch):
    """The GGUF kernels multiply on dequantized weight tiles (a float32 GEMM) at every row count: products equal to
    the dequantized blocks' up to summation order, where their int8 products (activations rounded per 32) can flip
    a near-tied greedy token of a tiny random model."""
    from pagellm.ops import gguf_kernels as gk

    for isa in gk.DENSE_MIN_ROWS:
        monkeypatch.setitem(gk.DENSE_MIN_ROWS, isa, dict.fromkeys(gk.KERNEL_TYPES, 1))
    monkeypatch.setattr(gk.GGUFKernels, "tile_threshold", lambda self, type_name, dtype: None)
