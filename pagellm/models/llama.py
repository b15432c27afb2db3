"""The Llama architecture (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache: a graph of the layers in
pagellm/layers/, which hold the weight formats, fused projections and tensor-parallel shards.

Parameter names follow HuggingFace's, except that q/k/v and gate/up are fused into one product each (their
checkpoint tensors load straight into their shard of it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from pagellm.attention.paged import AttentionMetadata, paged_attention
from pagellm.distributed.parallel_state import current_group
from pagellm.layers.activation import SiluAndMul, gated_activation
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagellm.layers.quantization.base import QuantizationConfig
from pagellm.layers.rotary import RopeInputs, RotaryEmbedding, apply_rotary
from pagellm.layers.vocab_embedding import ParallelLMHead, VocabEmbedding, head_output, lm_head_mode
from pagellm.layers.weights import default_weight_loader, weights_bytes
from pagellm.models.sliding_window import layer_sliding_window
from pagellm.ops.cpu_ops import CpuOps
from pagellm.ops.decode_stack import DecodeStack

# Checkpoint tensor names -> (fused parameter, shard), as the fused layers name their shards.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def allowed_tensor_parallel_sizes(config, expert_parallel: bool = False) -> list[int]:
    """Sizes that split query heads and the MLP evenly, KV heads evenly or by whole replication, and (without
    expert parallelism, which places whole experts instead) each expert's intermediate features evenly."""
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    expert_inter = None if expert_parallel else getattr(config, "moe_intermediate_size", None)
    return [n for n in range(1, heads + 1)
            if heads % n == 0 and inter % n == 0 and (kv % n == 0 or n % kv == 0)
            and (not expert_inter or expert_inter % n == 0)]


def check_tensor_parallel_size(config, size: int, expert_parallel: bool = False) -> None:
    allowed = allowed_tensor_parallel_sizes(config, expert_parallel)
    if size not in allowed:
        experts = getattr(config, "moe_intermediate_size", None)
        expert_part = (f", moe_intermediate_size={experts}" if experts and not expert_parallel else "")
        raise ValueError(
            f"tensor_parallel_size={size} cannot split this model (num_attention_heads="
            f"{config.num_attention_heads}, num_key_value_heads={config.num_key_value_heads}, intermediate_size="
            f"{config.intermediate_size}{expert_part}): each rank needs whole query heads, an equal share of the "
            f"MLP{' and of every expert' if expert_part else ''}, and KV heads split evenly or replicated whole; "
            f"allowed sizes: {allowed}."
            + (" With enable_expert_parallel each rank holds whole experts instead." if expert_part else "")
        )


class LlamaAttention(nn.Module):
    ops: CpuOps | None = None

    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.layer_index = layer_index
        bias = bool(getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False))
        if getattr(config, "model_type", "") == "qwen2":
            bias = True
        # Column-parallel q/k/v (this rank's heads), row-parallel o_proj (Megatron's split).
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias, quant_config, f"{prefix}.qkv_proj")
        self.num_heads = self.qkv_proj.heads.num_q
        self.num_kv_heads = self.qkv_proj.heads.num_kv
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bool(getattr(config, "attention_bias", False)), quant_config,
                                        f"{prefix}.o_proj")
        self.scale = self.head_dim**-0.5
        self.sliding_window = layer_sliding_window(config, layer_index)

    def forward(
        self,
        rope: RopeInputs,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.ops is not None:
            # Query and key heads lead each row of qkv: rotate them where they are.
            self.ops.rotary_inplace(qkv, self.num_heads + self.num_kv_heads, self.head_dim, rope.tables.cos,
                                    rope.tables.sin, rope.positions)
        q, k, v = self.split_heads(qkv)
        if self.ops is None:
            q, k = apply_rotary(q, k, (rope.cos, rope.sin))
        return self.attend(q, k, v, kv_cache, meta)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q + 2 kv] -> views q [T, heads, head_dim], k and v [T, kv_heads, head_dim]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """Paged attention of this step's rotated q/k and v, through this layer's window, then o_proj."""
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                              sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    # The config field that names the activation (Gemma's is `hidden_activation`).
    activation_field = "hidden_act"

    def __init__(self, config, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        # This rank's share of the intermediate features: gate/up split by columns, down_proj by rows.
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias,
                                                       quant_config, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias, quant_config,
                                           f"{prefix}.down_proj")
        self.act_fn = gated_activation(self.activation_name(config), self.activation_field)

    def activation_name(self, config) -> str | None:
        return getattr(config, self.activation_field, "silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


@dataclass(frozen=True, slots=True)
class DirectLayer:
    """A LlamaDecoderLayer's weights and products as its module calls reach them, for LlamaModel's direct path."""

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_counts: tuple[int, int, int]  # of q, k and v
    scale: float
    sliding_window: int | None


class LlamaDecoderLayer(nn.Module):
    # Families whose attention or MLP differ (pagellm/models/qwen3.py, ...) swap these in a subclass.
    attention_class: type[LlamaAttention] = LlamaAttention
    mlp_class: type[LlamaMLP] = LlamaMLP

    def __init__(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_index, quant_config, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(config, layer_index, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer_index: int, quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """This layer's MLP (mixture-of-experts families choose per layer between experts and a dense MLP)."""
        return self.mlp_class(config, quant_config, prefix)

    def forward(self, rope, hidden, residual, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream travels beside the layer's output, so each norm can add it in (fused)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def plain(self, ops: CpuOps) -> bool:
        """Whether `forward` is Llama's own on the fused CPU ops `ops`: Llama's classes (a family's subclass may
        compute otherwise), SiLU, RMSNorm, every one of them on `ops`. The direct path and the decode stack make
        the calls such a layer makes, and only those."""
        attn, mlp = self.self_attn, self.mlp
        norms = (self.input_layernorm, self.post_attention_layernorm)
        # The MLP's class first: a mixture-of-experts block in its place has no act_fn.
        if type(mlp) is not LlamaMLP:
            return False
        return not (type(self) is not LlamaDecoderLayer or type(attn) is not LlamaAttention
                    or type(mlp.act_fn) is not SiluAndMul or any(type(norm) is not RMSNorm for norm in norms)
                    or any(module.ops is not ops for module in (attn, mlp.act_fn, *norms)))

    def direct(self, ops: CpuOps) -> DirectLayer | None:
        """This layer as a DirectLayer, where it is `plain` and its linear layers have a prepared product
        (layers/linear.py's direct_product); else None. (Hooks on its modules, its linear layers included, are
        checked at every forward: LlamaModel.direct_layers.)"""
        if not self.plain(ops):
            return None
        attn, mlp = self.self_attn, self.mlp
        norms = (self.input_layernorm, self.post_attention_layernorm)
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        products = [linear.direct_product() for linear in linears]
        if any(product is None for product in products):
            return None
        head_counts = (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads)
        return DirectLayer(norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps, *products, attn.num_heads,
                           attn.num_kv_heads, attn.head_dim, head_counts, attn.scale, attn.sliding_window)


def run_direct_layers(layers: list[DirectLayer], ops: CpuOps, rope: RopeInputs, hidden: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LlamaDecoderLayer.forward of each layer in turn, as the same kernel calls without the module calls and
    wrappers between them (much of a small model's host work per decode step): (hidden, residual) after the last."""
    cos, sin, positions = rope.tables.cos, rope.tables.sin, rope.positions
    attention = paged_attention  # read at each call: benchmarks/gguf_step.py wraps it to time it
    residual = None
    for layer, (k_cache, v_cache) in zip(layers, kv_caches):
        if residual is None:
            residual = hidden
            x = ops.add_rms_norm(hidden, None, layer.input_norm, layer.input_eps)
        else:
            x = ops.add_rms_norm(hidden, residual, layer.input_norm, layer.input_eps)
        qkv = layer.qkv(x)
        heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        ops.rotary_inplace(qkv, heads + kv_heads, head_dim, cos, sin, positions)
        # The views split_heads makes ([T, heads, head_dim] q, k and v), in two calls instead of four.
        q, k, v = qkv.view(-1, heads + 2 * kv_heads, head_dim).split_with_sizes(layer.head_counts, 1)
        out = attention(q, k, v, k_cache, v_cache, meta, layer.scale, layer.sliding_window)
        x = ops.add_rms_norm(layer.o(out.reshape(-1, heads * head_dim)), residual, layer.post_norm, layer.post_eps)
        hidden = layer.down(ops.silu_and_mul(layer.gate_up(x)))
    return hidden, residual


def _hook_registries(modules: list[nn.Module]) -> list[dict]:
    """The dicts torch registers `modules`' forward (pre-)hooks in, and the global ones: register_forward_hook
    and its kin add to these dicts in place, so a list of them made once sees every later registration."""
    registries: list[dict] = [torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks]
    for module in modules:
        registries += [module._forward_hooks, module._forward_pre_hooks]
    return registries


def _hooked(registries: list[dict]) -> bool:
    """Whether any of `registries` (_hook_registries') holds a hook: one pass in C over the dicts, where reading
    two attributes of each of a 30-layer model's 300 modules took several times as long every step."""
    return any(registries)


class LlamaModel(nn.Module):
    # With the fused kernels, rotary runs in place per layer and needs no per-step cos/sin gather.
    ops: CpuOps | None = None
    decoder_layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # direct_layers()'s: whether made since use_cpu_ops / reset_direct_layers, and the layers.
    _direct_made = False
    _direct: list[DirectLayer] | None = None
    _direct_hooks: list[dict] = []
    # The layers' pure-decode steps in one C call (ops/decode_stack.py), where they can be.
    _decode_stack: DecodeStack | None = None

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, quant_config,
                                           f"{prefix}.embed_tokens")
        self.rotary = self.make_rotary(config, max_positions)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i, quant_config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_rotary(self, config, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(config, head_dim_of(config), max_positions)

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """The step's rotary inputs: the fused kernel reads the whole tables, the torch path the step's cos/sin."""
        cos, sin = (None, None) if self.ops is not None else self.rotary.lookup(positions, dtype)
        return RopeInputs(positions, cos, sin, self.rotary)

    def _make_direct(self) -> None:
        """The direct layers and the decode stack, at the first forward since use_cpu_ops or reset_direct_layers."""
        plain = self.ops is not None and all(layer.plain(self.ops) for layer in self.layers)
        direct = [layer.direct(self.ops) for layer in self.layers] if plain else [None]
        self._direct = None if any(layer is None for layer in direct) else direct
        self._decode_stack = DecodeStack.build(list(self.layers), self.ops) if plain else None
        # A plain layer's modules, all of them: a hook on any sends the step back to the modules.
        self._direct_hooks = [] if not plain else _hook_registries([
            module for layer in self.layers
            for module in (layer, layer.self_attn, layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.mlp.act_fn,
                           layer.input_layernorm, layer.post_attention_layernorm)])
        self._direct_made = True

    def direct_layers(self) -> list[DirectLayer] | None:
        """Every layer as a DirectLayer (made at the first call since use_cpu_ops or reset_direct_layers), or None
        where one cannot be, or while a forward hook is registered on any of their modules (or globally): the
        layers then run as modules, and the hooks run."""
        if not self._direct_made:
            self._make_direct()
        if self._direct is not None and _hooked(self._direct_hooks):
            return None
        return self._direct

    def decode_stack(self) -> DecodeStack | None:
        """The decode stack (made with the direct layers), or None where there is none or a hook is registered as
        for direct_layers. Unlike the direct path it takes linear layers of several GGUF parts (a Q4_K_M file's
        qkv whose v has its own type)."""
        if not self._direct_made:
            self._make_direct()
        if self._decode_stack is not None and _hooked(self._direct_hooks):
            return None
        return self._decode_stack

    def reset_direct_layers(self) -> None:
        """Make the DirectLayers again at the next forward: whoever attaches LoRA slots to the layers after a
        forward (lora/manager.py) calls this, so that the layers run as modules from then on."""
        self._direct_made = False

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Runs as many layers as `kv_caches` has entries (all of them, except in profiling runs)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        rope = self.rope_inputs(positions, hidden.dtype)
        stack = self.decode_stack()
        if stack is not None and stack.serves(hidden, rope, kv_caches, meta):
            hidden, residual = stack(hidden, rope, kv_caches, meta)
        elif (direct := self.direct_layers()) is not None:
            hidden, residual = run_direct_layers(direct, self.ops, rope, hidden, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                hidden, residual = layer(rope, hidden, residual, kv_cache, meta)
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Built for the tensor-parallel group current at construction (see parallel_state.building_with):
    this rank's heads and MLP share; the embedding replicated; the LM head replicated on rank 0 or split by
    vocabulary (layers/vocab_embedding.py). Other families subclass it (pagellm/models/registry.py lists them)
    and swap `model_class`."""

    model_class: type[nn.Module] = LlamaModel

    def __init__(self, config, max_positions: int, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.group = current_group()
        # The activations' dtype: the model is built with it as the default (weights may be stored otherwise).
        self.activation_dtype = torch.get_default_dtype()
        self.quant_config = quant_config
        self.model = self.model_class(config, max_positions, quant_config)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        vocab_parallel = self.group.size > 1 and lm_head_mode() == "vocab_parallel"
        # A tied head on one rank is the embedding itself; split by vocabulary each rank holds a copy of its rows.
        self.tied_to_embedding = tied and not vocab_parallel
        self.loads_embedding_into_head = tied and vocab_parallel
        if self.tied_to_embedding:
            self.model.embed_tokens.serves_lm_head = True
            self.lm_head: LinearBase = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config, "lm_head",
                                          vocab_parallel)

    @property
    def weight_format(self) -> str:
        """How the weights are stored, for the start-up log (after loading: a method names its kernels then)."""
        return self.quant_config.describe() if self.quant_config is not None else "unquantized"

    @property
    def num_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.num_heads

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] in float32 on rank 0; None on the other tensor-parallel ranks."""
        output = self.compute_head(hidden)
        return None if output is None else self.finish_logits(output)

    def compute_head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head's output in the activations' dtype (compute_logits in two steps, see worker/logits.py)."""
        return head_output(self.lm_head, hidden, self.config.vocab_size)

    def finish_logits(self, output: torch.Tensor) -> torch.Tensor:
        """Float32 logits of rows of compute_head's output (which a float32 output's rows may be, changed in
        place)."""
        return output.float()

    def weights_bytes(self) -> int:
        return weights_bytes(self)

    def use_cpu_ops(self, ops: CpuOps) -> None:
        """Run norms, rotary and SiLU-and-multiply on the fused CPU kernels (float32 or bfloat16)."""
        for module in self.modules():
            if isinstance(module, (LlamaModel, RMSNorm, LlamaAttention, SiluAndMul)):
                module.ops = ops
            if isinstance(module, LlamaModel):
                module.reset_direct_layers()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors (any format the layers' methods take); every parameter must be covered and
        no tensor left over."""
        params = dict(self.named_parameters())
        expected = _expected_loads(self)
        loaded: set[tuple[str, object]] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tied_to_embedding and name.startswith("lm_head."):
                continue  # some tied checkpoints store the head too: it is the embedding
            targets = [self.checkpoint_target(name)]
            if self.loads_embedding_into_head and name.startswith("model.embed_tokens."):
                targets.append((name.replace("model.embed_tokens.", "lm_head."), None))
            for target, shard in targets:
                if target is None:
                    continue  # another rank's (an expert it holds under expert parallelism)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                param = params[target]
                param.checkpoint_name = name
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
                # A fused checkpoint tensor (shard None) fills every shard of its layer.
                loaded.update((target, s) for s in (getattr(param, "shard_ids", (None,)) if shard is None else (shard,)))
        missing = sorted(f"{name}" + (f" ({shard})" if shard is not None else "")
                         for name, shard in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


    def checkpoint_target(self, name: str) -> tuple[str | None, object]:
        """(parameter name, shard) a checkpoint tensor loads into; (None, None) for one this rank does not hold."""
        return _fused_target(name)


def _expected_loads(model: nn.Module) -> set[tuple[str, object]]:
    """(parameter, shard) pairs a complete checkpoint fills: every shard of each fused layer's parameters."""
    shards_of = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LinearBase):
            for param_name, _ in module.named_parameters(recurse=False):
                shards_of[f"{module_name}.{param_name}" if module_name else param_name] = module.shard_ids
    # Other parameters filled in parts say which (a FusedMoE's: one (expert, shard) pair per checkpoint tensor).
    return {(name, shard) for name, param in model.named_parameters()
            for shard in shards_of.get(name, getattr(param, "shard_ids", (None,)))}


def _fused_target(name: str) -> tuple[str, object]:
    for fused, shard_name, shard in STACKED_PARAMS:
        if f".{shard_name}." in name:
            return name.replace(f".{shard_name}.", f".{fused}."), shard
    return name, None
