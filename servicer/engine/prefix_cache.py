"""Prompt-prefix reuse across requests, on mlx-lm's LRUPromptCache.

Entries are taken at two points, both keyed by exactly the tokens their state holds:
- when a prompt's prefill reaches its last token (the state after all but that token), so an
  identical or extended prompt starts from it;
- when a request finishes (prompt and output), for the next turn of a conversation.
mlx-lm trims a longer entry down to a shared prefix only when every layer can be trimmed; a
model with recurrent layers (ArraysCache) or a wrapped sliding window cannot, so it reuses
only snapshots taken exactly at the shared boundary and otherwise prefills from scratch.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from ..messages import PrefixCacheStats

_MODEL_KEY = "model"  # one model per engine


class PrefixCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(len(self._lru), self._lru.nbytes, self.hits, self.misses)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def lookup(self, prompt: list[int]) -> tuple[list[Any] | None, int]:
        """A private copy of the best cached state for `prompt`, and how many tokens it covers.

        At least one prompt token is always left to prefill: the engine needs it to produce
        the first new token.
        """
        cache, rest = self._lru.fetch_nearest_cache(_MODEL_KEY, prompt)
        if cache is not None and not rest:  # an exact hit
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
            else:  # recurrent state cannot be rewound by a token
                cache = None
        if cache is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        return cache, len(prompt) - len(rest)

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        if not tokens:
            return
        # mlx-lm hands a finished row's cache out as lazy slices of the whole batch's buffers:
        # unevaluated, an entry would keep every row of that batch alive, not just its own.
        mx.eval(_arrays([layer.state for layer in cache]))
        self._lru.insert_cache(_MODEL_KEY, list(tokens), cache)


def _arrays(tree: Any) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, list | tuple):
        return [a for item in tree for a in _arrays(item)]
    return []
