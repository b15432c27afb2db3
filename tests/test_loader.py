"""Loading: sharded HF checkpoints through model.safetensors.index.json, the target dtype, dummy weights."""

from __future__ import annotations

import json

import pytest
import torch

from pagellm.models import loader


@pytest.fixture(scope="module")
def sharded_dir(module_tmp_path_factory, hf_tiny):
    path = module_tmp_path_factory.mktemp("sharded")
    hf_tiny.save_pretrained(path, max_shard_size="100KB")
    return path


def _load(path, dtype, load_format="auto"):
    source = loader.resolve_model(str(path))
    config, _ = loader.load_hf_config(source)
    return loader.load_model(source, config, None, dtype, torch.device("cpu"), 64, load_format)


def test_sharded_checkpoint_loads_through_its_index(sharded_dir, hf_tiny):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # A stray file the index does not name (say a consolidated copy) is not read: it would load twice.
    (sharded_dir / "consolidated.safetensors").write_bytes((sharded_dir / index["weight_map"]["lm_head.weight"])
                                                             .read_bytes())
    # float16: a bfloat16 model on a CPU with bf16 instructions keeps only oneDNN-packed linear weights.
    model = _load(sharded_dir, torch.float16)
    reference = hf_tiny.state_dict()
    assert model.lm_head.weight.dtype == torch.float16
    assert torch.equal(model.lm_head.weight, reference["lm_head.weight"].to(torch.float16))
    q = reference["model.layers.1.self_attn.q_proj.weight"].to(torch.float16)
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[: q.shape[0]], q)


def test_index_naming_a_missing_file_says_so(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        loader.checkpoint_files(tmp_path)


def test_dummy_weights_are_small_random_and_in_the_target_dtype(sharded_dir):
    model = _load(sharded_dir, torch.float16, load_format="dummy")
    weights = [p for p in model.parameters()]
    assert all(p.dtype == torch.float16 for p in weights)
    flat = torch.cat([p.detach().float().flatten() for p in weights])
    assert flat.abs().max() <= 1.001e-3 and flat.std() > 1e-4
    again = _load(sharded_dir, torch.float16, load_format="dummy")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight), "seeded: the same weights every time"
