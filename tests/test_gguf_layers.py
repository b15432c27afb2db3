"""GGUF weights in the layer library (layers/quantization/gguf.py): blocks loaded into fused layers per shard
(each shard keeping its own type), tensor-parallel slices of rows and of input blocks, the embedding gathering
only its rows, float tensors and types without a kernel dense, and the memory they take."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagellm.distributed.parallel_state import TensorParallelGroup, building_with
from pagellm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagellm.layers.quantization.gguf import GGUFConfig, GGUFWeight
from pagellm.layers.vocab_embedding import VocabEmbedding
from pagellm.layers.weights import weights_bytes
from pagellm.models.loader import default_dtype
from pagellm.ops.gguf_kernels import TorchGGUFOps
from tests.test_gguf_kernels import dequantized, random_weight


def _gguf(type_name: str, rows: int, cols: int, seed: int) -> tuple[GGUFWeight, torch.Tensor]:
    """A random weight in `type_name`'s blocks, and its exact float values."""
    blocks = random_weight(type_name, rows, cols, seed)
    return GGUFWeight(blocks, type_name, rows, cols), torch.from_numpy(dequantized(blocks, type_name, cols)).float()


def _exact_ops(layer) -> None:
    """Multiply exactly (dequantize, then F.linear), so that results compare with the float product."""
    layer.quant_method.ops = TorchGGUFOps()


def test_fused_shards_keep_their_own_types_and_multiply_as_one_layer():
    config = GGUFConfig()
    with default_dtype(torch.float32):
        qkv = QKVParallelLinear(256, 32, num_heads=4, num_kv_heads=2, bias=False, quant_config=config,
                                prefix="model.layers.0.self_attn.qkv_proj")
    _exact_ops(qkv)
    q, q_ref = _gguf("Q4_K", 128, 256, 1)
    k, k_ref = _gguf("Q4_K", 64, 256, 2)
    v, v_ref = _gguf("Q6_K", 64, 256, 3)  # as Q4_K_M stores attn_v
    for shard, weight in (("q", q), ("k", k), ("v", v)):
        qkv.weight.weight_loader(qkv.weight, weight, shard)
    qkv.process_weights_after_loading()
    # q and k form one Q4_K product, v a Q6_K one; both views of a single buffer, the layer's weight.
    assert [(p.type_name, p.rows) for p in qkv.quantized_parts] == [("Q4_K", 192), ("Q6_K", 64)]
    assert qkv.weight.numel() == sum(w.data.numel() for w in (q, k, v))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    expected = F.linear(x, torch.cat([q_ref, k_ref, v_ref]))
    torch.testing.assert_close(qkv(x), expected, rtol=1e-4, atol=1e-3)


def test_tensor_parallel_ranks_take_their_rows_and_input_blocks():
    config = GGUFConfig()
    gate, gate_ref = _gguf("Q8_0", 96, 512, 4)
    up, up_ref = _gguf("Q8_0", 96, 512, 5)
    down, down_ref = _gguf("Q4_K", 64, 512, 6)  # 512 inputs split over 2 ranks: one super-block each
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    for rank in range(2):
        with building_with(TensorParallelGroup(rank, 2)), default_dtype(torch.float32):
            gate_up = MergedColumnParallelLinear(512, [96, 96], False, config, "mlp.gate_up_proj")
            down_proj = RowParallelLinear(512, 64, False, config, "mlp.down_proj", reduce_results=False)
        for layer in (gate_up, down_proj):
            _exact_ops(layer)
        gate_up.weight.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight.weight_loader(gate_up.weight, up, 1)
        down_proj.weight.weight_loader(down_proj.weight, down, None)
        for layer in (gate_up, down_proj):
            layer.process_weights_after_loading()
        rows = slice(48 * rank, 48 * (rank + 1))
        expected = F.linear(x, torch.cat([gate_ref[rows], up_ref[rows]]))
        torch.testing.assert_close(gate_up(x), expected, rtol=1e-4, atol=1e-3)
        cols = slice(256 * rank, 256 * (rank + 1))
        torch.testing.assert_close(down_proj(x[:, cols]), F.linear(x[:, cols], down_ref[:, cols]), rtol=1e-4,
                                   atol=1e-3)


def test_a_row_parallel_split_inside_a_block_is_refused():
    weight, _ = _gguf("Q4_K", 64, 512, 7)
    with building_with(TensorParallelGroup(0, 4)), default_dtype(torch.float32):
        layer = RowParallelLinear(512, 64, False, GGUFConfig(), "mlp.down_proj", reduce_results=False)
    with pytest.raises(ValueError, match="not a positive multiple of Q4_K's block of 256"):
        layer.weight.weight_loader(layer.weight, weight, None)


def test_the_embedding_gathers_its_rows_and_serves_as_the_tied_head():
    table, table_ref = _gguf("Q6_K", 40, 256, 8)
    with default_dtype(torch.float32):
        embedding = VocabEmbedding(40, 256, GGUFConfig(), "model.embed_tokens")
    embedding.serves_lm_head = True
    embedding.weight.weight_loader(embedding.weight, table, None)
    embedding.process_weights_after_loading()
    ids = torch.tensor([[3, 39], [0, 3]])
    torch.testing.assert_close(embedding(ids), table_ref[ids])
    assert embedding.weight.dtype == torch.uint8 and weights_bytes(embedding) == table.data.numel()
    _exact_ops(embedding)
    hidden = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(embedding.matmul(hidden), F.linear(hidden, table_ref), rtol=1e-4, atol=1e-3)


def test_float_tensors_and_kernel_less_types_run_dense(monkeypatch):
    config = GGUFConfig()
    with default_dtype(torch.float32):
        float_layer = MergedColumnParallelLinear(64, [16, 16], False, config, "a")
        odd_layer = MergedColumnParallelLinear(256, [32, 32], False, config, "b")
    dense = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    float_layer.weight.weight_loader(float_layer.weight, dense, 0)
    float_layer.weight.weight_loader(float_layer.weight, dense * 2, 1)
    float_layer.process_weights_after_loading()
    assert float_layer.quantized_parts is None and float_layer.dense_kernel is not None
    x = torch.randn(2, 64)
    torch.testing.assert_close(float_layer(x), F.linear(x, torch.cat([dense, dense * 2])), rtol=1e-5, atol=1e-5)
    # A type the kernels cannot take falls back to dense for that layer.
    monkeypatch.setattr(config.method.ops, "supports", lambda type_name: type_name != "Q5_K")
    gate, gate_ref = _gguf("Q5_K", 32, 256, 9)
    up, up_ref = _gguf("Q5_K", 32, 256, 10)
    odd_layer.weight.weight_loader(odd_layer.weight, gate, 0)
    odd_layer.weight.weight_loader(odd_layer.weight, up, 1)
    odd_layer.process_weights_after_loading()
    assert odd_layer.quantized_parts is None
    x = torch.randn(2, 256)
    torch.testing.assert_close(odd_layer(x), F.linear(x, torch.cat([gate_ref, up_ref])), rtol=1e-4, atol=1e-4)


def test_a_gguf_model_keeps_its_blocks_in_memory(tmp_path):
    """The default SmolLM2 GGUF (Q4_1 and Q8_0 blocks, F32 norms): the model's weights take about the file's
    bytes, not the 4.5x a float32 copy took."""
    from pagellm.models import loader
    from pagellm.models.gguf_loader import default_model_path

    source = loader.resolve_model(None)
    config, tensors = loader.load_hf_config(source)
    model = loader.load_model(source, config, tensors, torch.float32, torch.device("cpu"), 256)
    file_bytes = default_model_path().stat().st_size
    assert weights_bytes(model) <= 1.05 * file_bytes, (weights_bytes(model), file_bytes)
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8
    assert np.isclose(tensors.type_counts()["F32"], 2 * config.num_hidden_layers + 1)
