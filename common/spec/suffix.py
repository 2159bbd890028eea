"""Suffix decoding (`suffix`, after Arctic Inference's method; written here from the idea):
every substring of up to D tokens, counted, in a trie per request (its prompt and output) and in
one global trie over recent finished requests' outputs. A draft matches the longest suffix of
the request's tokens, then follows the most frequent continuation while the estimated
probability that the draft so far is right stays above a threshold. A request that repeats an
earlier answer (an agent loop, a re-asked question) drafts long runs from the global trie."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.spec.base import Proposer, extends
from pdserve.common.spec.config import SpeculativeConfig


class _Node:
    """A substring: how often it occurs, and the nodes one token longer."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] | None = None


class SuffixTrie:
    """Every substring of at most `depth` tokens of the texts fed to it, with counts. Feeding
    token t extends each of the (up to depth - 1) open suffixes of the text by t: O(depth)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()

    def feed(self, open_nodes: list[_Node], token: int, step: int = 1) -> list[_Node]:
        """Appends `token` to a text whose open suffixes (shortest first) are `open_nodes`;
        returns the new open suffixes. step -1 takes the text back out (eviction)."""
        grown: list[_Node] = []
        for node in (self.root, *open_nodes):
            child = _child(node, token, step)
            if child is not None and len(grown) < self.depth - 1:
                grown.append(child)
        return grown

    def add(self, tokens: Sequence[int], step: int = 1) -> None:
        """Counts (step 1) or uncounts (step -1) every substring of one whole text."""
        open_nodes: list[_Node] = []
        for token in tokens:
            open_nodes = self.feed(open_nodes, token, step)

    def find(self, pattern: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for token in pattern:
            children = node.children if node is not None else None
            node = children.get(token) if children else None
        return node

    def longest_match(self, tokens: Sequence[int], longest: int) -> tuple[_Node, int] | None:
        """The longest suffix of `tokens` (at most `longest` long) seen with a continuation.
        Having one is monotone in the suffix's length (a longer match's occurrence contains a
        shorter one's), so a binary search over the length finds it in O(longest log longest)."""
        low, high, best = 1, min(longest, len(tokens)), None
        while low <= high:
            mid = (low + high) // 2
            node = self.find(tokens[len(tokens) - mid :])
            if node is not None and node.children:
                best, low = (node, mid), mid + 1
            else:
                high = mid - 1
        return best


def _child(node: _Node, token: int, step: int) -> _Node | None:
    children = node.children
    child = children.get(token) if children is not None else None
    if child is None:
        if step < 0:
            return None
        if children is None:
            children = node.children = {}
        child = children[token] = _Node()
    child.count += step
    if child.count <= 0:
        del children[token]
    return child


@dataclass(frozen=True, slots=True)
class Draft:
    """One trie's guess: its tokens and their expected accepted length (sum of the estimated
    probabilities that each prefix of the draft is right), the score drafts are chosen by."""

    tokens: tuple[int, ...]
    score: float


class _RequestState:
    __slots__ = ("trie", "open_nodes", "length", "last", "first_seen")

    def __init__(self, depth: int) -> None:
        self.trie = SuffixTrie(depth)
        self.open_nodes: list[_Node] = []
        self.length = 0
        self.last = -1
        self.first_seen = -1  # tokens at the first call: what follows is the request's output


class SuffixProposer(Proposer):
    """vLLM's `suffix` method. Memory: O(tokens * D) trie nodes per live request and for the
    cached outputs (suffix_max_cached_requests of them)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self._depth = config.suffix_max_tree_depth
        self._min_prob = config.suffix_min_token_prob
        self._spec_factor = config.suffix_max_spec_factor
        self._max_cached = config.suffix_max_cached_requests
        self._global = SuffixTrie(self._depth)
        self._cached: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._requests: dict[str, _RequestState] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not tokens:
            return []
        state = self._grow(request_id, tokens)
        # The pattern leaves the draft room in the trie's depth.
        longest = max(1, min(self._depth - 1, self._depth - k))
        drafts = [self._draft(trie, tokens, longest, k) for trie in (state.trie, self._global)]
        best = max((d for d in drafts if d is not None), key=lambda d: d.score, default=None)
        return list(best.tokens) if best is not None else []

    def finish(self, request_id: str, tokens: Sequence[int]) -> None:
        state = self._requests.pop(request_id, None)
        if state is None or self._max_cached == 0:
            return
        # From the last token the first call saw: the answer's first tokens then follow it.
        output = tuple(tokens[max(state.first_seen - 1, 0) :])
        if output:
            self._cache(request_id, output)

    def cached_requests(self) -> list[str]:
        """Ids whose outputs the global trie holds, oldest first."""
        return list(self._cached)

    def live_requests(self) -> list[str]:
        """Ids with per-request state (finish frees it)."""
        return list(self._requests)

    def _cache(self, request_id: str, output: tuple[int, ...]) -> None:
        old = self._cached.pop(request_id, None)
        if old is not None:  # the same id again: its latest output replaces the old one
            self._global.add(old, step=-1)
        self._cached[request_id] = output
        self._global.add(output)
        while len(self._cached) > self._max_cached:
            _, evicted = self._cached.popitem(last=False)
            self._global.add(evicted, step=-1)

    def _grow(self, request_id: str, tokens: Sequence[int]) -> _RequestState:
        state = self._requests.get(request_id)
        if state is None or not extends(state.length, state.last, tokens):
            state = self._requests[request_id] = _RequestState(self._depth)
            state.first_seen = len(tokens)
        for token in tokens[state.length :]:
            state.open_nodes = state.trie.feed(state.open_nodes, token)
        state.length, state.last = len(tokens), tokens[-1]
        return state

    def _draft(self, trie: SuffixTrie, tokens: Sequence[int], longest: int, k: int) -> Draft | None:
        match = trie.longest_match(tokens, longest)
        if match is None:
            return None
        node, matched = match
        limit = min(k, self._depth - matched, max(1, int(self._spec_factor * matched)))
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit and node.children:
            total = sum(child.count for child in node.children.values())
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / total
            if prob < self._min_prob:
                break
            out.append(token)
            score += prob
            node = child
        return Draft(tuple(out), score) if out else None
