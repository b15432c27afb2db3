"""What the scheduler asks of speculative decoding: drafts for a running request, and what became of them.

Adaptivity, because a rejected draft costs a step its verification and gains nothing:
- globally, a batch of more than disable_by_batch_size running sequences gets no drafts (a full batch already
  fills the step's compute, so extra query tokens only slow it down);
- per request, a run of poorly accepted drafts (acceptance below MIN_ACCEPTANCE over the recent drafts) pauses
  its speculation for a number of steps that doubles each time (up to MAX_BACKOFF_STEPS), then it tries again;
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

# Acceptance (accepted / drafted, exponentially averaged) below which a request pauses its speculation.
MIN_ACCEPTANCE = 0.25
_EMA_WEIGHT = 0.5
MAX_BACKOFF_STEPS = 64
# What the drafts of a request with a model-based method (draft_model, mtp, eagle) are in the scheduler: the count
# is decided here (budget, max_tokens, back-off), the tokens by the model runner's draft model or head before the
# target's forward (draft_model.py, heads.py).
DRAFT_PLACEHOLDER = -1


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
    acceptance: float = 1.0
    paused_steps: int = 0
    backoff: int = 1
    tokens: TokenBuffer | None = None


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
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

    def drafts_for(self, request: Request, budget: int, max_model_len: int) -> list[int]:
        """Drafts to verify after the request's next token: at most num_speculative_tokens, what the step's token
        budget has left, what max_tokens and max_model_len leave after the token this step samples anyway."""
        limit = min(self.config.num_speculative_tokens, budget,
                    request.max_output_tokens - request.num_output_tokens - 1,
                    max_model_len - request.num_tokens)
        if limit <= 0 or not self.eligible(request):
            return []
        state = self._states.setdefault(request.request_id, _RequestState())
        if state.paused_steps:
            state.paused_steps -= 1
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
        state.acceptance = (1 - _EMA_WEIGHT) * state.acceptance + _EMA_WEIGHT * num_accepted / num_drafts
        if state.acceptance < MIN_ACCEPTANCE:
            state.paused_steps = state.backoff
            state.backoff = min(2 * state.backoff, MAX_BACKOFF_STEPS)
            state.acceptance = MIN_ACCEPTANCE  # one good draft after the pause resumes it
        elif num_accepted == num_drafts:
            state.backoff = 1

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
