"""What the scheduler asks of speculative decoding: drafts for a running request, and what became of them.

Whether to draft, and how many, is decided per request and step by what a draft buys here: a verifying step of
n decoding rows and k drafts yields 1 + a + a^2 + ... + a^k tokens on average for a request whose drafts are
accepted with probability a per token, and costs what a decode step of n + k query tokens costs on this model and
machine. That cost is measured, not assumed (StepCosts: seconds of decode-only steps by their query tokens). It
differs by an order of magnitude between models: a float model's decode step reads every weight once whatever its
rows, so extra rows are nearly free, while a GGUF model's int8 products do most of a row's work again per extra
row. So the number of drafts is the k (up to num_speculative_tokens) with the most tokens per second of step,
and none where no k beats a plain step; then the request pauses its speculation for a number of steps that
doubles each time (up to MAX_BACKOFF_STEPS) and tries again with its best k. Also:
- globally, a batch of more than disable_by_batch_size running sequences gets no drafts (a full batch already
  fills the step's compute, so extra query tokens only slow it down);
- proposers return nothing where nothing matches, which costs nothing.

Requests that never speculate: n > 1 / best_of, beam search (the caller appends their tokens) and structured
outputs (their grammar would have to be rolled back over rejected tokens). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.request import Request
from pagellm.spec_decode.config import SpeculativeConfig
from pagellm.spec_decode.ngram import TokenBuffer, propose_ngram
from pagellm.spec_decode.suffix import SuffixProposer

MAX_BACKOFF_STEPS = 64
# A request's acceptance starts at PRIOR_ACCEPTANCE and follows its recent
# drafts: each verification scales the counts by ACCEPTANCE_DECAY before adding its own.
PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
PRIOR_ACCEPTANCE = PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED)
ACCEPTANCE_DECAY = 0.8
# The weight of a new measurement in a step size's average seconds, and how many decode steps a size's average
# stays valid without a new measurement.
STEP_COST_WEIGHT = 0.25
STALE_AFTER = 256
# What the drafts of a request with a model-based method (draft_model, mtp, eagle) are in the scheduler: the count
# is decided here (budget, max_tokens, back-off), the tokens by the model runner's draft model or head before the
# target's forward (draft_model.py, heads.py).
DRAFT_PLACEHOLDER = -1


@dataclass
class StepCosts:
    """Average seconds of a decode-only step by its query tokens (one per decoding row, plus drafts). A size not
    measured in the last STALE_AFTER decode steps counts as unmeasured: a load spike that made drafts look dear
    must not keep them off for good, as nothing would measure that size again."""

    seconds: dict[int, float] = field(default_factory=dict)
    # The decode step (count of observations) at which each size was last measured.
    last_seen: dict[int, int] = field(default_factory=dict)
    num_observed: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens) if self._fresh(tokens) else None
        self.seconds[tokens] = seconds if old is None else old + STEP_COST_WEIGHT * (seconds - old)
        self.num_observed += 1
        self.last_seen[tokens] = self.num_observed

    def relative(self, tokens: int, base: int) -> float:
        """cost(tokens) / cost(base)."""
        return self.relative_to(base, [tokens])[0]

    def relative_to(self, base: int, sizes: list[int]) -> list[float]:
        """cost(size) / cost(base) for each size, from the measured sizes: linear between two of them, and an
        unmeasured size above the largest (or with nothing measured) costs what the nearest measured one below
        does. That optimism makes the first steps try drafts, and their measurement then corrects it."""
        known = sorted((size, seconds) for size, seconds in self.seconds.items() if self._fresh(size))
        base_cost = _interpolate(known, base)
        if base_cost is None or base_cost <= 0:
            return [1.0] * len(sizes)
        return [max((_interpolate(known, size) or base_cost) / base_cost, 1.0) for size in sizes]

    def _fresh(self, tokens: int) -> bool:
        return tokens in self.seconds and self.num_observed - self.last_seen[tokens] < STALE_AFTER


def _interpolate(known: list[tuple[int, float]], tokens: int) -> float | None:
    """The seconds at `tokens` from (size, seconds) pairs in ascending size."""
    below = above = None
    for size, seconds in known:
        if size == tokens:
            return seconds
        if size < tokens:
            below = (size, seconds)
        elif above is None:
            above = (size, seconds)
    if below is None:
        return above[1] if above is not None else None
    if above is None:
        return below[1]
    share = (tokens - below[0]) / (above[0] - below[0])
    return below[1] + share * (above[1] - below[1])


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens a verifying step yields on average: its own, then each draft while every one before it is accepted,
    each with probability `acceptance`."""
    return sum(acceptance ** i for i in range(num_drafts + 1))


def best_num_drafts(acceptance: float, limit: int, num_rows: int, costs: StepCosts) -> int:
    """The k in [0, limit] with the most expected tokens per second of step for a request in a step of `num_rows`
    decoding rows; 0 when none beats a step without drafts."""
    best, best_rate = 0, 1.0
    relative = costs.relative_to(num_rows, [num_rows + k for k in range(1, limit + 1)])
    for k in range(1, limit + 1):
        rate = expected_tokens(acceptance, k) / relative[k - 1]
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class SpecDecodingStats:
    """Counted since start-up (vLLM's vllm:spec_decode_* counters)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Per draft position: how many drafts had their token at that position accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields on average: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class _RequestState:
    # Decayed counts of accepted draft tokens and of drafts that ended in a rejection: their ratio estimates the
    # chance that a draft token is accepted given the ones before it were.
    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    paused_steps: int = 0
    backoff: int = 1
    # After a pause: the next draft is sized as for a new request, so that a request whose text turned to
    # copying gets drafts again.
    probe: bool = False
    tokens: TokenBuffer | None = None

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.costs = StepCosts()
        self._states: dict[str, _RequestState] = {}
        self._suffix = SuffixProposer(
            config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob,
        ) if config.method == "suffix" else None

    def active_for_batch(self, num_running: int) -> bool:
        return num_running <= self.config.disable_by_batch_size

    @staticmethod
    def eligible(request: Request) -> bool:
        params = request.sampling_params
        return (request.appends_sampled_tokens and params.num_sequences == 1 and request.num_pending_forks == 0
                and params.structured_outputs is None)

    def drafts_for(self, request: Request, budget: int, max_model_len: int, num_rows: int = 1) -> list[int]:
        """Drafts to verify after the request's next token, in a step of about `num_rows` decoding rows: at most
        num_speculative_tokens, what the step's token budget has left, what max_tokens and max_model_len leave
        after the token this step samples anyway, and what pays (best_num_drafts)."""
        limit = min(self.config.num_speculative_tokens, budget,
                    request.max_output_tokens - request.num_output_tokens - 1,
                    max_model_len - request.num_tokens)
        if limit <= 0 or not self.eligible(request):
            return []
        state = self._states.setdefault(request.request_id, _RequestState())
        if state.paused_steps:
            state.paused_steps -= 1
            return []
        acceptance = PRIOR_ACCEPTANCE if state.probe else state.acceptance
        state.probe = False
        limit = best_num_drafts(acceptance, limit, max(num_rows, 1), self.costs)
        if limit == 0:
            state.paused_steps = state.backoff
            state.backoff = min(2 * state.backoff, MAX_BACKOFF_STEPS)
            state.probe = True
            return []
        if self.config.uses_draft_model:
            return [DRAFT_PLACEHOLDER] * limit
        if self._suffix is not None:
            return self._suffix.propose(request.request_id, request.all_token_ids, limit)
        if state.tokens is None:
            state.tokens = TokenBuffer()
        tokens = state.tokens.sync(request.all_token_ids)
        return propose_ngram(tokens, self.config.prompt_lookup_min, self.config.prompt_lookup_max, limit)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts of the request and accepted the first `num_accepted`."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.num_accepted_tokens_per_pos[position] += 1
        state = self._states.get(request_id)
        if state is None:
            return
        state.accepted = ACCEPTANCE_DECAY * state.accepted + num_accepted
        state.rejected = ACCEPTANCE_DECAY * state.rejected + (num_accepted < num_drafts)
        if num_accepted == num_drafts:
            state.backoff = 1

    def record_step(self, num_tokens: int, decode_only: bool, seconds: float) -> None:
        """A step of `num_tokens` query tokens took `seconds`; only decode-only steps (one token per row plus
        drafts) say what drafts cost."""
        if decode_only:
            self.costs.observe(num_tokens, seconds)

    def finish(self, request: Request) -> None:
        """The request ended: its state goes; suffix decoding keeps its output in the global trie."""
        self._states.pop(request.request_id, None)
        if self._suffix is not None:
            if request.status.finish_reason in ("stop", "length"):
                self._suffix.finish(request.request_id, request.output_token_ids)
            else:
                self._suffix.forget(request.request_id)


def make_speculator(speculative_config: dict | None) -> Speculator | None:
    """The engine's speculator for EngineArgs.speculative_config (validated there), None when unset."""
    if speculative_config is None:
        return None
    return Speculator(SpeculativeConfig.from_dict(speculative_config))
