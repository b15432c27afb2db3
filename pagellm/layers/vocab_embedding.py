"""The token embedding and the LM head.

The embedding is replicated on every rank and stored as its weight method keeps it (a GGUF table stays in its
blocks: a lookup dequantizes only the rows it gathers). The LM head is replicated on rank 0 (the other ranks
compute no logits) or split by vocabulary over the ranks (PAGELLM_TP_LM_HEAD=vocab_parallel, rank 0 gathers);
a tied head is the embedding layer itself, multiplied as a linear layer, so it shares the table's memory."""

from __future__ import annotations

import os

import torch
from torch import nn

from pagellm.distributed.parallel_state import current_group
from pagellm.layers.linear import LinearBase, OutputPiece, ShardId
from pagellm.layers.quantization.base import QuantizationConfig

LM_HEAD_MODES = ("replicated", "vocab_parallel")


def lm_head_mode() -> str:
    """How the LM head runs under tensor parallelism (PAGELLM_TP_LM_HEAD): "vocab_parallel", each rank
    computing the logits of its slice of the vocabulary and rank 0 gathering them, or "replicated", rank 0
    alone running the whole head. README ("Tensor parallelism") has the measurement behind the default."""
    mode = os.environ.get("PAGELLM_TP_LM_HEAD", "replicated")
    if mode not in LM_HEAD_MODES:
        raise ValueError(f"PAGELLM_TP_LM_HEAD={mode!r} is not a mode; use one of {LM_HEAD_MODES}.")
    return mode


class VocabEmbedding(LinearBase):
    """[vocab, hidden] on every rank: its rows are looked up by token, and, tied, it is the LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__(hidden_size, [vocab_size], False, quant_config, prefix, current_group())
        self.vocab_size = vocab_size
        self.serves_lm_head = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.quant_method.embedding(self, input_ids)

    def process_weights_after_loading(self) -> None:
        # Lookups read the table as loaded; prepared for matmuls too only if it is the LM head.
        self.shares_weight = True
        self.serves_matmul = self.serves_lm_head
        super().process_weights_after_loading()


class ParallelLMHead(LinearBase):
    """This rank's rows of the LM head: all of them on rank 0 (none elsewhere), or a ceil share of the
    vocabulary split by rank (the last rank's tail is padding, whose logits the gather trims off)."""

    def __init__(self, vocab_size: int, hidden_size: int, quant_config: QuantizationConfig | None, prefix: str,
                 vocab_parallel: bool) -> None:
        group = current_group()
        self.vocab_size = vocab_size
        self.vocab_parallel = vocab_parallel
        rows = -(-vocab_size // group.size) if vocab_parallel else (vocab_size if group.rank == 0 else 0)
        super().__init__(hidden_size, [rows], False, quant_config, prefix, group)

    def pieces(self, shard: ShardId) -> list[OutputPiece]:
        start = self.group.rank * self.output_size if self.vocab_parallel else 0
        return [OutputPiece(start, max(0, min(self.output_size, self.vocab_size - start)), 0)]

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, shard: ShardId = None) -> None:
        if self.output_size == 0:
            return  # a replicated head lives on rank 0 only
        param.data.zero_()  # padding rows past the vocabulary
        super().weight_loader(param, tensor, shard)


def head_output(head: LinearBase, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """The LM head's output [rows, vocab] in its own dtype on rank 0; None on the other tensor-parallel ranks."""
    group = head.group
    if getattr(head, "vocab_parallel", False):
        logits = group.gather_to_first(head.matmul(hidden))
        return None if logits is None else logits[:, :vocab_size]
    if group.rank != 0:
        return None
    return head.matmul(hidden)


def compute_logits(head: LinearBase, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Logits [rows, vocab] in float32 on rank 0; None on the other tensor-parallel ranks."""
    output = head_output(head, hidden, vocab_size)
    return None if output is None else output.float()

