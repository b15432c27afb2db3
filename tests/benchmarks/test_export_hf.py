"""export_hf writes the GGUF's weights as an HF directory that transformers loads to the same tensors."""

from __future__ import annotations

import torch
import transformers

from benchmarks.export_hf import export
from pagellm.models.gguf_loader import load_gguf
from tests.test_gguf_loader import write_tiny_gguf


def test_exported_directory_loads_the_same_weights(tmp_path):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, "llama", tied=False)
    export(gguf_path, tmp_path / "hf", with_tokenizer=False)  # the tiny file carries no vocabulary

    _, expected = load_gguf(gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    loaded = model.state_dict()
    assert set(expected) <= set(loaded)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_throughput_parses_the_vllm_engine_options():
    from benchmarks import throughput

    args = throughput.parse_args(["--engine", "vllm", "--enforce-eager", "--model", "/some/dir"])
    assert (args.engine, args.enforce_eager, args.model) == ("vllm", True, "/some/dir")
    assert throughput.parse_args([]).engine == "pagellm"
