"""The LM head over a step's logits rows, a bounded number of rows at a time.

A step's logits rows (its samples, then the prompt positions scored for prompt_logprobs) can be many: 256
decoding sequences, or a 2,048-token prefill chunk whose every position is scored. Their float32 logits for a
large vocabulary are then hundreds of MiB to GiB (2,048 x 262k x 4 bytes is 2 GiB), and the LM head's output in
the model's dtype sits beside them while it is converted. Computed and consumed a chunk of rows at a time, what a
step holds is one chunk's logits whatever the batch, so start-up's profiling peak and serving's stay near the
steady memory. Under vocab-parallel tensor parallelism every rank runs the same chunks (each one a gather).
Where the activations are bfloat16, the head's GEMM runs over twice a chunk's rows in the same bytes
(model_logits_in_chunks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

# Logits elements (rows x vocab) one chunk holds: 32 MiB of float32 on the CPU. On CUDA the profiled peak is
# reserved anyway and fewer, larger chunks keep the LM head's GEMM efficient.
CPU_LOGITS_CHUNK_ELEMENTS = 1 << 23
CUDA_LOGITS_CHUNK_ELEMENTS = 1 << 26


def logits_rows_per_chunk(vocab_size: int, device: torch.device) -> int:
    elements = CUDA_LOGITS_CHUNK_ELEMENTS if device.type == "cuda" else CPU_LOGITS_CHUNK_ELEMENTS
    return max(1, elements // vocab_size)


def logits_in_chunks(compute_logits: Callable[[torch.Tensor], torch.Tensor | None], hidden: torch.Tensor,
                     rows_per_chunk: int) -> Iterator[tuple[int, torch.Tensor | None]]:
    """(first row, logits of rows [first, first + chunk)) for each chunk of `hidden`'s rows, in order; the
    logits are None on tensor-parallel ranks that do not sample.

    The rows are split into equal chunks of at most `rows_per_chunk` (558 rows by 170 make 4 of 140, not 3 of 170
    and one of 48): a quantized LM head picks its kernel by the rows it is given (pagellm/ops/gguf_kernels.py's
    dense_min_rows), and a short tail chunk would round its rows differently from the rest."""
    num_rows = hidden.shape[0]
    num_chunks = max(1, -(-num_rows // rows_per_chunk))
    size = -(-num_rows // num_chunks)
    for start in range(0, num_rows, size):
        yield start, compute_logits(hidden[start : start + size])


def model_logits_in_chunks(model, hidden: torch.Tensor, rows_per_chunk: int) -> Iterator[tuple[int, torch.Tensor | None]]:
    """`logits_in_chunks` of a model's logits, with its head's GEMM over more rows per call where the model splits
    compute_logits into compute_head and finish_logits and its activations are narrower than float32.

    A quantized head picks its kernel by the rows it is given, and a GEMM over more rows reads its weight fewer
    times: Gemma 3's 262k-row head over a step's 64 decodes ran as two 32-row calls of the int8 products, each
    slower than one 64-row call of its dense path (README, "On a CPU with AMX"). So the head runs over groups of
    2 x rows_per_chunk
    rows in bfloat16 (as many bytes as a float32 chunk and its bfloat16 output held before), and the groups' rows
    become float32 logits in chunks of half rows_per_chunk: the same bytes at a time. The groups are equal in size
    (logits_in_chunks' reason); a tensor-parallel rank other than 0 yields (first row, None) once per group."""
    compute_head = getattr(model, "compute_head", None)
    if compute_head is None or hidden.element_size() != 2 or rows_per_chunk < 2:
        yield from logits_in_chunks(model.compute_logits, hidden, rows_per_chunk)
        return
    float_rows = rows_per_chunk // 2
    for start, output in logits_in_chunks(compute_head, hidden, 2 * rows_per_chunk):
        if output is None:
            yield start, None
            continue
        for first in range(0, output.shape[0], float_rows):
            yield start + first, model.finish_logits(output[first : first + float_rows])

