"""Suffix decoding (vLLM's "suffix" method, after Arctic Inference's SuffixDecoding): count every substring of up
to max_tree_depth tokens in a trie, per request over its prompt and output and globally over the outputs of recent
requests; draft by matching the longest suffix of the sequence in a trie and following its most frequent
continuation while the estimated probability of the whole draft stays >= min_token_prob. No model, no torch.

Memory: a trie holds at most one node per (start position, depth <= max_tree_depth) of the tokens it indexed; the
global one indexes at most max_cached_requests outputs (the oldest is taken out, FIFO), a request's own trie lives
while the request does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class _Node:
    __slots__ = ("count", "children", "depth")

    def __init__(self, depth: int) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.depth = depth


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    # Expected number of accepted tokens, from the trie's counts: how a request's and the global draft compete.
    score: float
    match_length: int


NO_DRAFT = Draft([], 0.0, 0)


class SuffixTrie:
    """Counts of every substring of length <= max_depth of the sequences added to it."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0)
        self.num_nodes = 0

    def add(self, token_ids: list[int]) -> None:
        """Index a whole sequence (the global trie's outputs)."""
        cursor = SuffixCursor(self)
        for token in token_ids:
            cursor.append(token)

    def remove(self, token_ids: list[int]) -> None:
        """Take out a sequence added before: every substring's count drops, emptied nodes go."""
        depth = self.max_depth
        for start in range(len(token_ids)):
            node = self.root
            for token in token_ids[start : start + depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    self.num_nodes -= _size(child)
                    break
                node = child

    def longest_match(self, context: list[int], max_length: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context`, of at most max_length tokens, that has a continuation."""
        for length in range(min(max_length, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0

    def speculate(self, context: list[int], max_drafts: int, max_spec_factor: float, min_token_prob: float) -> Draft:
        # The trie's depth bounds match + drafts: a match leaves room for the drafts asked for.
        node, match = self.longest_match(context, max(1, self.max_depth - max_drafts))
        if node is None:
            return NO_DRAFT
        limit = min(max_drafts, int(max_spec_factor * match), self.max_depth - match)
        tokens: list[int] = []
        probability, score = 1.0, 0.0
        while len(tokens) < limit and node.children:
            total = sum(child.count for child in node.children.values())
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            probability *= child.count / total
            if probability < min_token_prob:
                break
            tokens.append(token)
            score += probability
            node = child
        return Draft(tokens, score, match)


def _size(node: _Node) -> int:
    count, stack = 0, [node]
    while stack:
        current = stack.pop()
        count += 1
        stack.extend(current.children.values())
    return count


class SuffixCursor:
    """Indexes a growing sequence into a trie token by token: the nodes of the suffixes still shorter than the
    trie's depth are kept, so that each new token costs max_depth child steps."""

    def __init__(self, trie: SuffixTrie) -> None:
        self.trie = trie
        self.active: list[_Node] = []

    def append(self, token: int) -> None:
        trie = self.trie
        extended = []
        for node in [*self.active, trie.root]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(node.depth + 1)
                trie.num_nodes += 1
            child.count += 1
            if child.depth < trie.max_depth:
                extended.append(child)
        self.active = extended


class SuffixProposer:
    """Per request a trie over its prompt and output; one global trie over the last max_cached_requests outputs."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float):
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_trie = SuffixTrie(max_depth)
        self._cached_outputs: deque[list[int]] = deque()
        # request id -> (its trie, the cursor indexing it, tokens indexed so far)
        self._requests: dict[str, tuple[SuffixTrie, SuffixCursor, list[int]]] = {}

    def propose(self, request_id: str, token_ids: list[int], max_drafts: int) -> list[int]:
        trie, cursor, indexed = self._request_trie(request_id)
        for token in token_ids[indexed[0] :]:
            cursor.append(token)
        indexed[0] = len(token_ids)
        context = token_ids[-self.max_depth :]
        args = (context, max_drafts, self.max_spec_factor, self.min_token_prob)
        own = trie.speculate(*args)
        shared = self.global_trie.speculate(*args) if self._cached_outputs else NO_DRAFT
        return (shared if shared.score > own.score else own).token_ids

    def _request_trie(self, request_id: str):
        state = self._requests.get(request_id)
        if state is None:
            trie = SuffixTrie(self.max_depth)
            state = self._requests[request_id] = (trie, SuffixCursor(trie), [0])
        return state

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        self._requests.pop(request_id, None)
        if self.max_cached_requests == 0 or not output_token_ids:
            return
        output = list(output_token_ids)
        self.global_trie.add(output)
        self._cached_outputs.append(output)
        while len(self._cached_outputs) > self.max_cached_requests:
            self.global_trie.remove(self._cached_outputs.popleft())

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
