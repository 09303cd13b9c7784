"""A few seeds of the prompt-cache differential fuzz (tests/cache_fuzz.py) on every demo kind
(make test: the hybrid kind, recurrent snapshots beside attention blocks; the others are slow);
`make fuzz-cache SEEDS=50` runs many more."""

from __future__ import annotations

import pytest
from cache_fuzz import fuzz
from support import slow

from servicer.demos.text import available_kinds


@pytest.mark.parametrize("kind", [k if k == "hybrid" else slow(k) for k in available_kinds()])
def test_cached_outputs_equal_cache_off_greedy_outputs(kind):
    cover = fuzz([kind], [0, 1])[kind]
    assert cover.differing == []
    assert cover.errors == []
    assert cover.ram_hits > 0 and cover.evictions > 0 and cover.restarts == 2
