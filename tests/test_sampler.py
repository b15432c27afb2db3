"""The sampler works through a batch in chunks of rows, in buffers reused from chunk to chunk and step to step:
its tokens, log-probabilities and generator state must be exactly those of the plain whole-batch definition
below (each filter a fresh [rows, vocab] tensor), for any chunk size."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagellm.sample.sampler import LogitBias, Penalties, Sampler, SamplingBatch, TokenHistory


def reference_sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator):
    """Whole batch at once, out of place: (tokens, logprobs, ranks, top ids, top logprobs) or (tokens,)."""
    raw = logits.log_softmax(dim=-1) if batch.num_logprobs is not None else None
    if batch.allowed_tokens:
        allowed = torch.ones(logits.shape, dtype=torch.bool)
        for row, ids in batch.allowed_tokens:
            allowed[row] = False
            allowed[row, ids] = True
        logits = logits.masked_fill(~allowed, float("-inf"))
    for row, ids in batch.banned_tokens:
        logits[row, ids] = float("-inf")
    if batch.logit_bias is not None:
        bias = batch.logit_bias
        logits.index_put_((bias.rows, bias.token_ids), bias.biases, accumulate=True)
    if batch.penalties is not None:
        logits = _reference_penalties(logits, batch.penalties)
    tokens = _reference_draw(logits, batch, generator)
    if raw is None:
        return (tokens,)
    chosen = raw.gather(1, tokens[:, None]).squeeze(1)
    ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
    # The most likely tokens as a stable sort ranks them: ties by lower token id.
    top_lp, top_ids = torch.sort(raw, dim=-1, descending=True, stable=True)
    return tokens, chosen, ranks, top_ids[:, : batch.num_logprobs], top_lp[:, : batch.num_logprobs]


def _reference_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    history = penalties.history
    counts, seen = torch.zeros(logits.shape), torch.zeros(logits.shape)
    for i, (row, prompt_len, length) in enumerate(zip(history.rows, history.prompt_lens, history.lengths)):
        for position in range(length):
            seen[i, history.token_ids[row, position]] += 1
            if position >= prompt_len:
                counts[i, history.token_ids[row, position]] += 1
    repetition = penalties.repetition[:, None]
    logits = torch.where(seen > 0, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - penalties.frequency[:, None] * counts
    return logits - penalties.presence[:, None] * (counts > 0).float()


def _reference_draw(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    is_greedy = batch.temperature == 0
    logits = logits / torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature)[:, None]
    if batch.min_p is not None:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * batch.min_p[:, None], float("-inf"))
    if batch.top_k is not None or batch.top_p is not None:
        ordered, order = logits.sort(dim=-1, descending=True, stable=True)
        if batch.top_k is not None:
            ordered = ordered.masked_fill(torch.arange(logits.shape[-1])[None] >= batch.top_k[:, None], float("-inf"))
        if batch.top_p is not None:
            probs = ordered.softmax(dim=-1)
            dropped = (probs.cumsum(dim=-1) - probs >= batch.top_p[:, None]) & (batch.top_p[:, None] < 1)
            ordered = ordered.masked_fill(dropped, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    uniform = torch.rand(logits.shape[0], dtype=torch.float64, generator=generator)
    for row, seed, index in batch.seeded_rows:
        row_generator = torch.Generator()
        row_generator.manual_seed((seed * 1_000_003 + index) % (2**63))
        uniform[row] = torch.rand(1, dtype=torch.float64, generator=row_generator)
    cdf = logits.softmax(dim=-1).double().cumsum(dim=-1)
    sampled = torch.tensor([_first_above(row_cdf, u * row_cdf[-1]) for row_cdf, u in zip(cdf, uniform)])
    return torch.where(is_greedy, greedy, sampled)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> int:
    """The first token whose cumulative probability exceeds target, or the last of positive probability."""
    above = torch.nonzero(cdf > target)
    return int(above[0]) if len(above) else int(torch.nonzero(cdf >= cdf[-1])[0])


def random_case(seed: int) -> tuple[torch.Tensor, SamplingBatch]:
    """Logits (rounded through bfloat16 half the time, so that ties are common) and a batch that uses a random
    subset of every setting the sampler has."""
    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    rows, vocab = r.choice([1, 3, 8, 17]), r.choice([7, 100, 1031])
    logits = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32) * 3)
    if r.random() < 0.5:
        logits = logits.bfloat16().float()
    all_greedy = r.random() < 0.25
    temperature = [0.0 if all_greedy or r.random() < 0.3 else r.choice([0.5, 1.0, 1.7]) for _ in range(rows)]

    def column(choices, dtype=torch.float32, chance=0.6):
        if all_greedy or r.random() > chance:
            return None
        return torch.tensor([r.choice(choices) for _ in range(rows)], dtype=dtype)

    table = rng.integers(0, vocab, (rows + 4, 30))
    lengths = rng.integers(1, 30, rows)
    penalties = None
    if r.random() < 0.5:
        def penalty(choices):
            return torch.tensor([r.choice(choices) for _ in range(rows)], dtype=torch.float32)

        history = TokenHistory(table, rng.permutation(rows + 4)[:rows], np.minimum(rng.integers(0, 15, rows), lengths),
                               lengths)
        penalties = Penalties(penalty([0.0, 0.5, -0.7]), penalty([0.0, 0.3, -1.0]), penalty([1.0, 1.3, 0.8]), history)
    bias = [(row, token, r.uniform(-5, 5)) for row in range(rows) if r.random() < 0.3
            for token in sorted({r.randrange(vocab) for _ in range(3)})]
    logit_bias = None
    if bias:
        bias_rows, ids, values = (np.array(x) for x in zip(*bias))
        logit_bias = LogitBias(torch.from_numpy(bias_rows), torch.from_numpy(ids),
                               torch.from_numpy(values.astype(np.float32)), bias_rows)
    batch = SamplingBatch(
        temperature=torch.tensor(temperature),
        top_k=column([vocab, 1, 5, 50], torch.int64),
        top_p=column([1.0, 0.9, 0.5]),
        min_p=column([0.0, 0.05, 0.3], chance=0.4),
        all_greedy=all_greedy,
        seeded_rows=[(row, r.randrange(1000), r.randrange(10)) for row in range(rows)
                     if temperature[row] > 0 and r.random() < 0.4],
        banned_tokens=[(row, [r.randrange(vocab) for _ in range(3)]) for row in range(rows) if r.random() < 0.2],
        penalties=penalties,
        logit_bias=logit_bias,
        allowed_tokens=[(row, sorted({r.randrange(vocab) for _ in range(r.randrange(1, 20))}))
                        for row in range(rows) if r.random() < 0.2],
        num_logprobs=r.choice([None, 1, 5]),
    )
    return logits, batch


def outputs(result) -> tuple:
    fields = (result.token_ids, result.logprobs, result.ranks, result.top_token_ids, result.top_logprobs)
    return tuple(f for f in fields if f is not None)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("seed", range(60))
def test_chunked_sampling_equals_the_whole_batch_definition(seed):
    logits, batch = random_case(seed)
    rows, vocab = logits.shape
    expected_generator = generator(seed)
    expected = reference_sample(logits.clone(), batch, expected_generator)
    for rows_per_chunk in (1, 2, 5, rows):
        sampler = Sampler(generator(seed), max_chunk_elements=rows_per_chunk * vocab)
        assert sampler.rows_per_chunk(vocab) == rows_per_chunk
        got = outputs(sampler(logits.clone(), batch))
        assert len(got) == len(expected)
        for mine, theirs in zip(got, expected):
            assert torch.equal(mine, theirs), (rows_per_chunk, mine, theirs)
        # The batch's noise came from the engine's generator, as much of it as the whole-batch draw took.
        assert torch.equal(sampler.generator.get_state(), expected_generator.get_state())


def test_one_sampler_reuses_its_buffers_across_steps_of_different_batches():
    sampler = Sampler(generator(0), max_chunk_elements=3 * 1031)
    for seed in range(20):
        logits, batch = random_case(seed)
        fresh = Sampler(generator(0), max_chunk_elements=3 * 1031)
        sampler.generator.manual_seed(0)
        for mine, theirs in zip(outputs(sampler(logits.clone(), batch)), outputs(fresh(logits.clone(), batch))):
            assert torch.equal(mine, theirs)


def test_the_workspace_is_one_chunk_whatever_the_batch():
    vocab, rows = 1000, 256
    sampler = Sampler(generator(0), max_chunk_elements=8 * vocab)
    logits = torch.randn(rows, vocab)
    batch = SamplingBatch(torch.ones(rows), torch.full((rows,), 50), torch.full((rows,), 0.9), None, False, [], [],
                          num_logprobs=3)
    assert sampler(logits, batch).token_ids.shape == (rows,)
    assert sampler._workspace.rows == 8


@pytest.mark.parametrize("seed", range(12))
def test_filtering_among_the_largest_logits_equals_sorting_whole_rows(seed):
    """The CPU's top-k/top-p first look at each row's largest logits: the same logits out as the whole-row sort,
    ties included (bfloat16-rounded logits), where they are sure; the sort where not."""
    from pagellm.sample import sampler as sampler_module

    r = random.Random(seed)
    rows, vocab = 16, r.choice([2000, 20000])
    scale = r.choice([1.0, 4.0, 12.0])  # flat to peaked: cuts inside the first candidates, the second, or neither
    logits = (torch.randn(rows, vocab, generator=generator(seed)) * scale).bfloat16().float()
    top_k = torch.tensor([r.choice([1, 5, 50, 300, vocab]) for _ in range(rows)]) if r.random() < 0.7 else None
    top_p = torch.tensor([r.choice([1.0, 0.95, 0.5, 0.1]) for _ in range(rows)]) if r.random() < 0.7 else None
    if top_k is None and top_p is None:
        top_p = torch.full((rows,), 0.9)
    whole_rows = logits.clone()
    sampler_module._apply_top_k_top_p(whole_rows, top_k, top_p, workspace_for(rows, vocab), sort_whole_rows=True)
    candidates = logits.clone()
    sampler_module._apply_top_k_top_p(candidates, top_k, top_p, workspace_for(rows, vocab))
    assert torch.equal(candidates, whole_rows)


@pytest.mark.parametrize(("top_k", "top_p", "scale", "sorted_rows"), [
    (50, None, 12.0, False), (None, 0.9, 12.0, False), (50, 0.5, 1.0, False), (1000, 0.9, 12.0, False),
    (5000, None, 12.0, True), (None, 0.99, 0.5, True)])
def test_rows_are_sorted_whole_only_where_the_candidates_may_not_hold_the_kept_tokens(top_k, top_p, scale,
                                                                                      sorted_rows, monkeypatch):
    from pagellm.sample import sampler as sampler_module

    rows, vocab = 4, 20000
    logits = torch.randn(rows, vocab, generator=generator(1)) * scale
    sorts = []
    original = sampler_module._filter_sorted_rows
    monkeypatch.setattr(sampler_module, "_filter_sorted_rows", lambda *args: sorts.append(1) or original(*args))
    sampler_module._apply_top_k_top_p(logits, None if top_k is None else torch.full((rows,), top_k),
                                      None if top_p is None else torch.full((rows,), top_p),
                                      workspace_for(rows, vocab))
    assert bool(sorts) == sorted_rows


def workspace_for(rows: int, vocab: int):
    from pagellm.sample.sampler import _Workspace

    return _Workspace(rows, vocab, torch.device("cpu")).first(rows)


def test_the_workspace_holds_only_the_buffers_a_batch_uses():
    """A greedy batch allocates no chunk buffer, a top-p one the probabilities and the draw's sums (and no
    log-probability, penalty or whole-row sort buffers); release_workspace frees them, and they come back."""
    vocab, rows = 4096, 4
    sampler = Sampler(generator(0))
    logits = torch.randn(rows, vocab, generator=generator(1)) * 8  # top-p keeps few: no whole-row sort
    sampler(logits.clone(), SamplingBatch(torch.zeros(rows), None, None, None, True, [], []))
    assert sampler.workspace_bytes() == 0
    top_p = SamplingBatch(torch.ones(rows), None, torch.full((rows,), 0.9), None, False, [], [])
    sampler(logits.clone(), top_p)
    chunk_rows = min(rows, sampler.rows_per_chunk(vocab))
    assert sampler.workspace_bytes() == chunk_rows * vocab * (4 + 8)
    sampler.release_workspace()
    assert sampler.workspace_bytes() == 0
    first = sampler(logits.clone(), top_p).token_ids
    assert sampler.workspace_bytes() == chunk_rows * vocab * (4 + 8)
    kept = Sampler(generator(0))  # the same draws with the buffers never released
    kept(logits.clone(), top_p)
    assert torch.equal(kept(logits.clone(), top_p).token_ids, first)


def test_top_p_of_one_and_top_k_of_the_vocabulary_keep_every_token():
    from pagellm.sample.sampler import _apply_top_k_top_p

    vocab = 5000
    logits = torch.randn(2, vocab, generator=generator(3)) * 8
    for top_k, top_p in ((torch.tensor([vocab, vocab]), None), (None, torch.ones(2)),
                         (torch.tensor([vocab, vocab]), torch.ones(2))):
        filtered = logits.clone()
        _apply_top_k_top_p(filtered, top_k, top_p, workspace_for(2, vocab))
        assert torch.equal(filtered, logits)


def test_draws_follow_the_distribution():
    """Chi-square over 40,000 draws of one row's distribution (a third of it masked to -inf, never drawn), the
    unseeded stream and seeded rows alike."""
    vocab, rows = 12, 40_000
    logits = torch.randn(vocab, generator=generator(5)) * 1.5
    logits[::3] = float("-inf")
    probs = logits.softmax(dim=-1).double()
    batch = SamplingBatch(torch.ones(rows), None, None, None, False,
                          [(row, 17, row) for row in range(0, rows, 2)], [])
    tokens = Sampler(generator(0))(logits.expand(rows, vocab).clone(), batch).token_ids
    for half in (tokens[0::2], tokens[1::2]):  # seeded rows, then the generator's
        counts = torch.bincount(half, minlength=vocab).double()
        assert counts[::3].sum() == 0
        cells = probs * len(half)
        live = cells > 0
        chi2 = float(((counts[live] - cells[live]) ** 2 / cells[live]).sum())
        assert chi2 < 27.88, (chi2, counts.tolist(), cells.tolist())  # 7 degrees of freedom, p = 0.001
