"""The pieces of speculation on their own: per-row rollback, the n-gram index, the pace."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from servicer.engine.speculation.config import RowPace, SpeculationConfig, SpeculationCounters
from servicer.engine.speculation.ngram import NgramIndex, PromptLookup
from servicer.engine.speculation.rollback import rollback, row_lengths


def _single(values: list[float]) -> KVCache:
    cache = KVCache()
    data = mx.array(values, dtype=mx.float32).reshape(1, 1, len(values), 1)
    cache.update_and_fetch(data, data)
    return cache


def _append(cache: BatchKVCache, rows: list[list[float]]) -> None:
    data = mx.array(rows, dtype=mx.float32)[:, None, :, None]
    cache.update_and_fetch(data, data)


def _rows(cache: BatchKVCache) -> list[list[float]]:
    return [cache.extract(i).keys[0, 0, :, 0].tolist() for i in range(cache.left_padding.shape[0])]


def test_rollback_drops_each_rows_own_count():
    cache = BatchKVCache.merge([_single([1, 2, 3]), _single([4]), _single([5, 6])])
    _append(cache, [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    rollback([cache], [3, 0, 2])
    assert _rows(cache) == [[1, 2, 3, 10], [4, 20, 21, 22, 23], [5, 6, 30, 31]]
    assert cache.offset.tolist() == row_lengths(cache) == [4, 5, 4]
    _append(cache, [[14], [24], [34]])  # the next step writes after what each row kept
    assert _rows(cache) == [[1, 2, 3, 10, 14], [4, 20, 21, 22, 23, 24], [5, 6, 30, 31, 34]]


def test_rollback_compacts_padding_every_row_shares():
    cache = BatchKVCache.merge([_single([1]), _single([2])])
    for step in range(40):
        _append(cache, [[step] * 5, [step] * 5])
        rollback([cache], [4, 0] if step % 2 else [0, 4], compact_at=8)
    assert row_lengths(cache) == [1 + 20 * 5 + 20, 1 + 20 * 5 + 20]
    assert min(cache.left_padding.tolist()) < 8  # not 80 of padding on both rows
    assert cache._idx <= 121 + 8 + 4


def test_rollback_refuses_caches_it_cannot_cut():
    with pytest.raises(TypeError):
        rollback([_single([1, 2])], [1])


def test_ngram_drafts_from_the_latest_earlier_occurrence():
    index = NgramIndex((3, 2, 1))
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2]
    # last three are (1, 2, 3): seen ending at 2 and 6; the latest is 6, followed by 7, 8.
    assert index.draft(tokens, 3, 2) == [7, 8]
    assert index.draft([*tokens, 3, 7], 6, 3) == []  # (7, 6) / (6,) never seen
    fresh = NgramIndex((3, 2, 1))
    assert fresh.draft([*tokens, 3, 7], 8, 3) == [5, 1, 2]  # (3, 7, 8) ends at 8


def test_ngram_prefers_longer_matches_and_runs_into_the_pending_token():
    index = NgramIndex((3, 2))
    tokens = [4, 5, 6, 1, 5, 6, 2, 9, 5]
    # (9, 5, 6) never occurred; (5, 6) last ended at 5: then 2, 9, 5 and the pending 6.
    assert index.draft(tokens, 6, 4) == [2, 9, 5, 6]
    assert NgramIndex((3, 2)).draft(tokens, 6, 2) == [2, 9]
    index = NgramIndex((1,))
    assert index.draft([3, 3], 3, 4) == [3]  # only the pending token follows


def test_ngram_bulk_and_incremental_indexing_agree():
    import random

    rng = random.Random(0)
    tokens = [rng.randrange(12) for _ in range(600)]
    steps, found = NgramIndex((3, 2, 1)), 0
    for end in range(10, 600, 37):
        bulk = NgramIndex((3, 2, 1))  # indexes everything at once (numpy past 64 positions)
        want = bulk.draft(tokens[:end], tokens[end], 4)
        assert steps.draft(tokens[:end], tokens[end], 4) == want
        found += bool(want)
    assert found > 10


def test_prompt_lookup_follows_the_rows():
    lookup = PromptLookup((2,))
    lookup.extend([[1, 2, 3, 1], [7, 8, 9, 7]])
    assert lookup.draft([[1, 2, 3, 1], [7, 8, 9, 7]], [2, 8], [2, 0]) == [[3, 1], []]
    lookup.filter([1])
    assert lookup.draft([[7, 8, 9, 7]], [8], [2]) == [[9, 7]]


def test_pace_follows_acceptance_and_reprobes():
    config = SpeculationConfig(k_max=4, probe_every=4, probe_k=2)
    pace = RowPace()
    assert pace.k(config) == 2
    for _ in range(10):
        pace.update(2, 2, config)
    assert pace.k(config) == 4
    for _ in range(10):
        pace.update(4, 0, config)
    ks = [pace.k(config) for _ in range(8)]
    assert ks == [0, 0, 0, 2, 0, 0, 0, 2]
    for _ in range(5):
        pace.update(2, 2, config)
    assert pace.k(config) >= 1


def test_counters_snapshot():
    counters = SpeculationCounters()
    counters.record(4, 3, [4, 1])
    counters.record(0, 0, [1, 1])
    stats = counters.snapshot()
    assert (stats.steps, stats.speculative_steps, stats.drafted, stats.accepted) == (2, 1, 4, 3)
    assert stats.emitted == 7 and stats.emitted_per_row_step == {4: 1, 1: 3}
    assert stats.acceptance == 0.75


def test_the_step_clock_picks_the_verify_width_that_gives_the_most_tokens_a_second():
    from servicer.engine.speculation.config import StepClock

    clock = StepClock(probe_every=4)

    def accepting(rate: float):
        return lambda width: 2 * sum(rate**j for j in range(width))  # two rows

    assert clock.choose(2, 5, accepting(0.9))[0] == 5  # nothing measured: try the widest
    clock.record(2, 5, 0.50)  # a first compile at this shape: a one-off
    assert clock.choose(2, 5, accepting(0.9))[0] == 1  # now a step without drafts
    clock.record(2, 1, 0.02)
    clock.record(2, 5, 0.04)
    assert clock.choose(2, 5, accepting(0.9))[0] == 5  # 8.2 tokens in 40 ms beat 2 in 20 ms
    # At a rate of 0.5 width 2 (3 tokens in 25 ms, read off the line) gives the most...
    assert clock.choose(2, 5, accepting(0.5))[0] == 2
    clock.record(2, 2, 0.03)  # ...until it is measured dearer than the line said
    assert clock.choose(2, 5, accepting(0.5))[0] == 3
    assert clock.choose(2, 5, accepting(0.1))[0] == 1  # little accepted: no drafts...
    # ...and after probe_every narrower steps in a row, the widest again, to re-measure it
    assert [clock.choose(2, 5, accepting(0.1))[0] for _ in range(3)] == [1, 5, 1]
    assert clock.choose(16, 5, accepting(0.1))[0] == 5  # another batch size: its own
    assert clock.choose(2, 1, accepting(0.9))[0] == 1  # nothing to draft


def test_the_best_width_has_no_side_effects_and_waits_for_both_measurements():
    from servicer.engine.speculation.config import StepClock

    clock = StepClock(probe_every=1)

    def tokens(width: int) -> float:
        return 1.0 + 0.1 * (width - 1)  # one row that rarely accepts

    assert clock.best(1, 3, tokens) == 3  # nothing measured
    clock.record(1, 3, 0.02)
    assert clock.best(1, 3, tokens) == 1  # the widest is measured, a plain step is not
    clock.record(1, 1, 0.01)
    assert [clock.best(1, 3, tokens) for _ in range(3)] == [1, 1, 1]  # no probing here
