"""Beam search over forked sequences, with transformers' selection rule (its oracle in the tests).

Each live beam is a sequence in the engine that reports the top log-probabilities of its next
token instead of sampling one. Per step and prompt, the best `beams_to_keep` continuations over all
beams are ranked; those that end (EOS, or max length) among the first `beam_width` become finished
hypotheses (scored with the length penalty), and the best `beam_width` others become the next beams.
A beam chosen once is extended in place, chosen again it is forked (its blocks shared, copied on
write), and not chosen it is freed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from pagellm.core.kv_usage import KVAccount, KVUsage
from pagellm.core.request import RequestStatus
from pagellm.sampling_params import BeamSearchParams

_NEG = -1.0e9  # transformers' stand-in for "impossible", kept so scores compare the same way


@dataclass
class BeamSearchSequence:
    """A finished hypothesis: tokens include the prompt's, as vLLM returns them."""

    tokens: list[int]
    cum_logprob: float
    # cum_logprob / (generated length ** length_penalty): what the ranking uses.
    score: float
    text: str | None = None
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    # The KV memory of the whole search for this prompt (every beam's blocks).
    kv: KVUsage = field(default_factory=KVUsage)


@dataclass
class _Beam:
    request_id: str
    generated: list[int]
    score: torch.Tensor  # float32 scalar: the sum of log-probabilities, accumulated as transformers does


@dataclass
class _PromptSearch:
    prompt: list[int]
    beams: list[_Beam]
    kv_account: KVAccount
    # (length-penalized score, generated tokens, ended by EOS, raw sum of log-probabilities)
    finished: list[tuple[torch.Tensor, list[int], bool, float]] = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False

    @property
    def num_generated(self) -> int:
        return len(self.beams[0].generated) if self.beams else 0


def beam_search(engine, prompts: list[list[int]], params: BeamSearchParams,
                lora_requests: list | None = None) -> list[BeamSearchOutput]:
    """`lora_requests`: the LoRA adapter of each prompt's search (None: the base model for all)."""
    core = engine.core
    eos_ids = set() if params.ignore_eos else set(core.model_info.eos_token_ids)
    beams_to_keep = max(2, 1 + len(eos_ids)) * params.beam_width
    ids = itertools.count()
    searches = []
    try:
        for prompt, lora_request in zip(prompts, lora_requests or [None] * len(prompts)):
            request_id = f"beam-{next(ids)}"
            engine.add_beam_request(request_id, prompt, beams_to_keep, params.max_tokens, params.beam_width,
                                    lora_request)
            beam = _Beam(request_id, [], torch.zeros((), dtype=torch.float32))
            searches.append(_PromptSearch(prompt, [beam], core.scheduler.requests[request_id].kv_account))
        while not all(s.done for s in searches):
            top = _next_token_logprobs(core, {b.request_id for s in searches if not s.done for b in s.beams})
            for search in searches:
                if not search.done:
                    _advance(core, search, top, params, eos_ids, beams_to_keep, ids)
    finally:
        live = [b.request_id for s in searches for b in s.beams if b.request_id in core.scheduler.requests]
        core.abort_requests(live, whole_groups=False)
    return [_result(search, params) for search in searches]


def _next_token_logprobs(core, beam_ids: set[str]) -> dict[str, tuple[list[int], list[float]]]:
    """Step the engine until every live beam has reported its next-token top log-probabilities."""
    top: dict[str, tuple[list[int], list[float]]] = {}
    while beam_ids - top.keys():
        lost = [r for r in beam_ids - top.keys() if r not in core.scheduler.requests]
        if lost:
            raise RuntimeError(f"beam sequences {lost} left the engine before reporting")
        for output in core.step():
            if output.request_id in beam_ids and output.logprobs:
                entry = output.logprobs[0]
                top[output.request_id] = (entry.top_token_ids, entry.top_logprobs)
    return top


def _advance(core, search: _PromptSearch, top, params: BeamSearchParams, eos_ids: set[int], k: int, ids) -> None:
    width, penalty = params.beam_width, params.length_penalty
    # Every continuation of every beam, scored in float32 like transformers' running scores.
    parents, tokens, scores = [], [], []
    for index, beam in enumerate(search.beams):
        token_ids, logprobs = top[beam.request_id]
        parents += [index] * len(token_ids)
        tokens += token_ids
        scores.append(beam.score + torch.tensor(logprobs, dtype=torch.float32))
    candidate_scores, order = torch.cat(scores).topk(min(k, len(tokens)))
    chosen = [(parents[i], tokens[i]) for i in order.tolist()]
    length = search.num_generated + 1
    at_max_length = length >= params.max_tokens
    ends = torch.tensor([at_max_length or token in eos_ids for _, token in chosen])

    # Hypotheses that end among the first beam_width continuations join the finished ones.
    full = len(search.finished) >= width and params.early_stopping is True
    if search.improvement_possible and not full:
        finished_scores = candidate_scores / (length**penalty)
        for rank, (parent, token) in enumerate(chosen[:width]):
            if ends[rank]:
                generated = search.beams[parent].generated + [token]
                search.finished.append((finished_scores[rank], generated, token in eos_ids, float(candidate_scores[rank])))
        search.finished.sort(key=lambda f: -float(f[0]))
        del search.finished[width:]

    running_scores = candidate_scores + ends.to(torch.float32) * _NEG
    next_scores, next_order = running_scores.topk(width)
    selections = [(chosen[i][0], chosen[i][1], next_scores[j]) for j, i in enumerate(next_order.tolist())]
    valid_continuations = not bool(ends.all())

    # transformers' heuristic: stop once no running beam can beat the worst of beam_width finished ones.
    best_length = params.max_tokens if params.early_stopping == "never" and penalty > 0 else length
    best_possible = float(next_scores[0] / (best_length**penalty))
    all_finished = len(search.finished) >= width
    worst_finished = float(search.finished[-1][0]) if all_finished else _NEG
    search.improvement_possible = search.improvement_possible and best_possible > worst_finished
    open_beams = not (all_finished and params.early_stopping is True)
    if not (search.improvement_possible and open_beams and valid_continuations):
        search.done = True
        return
    _apply_selection(core, search, selections, ids)


def _apply_selection(core, search: _PromptSearch, selections, ids) -> None:
    scheduler = core.scheduler
    new_beams: list[_Beam] = []
    extended: set[int] = set()
    # Forks first: a fork copies its parent's tokens, which must not yet include the parent's own choice.
    plan = []
    for parent_index, token, score in selections:
        parent = search.beams[parent_index]
        if parent_index in extended:
            child_id = f"beam-{next(ids)}"
            scheduler.fork_request(parent.request_id, child_id)
            plan.append((child_id, parent, token, score))
        else:
            extended.add(parent_index)
            plan.append((parent.request_id, parent, token, score))
    for request_id, parent, token, score in plan:
        scheduler.append_token(request_id, token)
        new_beams.append(_Beam(request_id, parent.generated + [token], score))
    dropped = [b.request_id for i, b in enumerate(search.beams) if i not in extended]
    scheduler.finish_requests(dropped, RequestStatus.FINISHED_ABORTED, whole_groups=False)
    search.beams = new_beams


def _result(search: _PromptSearch, params: BeamSearchParams) -> BeamSearchOutput:
    sequences = []
    for score, generated, eos, cum_logprob in search.finished:
        sequences.append(BeamSearchSequence(search.prompt + generated, cum_logprob, float(score),
                                            finish_reason="stop" if eos else "length"))
    return BeamSearchOutput(sequences, search.kv_account.snapshot())
