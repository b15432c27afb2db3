"""Issue 13 item 3 as a property: under every combination of the scheduler's options, every step makes
progress while a request is unfinished, no block leaks or is freed twice, and every request's tokens
equal the same request run alone.

The model is faked, but honestly: the runner keeps, for every slot of every physical block, the token
prefix whose K/V was written there, and each sampled token is read off the K/V the request's block table
points at. A block handed to two owners, a missed copy-on-write or a stale prefix-cache hit therefore
changes the tokens, and the test compares them with the request run alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagellm.core.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput, TokenLogprobs
from pagellm.sampling_params import SamplingParams
from tests.core.test_prefix_cache import check_invariants as check_ref_counts

PROPERTY = settings(derandomize=True, deadline=None, max_examples=300,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VOCAB = 9
STOP_TOKEN = 0


def next_token(tokens: tuple[int, ...], sample_index: int) -> int:
    """The fake model: a deterministic function of the whole sequence (and of the sample's index)."""
    value = sample_index * 7919
    for token in tokens:
        value = (value * 31 + token + 1) % 1_000_003
    return value % VOCAB


def run_alone(prompt: list[int], sample_index: int, max_output: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_output:
        tokens.append(next_token(tuple(tokens), sample_index))
        if tokens[-1] == STOP_TOKEN:
            break
    return tokens[len(prompt):]


@dataclass
class _Sequence:
    tokens: list[int]
    table: list[int]
    computed: int
    sample_index: int
    samples_at_first: int
    appends: bool


class KVContentRunner:
    """Rebuilds every sequence from the scheduler outputs alone and reads tokens off the K/V it wrote."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.kv.block_size
        self.slots: dict[int, list[tuple[int, ...] | None]] = {}
        self.sequences: dict[str, _Sequence] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.finished_request_ids:
            self.sequences.pop(request_id, None)
        for source, destination in out.block_copies:
            self.slots[destination] = list(self.slots[source])
        for new in out.new_requests:
            assert new.request_id not in self.sequences, f"{new.request_id} sent as new twice"
            self.sequences[new.request_id] = _Sequence(list(new.token_ids), list(new.block_ids),
                                                       new.num_computed_tokens, new.sample_index,
                                                       new.num_samples_at_first, new.appends_sampled_tokens)
        for cached in out.cached_requests:
            sequence = self.sequences[cached.request_id]
            sequence.table.extend(cached.new_block_ids)
            for index, block_id in cached.replaced_blocks:
                sequence.table[index] = block_id
            sequence.tokens.extend(cached.new_token_ids)
        result = ModelRunnerOutput()
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            sequence = self.sequences[request_id]
            assert num_tokens > 0 and sequence.computed + num_tokens <= len(sequence.tokens)
            assert sequence.table == self.scheduler.kv.block_ids(request_id), "the runner's table is the core's"
            for position in range(sequence.computed, sequence.computed + num_tokens):
                block = self.slots.setdefault(sequence.table[position // self.block_size], [None] * self.block_size)
                block[position % self.block_size] = tuple(sequence.tokens[: position + 1])
            sequence.computed += num_tokens
            if sequence.computed == len(sequence.tokens):
                self._sample(request_id, sequence, result)
        return result

    def _sample(self, request_id: str, sequence: _Sequence, result: ModelRunnerOutput) -> None:
        # What attention reads: the K/V of every position, through the block table.
        read = [self.slots[sequence.table[p // self.block_size]][p % self.block_size]
                for p in range(len(sequence.tokens))]
        truth = [tuple(sequence.tokens[: p + 1]) for p in range(len(sequence.tokens))]
        assert read == truth, f"{request_id} read K/V that another sequence wrote"
        context = tuple(sequence.tokens)
        if not sequence.appends:  # a beam: it reports log-probabilities and the driver picks
            result.sampled_token_ids[request_id] = next_token(context, 0)
            result.logprobs[request_id] = [TokenLogprobs(next_token(context, 0), 0.0, 1, [], [])]
            return
        samples = [next_token(context, sequence.sample_index)]
        if sequence.samples_at_first > 1:
            samples += [next_token(context, index) for index in range(1, sequence.samples_at_first)]
            result.forked_token_ids[request_id] = samples[1:]
            sequence.samples_at_first = 1
        result.sampled_token_ids[request_id] = samples[0]
        sequence.tokens.append(samples[0])


class BeamDriver:
    """The caller's side of beam search (as engine/beam_search.py): once every beam of a group reported,
    each is extended by the caller's token, some are forked or dropped, and the group ends at its length."""

    def __init__(self, scheduler: Scheduler, rng: random.Random) -> None:
        self.scheduler = scheduler
        self.rng = rng
        self.groups: dict[str, tuple[int, int]] = {}  # group -> (width, max_tokens)
        self.reported: set[str] = set()
        self.fork_counter = 0

    def add(self, request: Request, width: int) -> None:
        self.groups[request.group_id] = (width, request.max_output_tokens)

    def after_step(self, outputs) -> None:
        self.reported |= {o.request_id for o in outputs if o.group_id in self.groups}
        for group_id, (width, max_tokens) in list(self.groups.items()):
            members = sorted(self.scheduler.groups.get(group_id, ()))
            if not members:
                del self.groups[group_id]
                continue
            if not all(m in self.reported for m in members):
                continue
            self.reported -= set(members)
            requests = [self.scheduler.requests[m] for m in members]
            if requests[0].num_output_tokens + 1 >= max_tokens:
                self.scheduler.finish_requests(members, RequestStatus.FINISHED_ABORTED, whole_groups=False)
                del self.groups[group_id]
                continue
            if len(members) < width and self.rng.random() < 0.6:
                self.fork_counter += 1
                parent = self.rng.choice(members)
                child = self.scheduler.fork_request(parent, f"{group_id}/beam{self.fork_counter}")
                requests.append(child)
            elif len(members) > 1 and self.rng.random() < 0.3:
                dropped = requests.pop(self.rng.randrange(len(requests)))
                self.scheduler.finish_requests([dropped.request_id], RequestStatus.FINISHED_ABORTED,
                                               whole_groups=False)
            for index, request in enumerate(requests):
                self.scheduler.append_token(request.request_id, (next_token(tuple(request.all_token_ids), 0)
                                                                 + index) % VOCAB)


@st.composite
def configurations(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 48))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1 if chunked else 4, 64))
    min_blocks = cdiv(max_model_len, block_size)
    num_blocks = min_blocks + draw(st.sampled_from([0, 1, 2, 4, 16]))
    config = SchedulerConfig(budget, draw(st.integers(1, 4)), max_model_len, chunked)
    return config, block_size, num_blocks, draw(st.booleans())


@st.composite
def requests(draw, config: SchedulerConfig, block_size: int):
    # Prompts from a few shared prefixes, so that prefix caching has hits and partial hits.
    longest = min(config.max_model_len - 1, config.max_num_batched_tokens if not config.enable_chunked_prefill
                  else config.max_model_len - 1)
    prefixes = [[1 + i] * draw(st.integers(0, 2 * block_size)) for i in range(2)]
    specs = []
    for _ in range(draw(st.integers(1, 7))):
        prefix = prefixes[draw(st.integers(0, 1))]
        tail = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=8))
        prompt = (prefix + tail)[-longest:]
        kind = draw(st.sampled_from(["greedy", "greedy", "n", "beam"]))
        width = draw(st.integers(2, 3))
        max_tokens = draw(st.integers(1, 12))
        arrive = draw(st.integers(0, 8))
        specs.append((prompt, kind, width, max_tokens, arrive))
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 99)), max_size=2))
    return specs, aborts


@PROPERTY
@given(data=st.data())
def test_every_step_makes_progress_and_every_request_equals_its_run_alone(data):
    config, block_size, num_blocks, prefix_caching = data.draw(configurations())
    specs, aborts = data.draw(requests(config, block_size))
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching))
    runner = KVContentRunner(scheduler)
    beams = BeamDriver(scheduler, random.Random(data.draw(st.integers(0, 2**16))))
    pending = sorted(((arrive, index) for index, (*_, arrive) in enumerate(specs)), reverse=True)
    produced: dict[tuple[str, int], list[int]] = {}
    finished: dict[tuple[str, int], str] = {}
    aborted: set[str] = set()
    skipped: set[str] = set()
    step = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[-1][0] <= step:
            _, index = pending.pop()
            prompt, kind, width, max_tokens, _ = specs[index]
            max_output = min(max_tokens, config.max_model_len - len(prompt))
            n = width if kind == "n" else 1
            params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0 if kind != "n" else 1.0)
            request = Request(f"r{index}", prompt, params, index, max_output, frozenset({STOP_TOKEN}),
                              num_pending_forks=n - 1, appends_sampled_tokens=kind != "beam",
                              reserved_seats=width if kind == "beam" else 1)
            try:
                scheduler.add_request(request)
            except ValueError as exc:
                # Its sequences can never run at once (seats or blocks): refused up front, never half-run.
                seats = width if kind != "greedy" else 1
                blocks = cdiv(len(prompt) + 1, block_size) + seats - 1
                assert seats > config.max_num_seqs or blocks > num_blocks, exc
                skipped.add(f"r{index}")
                continue
            if kind == "beam":
                beams.add(request, width)
        for when, pick in aborts:
            if when == step and scheduler.groups:
                group = sorted(scheduler.groups)[pick % len(scheduler.groups)]
                scheduler.finish_requests([group], RequestStatus.FINISHED_ABORTED, whole_groups=True)
                aborted.add(group)
        if not scheduler.has_unfinished_requests():
            step += 1
            continue
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens > 0, f"step {step} scheduled nothing: {scheduler.get_stats()}"
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        # Forks (n > 1) and beams included: a user request holds seats for all of its sequences.
        assert len(scheduler.running) <= config.max_num_seqs
        outputs = scheduler.update_from_output(out, runner.execute(out))
        for output in outputs:
            key = (output.group_id, output.sample_index)
            if output.group_id not in beams.groups:
                produced.setdefault(key, []).extend(output.new_token_ids)
            if output.finished:
                finished[key] = output.finish_reason
        beams.after_step(outputs)
        check_ref_counts(scheduler)
        step += 1
        assert step < 300, f"no end after 300 steps: {scheduler.get_stats()}"

    stats = scheduler.kv.stats()
    event(f"preempted={scheduler.num_preemptions > 0}")
    event(f"prefix_hits={stats.prefix_cache_hits > 0}")
    event(f"copy_on_write={stats.num_cow_copies > 0}")
    event(f"beam_forks={beams.fork_counter > 0}")
    pool = scheduler.kv.pool
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert not scheduler.requests and not scheduler.groups
    for index, (prompt, kind, width, max_tokens, _) in enumerate(specs):
        group = f"r{index}"
        if kind == "beam" or group in aborted or group in skipped:
            continue
        max_output = min(max_tokens, config.max_model_len - len(prompt))
        for sample_index in range(width if kind == "n" else 1):
            assert produced[(group, sample_index)] == run_alone(prompt, sample_index, max_output), (group, sample_index)
            assert finished[(group, sample_index)] in ("stop", "length")
