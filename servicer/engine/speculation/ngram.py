"""Prompt lookup: drafts copied from where the row's last few tokens occurred before."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_BITS = 21  # token ids below 2**21; an n-gram of up to 3 ids packs into one int key
_BULK = 64  # index this many new positions or more with numpy (a prompt), fewer in a loop


def _keys(window: Sequence[int], n: int) -> int:
    key = 0
    for token in window[-n:]:
        key = (key << _BITS) | token
    return key


class NgramIndex:
    """One row's n-gram -> latest end position, kept up to date incrementally.

    Positions index the row's context (the target's tokens, then the pending token). Every
    position but the last is indexed, so a lookup of the context's own last n tokens finds
    their latest *earlier* occurrence."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self._sizes = tuple(sizes)
        self._ends: dict[int, dict[int, int]] = {n: {} for n in self._sizes}
        # The maps by n - 1, up to the largest n (None for a size not looked up).
        self._by_back = [self._ends.get(n) for n in range(1, max(self._sizes) + 1)]
        self._indexed = 0  # positions [0, _indexed) are in the maps

    def _index(self, context: list[int], upto: int) -> None:
        start = self._indexed
        if upto - start >= _BULK:
            self._index_bulk(context, start, upto)
        else:
            # Each n-gram's key grows from the shorter one's (as `_keys` packs it): a step's
            # few new positions are indexed without slicing the context.
            by_back = self._by_back
            for end in range(start, upto):
                key = 0
                for back in range(min(len(by_back), end + 1)):
                    key |= context[end - back] << (_BITS * back)
                    ends = by_back[back]
                    if ends is not None:
                        ends[key] = end
        self._indexed = max(upto, start)

    def _index_bulk(self, context: list[int], start: int, upto: int) -> None:
        low = max(start - max(self._sizes) + 1, 0)  # the oldest token a new n-gram reads
        ids = np.asarray(context[low:upto], dtype=np.int64)
        for n in self._sizes:
            first = max(start, n - 1)
            if first >= upto:
                continue
            ends = np.arange(first, upto)
            keys = np.zeros(len(ends), dtype=np.int64)
            for back in range(n - 1, -1, -1):
                keys = (keys << _BITS) | ids[ends - back - low]
            # dict.update keeps the last pair of a repeated key: the latest occurrence.
            self._ends[n].update(zip(keys.tolist(), ends.tolist(), strict=True))

    def draft(self, tokens: list[int], pending: int, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's last
        n tokens (the longest n that occurred)."""
        return self._lookup(tokens, len(tokens), pending, k)

    def predicted(self, tokens: list[int]) -> bool:
        """Whether a one-token draft made a step ago (the last token still pending then)
        would have been the last token: what drafting would have gained, measured for free
        while the row does not draft."""
        last = len(tokens) - 2
        return last >= 1 and self._lookup(tokens, last, tokens[last], 1) == [tokens[-1]]

    def _lookup(self, tokens: list[int], last: int, pending: int, k: int) -> list[int]:
        """`draft` for the context `tokens[:last]` (later entries are not read)."""
        self._index(tokens, last)  # every position before the pending one
        for n in self._sizes:
            if last + 1 < n:
                continue
            key = _keys([*tokens[last + 1 - n : last], pending], n) if n > 1 else pending
            end = self._ends[n].get(key)
            if end is not None:
                start = end + 1
                found = tokens[start : min(start + k, last)]
                if len(found) < k and start + len(found) == last:
                    found.append(pending)
                return found
        return []


class PromptLookup:
    """Draft source: n-gram prompt lookup over each row's own prompt and output."""

    def __init__(self, sizes: Sequence[int] = (3, 2)) -> None:
        if not sizes or any(not 1 <= n <= 3 for n in sizes):
            raise ValueError("n-gram sizes must be between 1 and 3")
        self._sizes = tuple(sorted(set(sizes), reverse=True))
        self._rows: list[NgramIndex] = []

    def extend(self, tokens: Sequence[list[int]]) -> None:
        self._rows.extend(NgramIndex(self._sizes) for _ in tokens)

    def filter(self, keep: Sequence[int]) -> None:
        self._rows = [self._rows[i] for i in keep]

    def draft(
        self, tokens: Sequence[list[int]], pending: Sequence[int], ks: Sequence[int]
    ) -> list[list[int]]:
        return [
            row.draft(context, last, k) if k > 0 else []
            for row, context, last, k in zip(self._rows, tokens, pending, ks, strict=True)
        ]

    def accepted(self, kept: Sequence[int]) -> None:
        """Nothing to undo: the index only ever holds tokens the target kept."""

    def predicted(self, tokens: Sequence[list[int]]) -> list[bool]:
        """For each row, whether a one-token draft a step ago would have been accepted."""
        return [row.predicted(context) for row, context in zip(self._rows, tokens, strict=True)]
