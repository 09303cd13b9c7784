"""The blocks under one node of the prefix index (or its roots), by key and in token order.

A lookup wants the child sharing the longest prefix with the prompt's next tokens, and a
prompt's kept end wants the shorter ends it makes useless: both would read every child, and a
node gathers thousands (every distinct prompt shorter than a block is a root). In token order
the child sharing most with a sequence sits beside where the sequence would go, and the
children that are its prefixes are found by bisecting for each, so both take O(log n).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence, ValuesView
from typing import Generic, Protocol, TypeVar


class HasTokens(Protocol):
    @property
    def tokens(self) -> tuple[int, ...]: ...


NodeT = TypeVar("NodeT", bound=HasTokens)


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    if not a or not b or a[0] != b[0]:
        return 0  # most pairs differ at once
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


class Children(Generic[NodeT]):
    def __init__(self) -> None:
        self._by_key: dict[bytes, NodeT] = {}
        self._tokens: list[tuple[int, ...]] = []  # sorted
        self._nodes: list[NodeT] = []  # in the same order

    def __len__(self) -> int:
        return len(self._by_key)

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def get(self, key: bytes) -> NodeT | None:
        return self._by_key.get(key)

    def values(self) -> ValuesView[NodeT]:
        return self._by_key.values()

    def add(self, key: bytes, node: NodeT) -> None:
        if key in self._by_key:
            return
        self._by_key[key] = node
        at = bisect_left(self._tokens, node.tokens)
        self._tokens.insert(at, node.tokens)
        self._nodes.insert(at, node)

    def pop(self, key: bytes) -> None:
        node = self._by_key.pop(key, None)
        if node is None:
            return
        at = bisect_left(self._tokens, node.tokens)
        while self._nodes[at] is not node:  # keys name their tokens: no step in practice
            at += 1
        del self._tokens[at]
        del self._nodes[at]

    def longest_common(self, tokens: tuple[int, ...]) -> tuple[NodeT | None, int]:
        """The child sharing the most leading tokens with `tokens`, and how many (the lower
        neighbour on a tie)."""
        at = bisect_left(self._tokens, tokens)
        best: NodeT | None = None
        shared = 0
        for near in (at - 1, at):
            if 0 <= near < len(self._tokens):
                length = common_length(self._tokens[near], tokens)
                if length > shared:
                    best, shared = self._nodes[near], length
        return best, shared

    def prefixes(self, tokens: tuple[int, ...]) -> Iterator[NodeT]:
        """The children whose tokens begin `tokens` (itself included), longest first."""
        at = bisect_left(self._tokens, tokens)
        if at < len(self._tokens) and self._tokens[at] == tokens:
            yield self._nodes[at]
        # A prefix sorts before `tokens`, and no longer than what it shares with the child
        # just below where `tokens` (or the last prefix found) would go.
        while at > 0:
            length = common_length(self._tokens[at - 1], tokens)
            if length == 0:
                return
            at = bisect_left(self._tokens, tokens[:length], 0, at)
            if self._tokens[at] == tokens[:length]:
                yield self._nodes[at]
