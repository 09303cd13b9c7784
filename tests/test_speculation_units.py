"""The pieces of speculation on their own: each cache kind's rollback, the n-gram index,
the pace."""

from __future__ import annotations

import itertools
import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
)
from quant_support import quantize_rows

from servicer.engine.cache_kinds import adopt
from servicer.engine.quantized_kv import BatchQuantizedKVCache
from servicer.engine.speculation.caches import (
    RaggedKVCache,
    RaggedQuantizedKVCache,
    RecurrentCache,
    RingKVCache,
)
from servicer.engine.speculation.config import RowPace, SpeculationConfig, SpeculationCounters
from servicer.engine.speculation.ngram import NgramIndex, PromptLookup


def _single(values: list[float]) -> KVCache:
    cache = KVCache()
    data = mx.array(values, dtype=mx.float32).reshape(1, 1, len(values), 1)
    cache.update_and_fetch(data, data)
    return cache


def _append(cache: Any, rows: list[list[float]]) -> None:
    data = mx.array(rows, dtype=mx.float32)[:, None, :, None]
    cache.update_and_fetch(data, data)


def _rows(cache: Any, n: int) -> list[list[float]]:
    return [cache.extract(i).keys[0, 0, :, 0].tolist() for i in range(n)]


def _verify(cache: Any, rows: list[list[float]], kept: list[int]) -> list[int]:
    """A verify forward of `rows` (right-padded), then each row keeps its `kept`."""
    width = max(len(r) for r in rows)
    cache.checkpoint([len(r) for r in rows])
    _append(cache, [r + [-1.0] * (width - len(r)) for r in rows])
    return cache.rollback(kept)


def test_rollback_keeps_each_rows_own_count():
    cache = adopt(BatchKVCache.merge([_single([1, 2, 3]), _single([4]), _single([5, 6])]), 4)
    assert isinstance(cache, RaggedKVCache)
    _verify(cache, [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31]], [1, 4, 2])
    assert _rows(cache, 3) == [[1, 2, 3, 10], [4, 20, 21, 22, 23], [5, 6, 30, 31]]
    assert cache.offset.tolist() == cache.lengths() == [4, 5, 4]
    _append(cache, [[14], [24], [34]])  # the next step writes after what each row kept
    assert _rows(cache, 3) == [[1, 2, 3, 10, 14], [4, 20, 21, 22, 23, 24], [5, 6, 30, 31, 34]]
    cache.filter([2, 0])
    assert _rows(cache, 2) == [[5, 6, 30, 31, 34], [1, 2, 3, 10, 14]]


def test_rollback_copies_nothing_whatever_the_context():
    """A rollback moves each row's end; the buffer is the very same array."""
    cache = adopt(BatchKVCache.merge([_single([1.0] * 300), _single([2.0] * 10)]), 4)
    cache.checkpoint([3, 3])
    _append(cache, [[3, 3, 3], [4, 4, 4]])
    buffer = cache.keys
    cache.rollback([1, 3])
    assert cache.keys is buffer and cache.lengths() == [301, 13]


def test_quantized_rollback_matches_plain():
    rows = []
    for n in (2, 1):
        row = KVCache()
        data = mx.arange(n * 32, dtype=mx.float32).reshape(1, 1, n, 32)
        row.update_and_fetch(data, data)
        rows.append(row)
    plain = adopt(BatchKVCache.merge(rows), 4)
    quant = adopt(BatchQuantizedKVCache.merge(quantize_rows(rows, 8, 32)), 4)
    assert isinstance(quant, RaggedQuantizedKVCache)
    for cache in (plain, quant):
        cache.checkpoint([3, 1])
        data = mx.ones((2, 1, 3, 32))
        cache.update_and_fetch(data, data)
        cache.rollback([2, 1])
    assert plain.lengths() == quant.lengths() == [4, 2]
    row = quant.extract(0)
    assert row.offset == 4 and row.bits == 8
    assert mx.allclose(
        mx.dequantize(*row.keys, group_size=32, bits=8), plain.extract(0).keys, atol=0.2
    )


def _ring(window: int, extra: int, lengths: list[int]) -> RingKVCache:
    rows = []
    for n in lengths:
        row = RotatingKVCache(window)
        for t in range(n):
            v = mx.full((1, 1, 1, 1), float(t))
            row.update_and_fetch(v, v)
        rows.append(row)
    return adopt(BatchRotatingKVCache.merge(rows), extra)


def test_ring_keeps_the_window_through_rollbacks_that_wrap():
    window, k = 6, 3
    cache = _ring(window, k, [10, 3])
    assert isinstance(cache, RingKVCache) and cache.capacity == window + k
    want = [list(range(10)), list(range(3))]
    for step in range(12):
        fed = [[float(len(w) + j) for j in range(k + 1)] for w in want]
        kept = [1 + step % (k + 1), 1 + (step * 2) % (k + 1)]
        assert _verify(cache, fed, kept) == []
        for w, f, n in zip(want, fed, kept, strict=True):
            w.extend(int(x) for x in f[:n])
        assert [int(x) for row in _rows(cache, 2) for x in row] == [
            x for w in want for x in w[-window:]
        ]
        assert cache.offset.tolist() == [len(w) for w in want]


def test_ring_mask_sees_the_window_and_no_stale_slot():
    window, k = 4, 2
    cache = _ring(window, k, [7])
    _verify(cache, [[7.0, 8.0, 9.0]], [1])  # positions 8 and 9 go back
    mask = cache.make_mask(2)  # positions 8 and 9 again (each sees itself, not 9 early)
    keys = [int(x) for x in cache.keys[0, 0, :, 0].tolist()]
    for j in range(2):
        seen = sorted(keys[t] for t in range(cache.capacity) if mask[0, 0, j, t].item())
        assert seen == list(range(8 + j - window + 1, 8 + j + 1)), (j, seen)


def test_recurrent_rollback_restores_and_asks_for_a_replay():
    layer = ArraysCache(1)
    layer[0] = mx.array([[1.0], [2.0], [3.0]])
    cache = adopt(layer, 4)
    assert isinstance(cache, RecurrentCache)
    cache.checkpoint([3, 3, 1])
    cache.advance(3)
    cache[0] = mx.array([[10.0], [20.0], [30.0]])
    # Row 0 kept all it was fed, row 1 part of it, row 2 (padded) all of its one token.
    assert cache.rollback([3, 1, 1]) == [1]
    assert cache[0][:, 0].tolist() == [10.0, 2.0, 30.0]
    assert cache.lengths is None
    cache.checkpoint([3, 3, 1])
    cache.advance(3)
    cache[0] = mx.array([[7.0], [8.0], [9.0]])
    cache.padding_inert = False  # padding moved row 2's state: it replays too
    assert cache.rollback([3, 0, 1]) == [2]
    assert cache[0][:, 0].tolist() == [7.0, 2.0, 30.0]


def test_kinds_that_cannot_roll_back_are_refused():
    with pytest.raises(TypeError, match="ChunkedKVCache"):
        adopt(ChunkedKVCache(8), 4)


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


def _run_steps(clock, rows: int, rates: dict[bool, float], steps: int) -> list[bool]:
    """The mode of each of `steps` steps of 10 ms when drafting gives rates[True] tokens a
    second and not drafting rates[False]."""
    modes = []
    for _ in range(steps):
        mode = clock.drafting(rows)
        modes.append(mode)
        clock.record(rows, round(rates[mode] * 0.01), 0.01, clean=True)
    return modes


def test_the_mode_clock_drafts_only_where_it_delivers_more_tokens_a_second():
    from servicer.engine.speculation.config import ModeClock

    clock = ModeClock(window=4, first_gap=2, most_gap=8)
    losing = _run_steps(clock, 2, {True: 800, False: 1000}, 400)
    assert losing[:4] == [True] * 4 and losing[5:9] == [False] * 4  # each mode measured once
    probes = [i for i in range(1, 400) if losing[i] and not losing[i - 1]]
    assert len(probes) >= 4  # drafting is measured again now and then...
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[-1] >= gaps[0]  # no more often (see the test of a clear loss below)
    # ...but hardly runs: once the gap is at its most, one window of drafting (and the step
    # after the switch) in every nine, about 13 % of the steps.
    assert gaps[-1] == gaps[-2] and losing[-200:].count(True) < 0.16 * 200
    paying = _run_steps(clock, 2, {True: 1500, False: 1000}, 400)  # it pays now
    assert paying[200:].count(True) > 0.7 * 200
    assert _run_steps(clock, 8, {True: 900, False: 1000}, 1) == [True]  # its own batch size


def test_the_mode_clock_keeps_each_batch_sizes_window_open_across_others():
    from servicer.engine.speculation.config import ModeClock

    clock = ModeClock(window=2)
    assert clock.drafting(1) and clock.drafting(3)
    clock.record(1, 1, 0.01, clean=False)  # a prefill shared this one
    for _ in range(5):
        clock.record(1, 1, 5.0, clean=False)
    clock.record(1, 4, 0.01, clean=True)
    clock.record(3, 2, 0.01, clean=True)  # another batch size: its own window
    clock.record(1, 4, 0.01, clean=True)
    assert clock.rates == {(1, True): 400.0}


def test_counters_snapshot():
    counters = SpeculationCounters()
    counters.record(4, 3, [4, 1])
    counters.record(0, 0, [1, 1])
    stats = counters.snapshot()
    assert (stats.steps, stats.speculative_steps, stats.drafted, stats.accepted) == (2, 1, 4, 3)
    assert stats.emitted == 7 and stats.per_row_step == {4: 1, 1: 3}
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


@pytest.mark.parametrize("value", ["0", "-2"])
def test_speculate_max_batch_below_one_is_an_error_naming_the_flag(value, capsys):
    from servicer.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--speculate", "ngram", "--speculate-max-batch", value])
    assert "--speculate-max-batch" in capsys.readouterr().err


def test_the_startup_line_says_the_cap_counts_every_decoding_row(caplog):
    import logging
    from types import SimpleNamespace

    from mlx_lm import load

    from servicer.demos.text import demo_model_path
    from servicer.engine.parts import _speculation
    from servicer.engine_config import EngineConfig

    caplog.set_level(logging.INFO, logger="servicer.engine")
    # A real model: startup runs a trial verify through it.
    loaded = SimpleNamespace(model=load(str(demo_model_path()))[0])
    assert _speculation(EngineConfig(speculate="ngram"), loaded) is not None
    assert any("counts every decoding row" in r.getMessage() for r in caplog.records)


def test_the_clock_charges_each_step_its_own_forward(monkeypatch):
    """mlx-lm's plain step leaves its forward running for the next step to wait on: the
    clock counts only the intervals that hold one forward (F = 160 ms here, its launch 60 ms
    of it), so a plain step after a verify does not read as nearly free."""
    import types

    from servicer.engine.speculation import timing
    from servicer.engine.speculation.config import ModeClock, StepClock

    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    clock = StepClock()
    timer = timing.StepTimer(clock, ModeClock())

    def step(width: int, waited: bool, wait: float, took: float) -> None:
        now[0] += wait  # a drafting step first waits for the forward still running
        timer.forward_begins(waited)
        timer.step_ran(1, width)
        now[0] += took

    step(5, True, 0.0, 0.20)  # a verify of 5 tokens: 200 ms, nothing left running
    step(1, False, 0.0, 0.06)  # plain after it: launches its forward, returns
    step(1, False, 0.0, 0.16)  # plain: waits for that forward (100 ms more), launches its own
    step(1, False, 0.0, 0.16)  # steady state: one forward a step
    step(3, True, 0.10, 0.19)  # drafting: waits out the running forward, then verifies
    step(1, False, 0.0, 0.06)
    step(3, True, 0.10, 0.19)  # after a plain step that began with nothing running
    timer.forward_begins(False)
    periods = {w: [round(s, 3) for s in p] for (_, w), p in clock.periods.items()}
    assert periods == {5: [0.2], 1: [0.16, 0.16], 3: [0.19, 0.19]}


def test_a_lookup_tells_for_free_whether_it_would_have_drafted_the_last_token():
    from servicer.engine.speculation.ngram import NgramIndex

    index = NgramIndex((3, 2))
    assert index.predicted([5, 6, 7, 5, 6, 7])  # "5 6" was followed by 7 before
    assert not NgramIndex((3, 2)).predicted([5, 6, 7, 5, 6, 8])
    assert not NgramIndex((3, 2)).predicted([1, 2, 3, 4])  # nothing to look up
    grown = NgramIndex((3, 2))
    context = [9, 1, 2, 3]
    for token in [1, 2, 3, 1, 2]:  # incremental, as a row grows step by step
        context.append(token)
        grown.predicted(context)
    assert grown.predicted([*context, 3]) and grown.draft(context, 3, 2) == [1, 2]


def test_drafting_is_tried_only_where_the_lookups_promise_it():
    from servicer.engine.speculation.config import ModeClock

    clock = ModeClock(window=2, min_promise=0.25)
    clock.shadow(1, [False])  # a row whose lookups never predict
    assert not clock.drafting(1)  # plain from the start: drafting is not even tried
    for _ in range(100):
        clock.shadow(1, [True])  # the text turned repetitive
    for _ in range(3):
        clock.record(1, 1, 0.01, clean=True)  # the plain window closes
    assert clock.drafting(1)  # now drafting is measured


def test_a_step_before_the_batch_ran_empty_is_not_counted(monkeypatch):
    """At c = 1 every request's last step is followed by idle time and the next request's
    prefill before the next decode step begins: that span is not a step's cost."""
    import types

    from servicer.engine.speculation import timing
    from servicer.engine.speculation.config import ModeClock, StepClock

    now = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    modes, widths = ModeClock(window=1), StepClock()
    timer = timing.StepTimer(widths, modes)

    def step(took: float) -> None:
        timer.step_begins(1, shares_step_with_prefill=False)
        timer.forward_begins(waited=True)
        timer.step_ran(1, 2)
        timer.step_gave(2)
        now[0] += took

    modes.drafting(1)
    step(0.1)
    step(0.1)  # the request's last step
    now[0] += 5.0  # idle, then the next request's prefill
    timer.restart()  # rows join an empty batch
    modes.drafting(1)
    step(0.1)
    assert modes.rates == {(1, True): 20.0}
    assert [round(s, 3) for s in widths.periods[(1, 2)]] == [0.1]


def test_after_the_first_comparison_the_losing_mode_is_measured_again_at_once():
    """A request's first window has had little to copy: drafting that lost it narrowly gets
    another window after one of plain steps, not after `first_gap` of them."""
    from servicer.engine.speculation.config import ModeClock

    clock = ModeClock(window=2, first_gap=4)
    modes = _run_steps(clock, 1, {True: 900, False: 1000}, 12)
    # A window is 2 counted steps; a step after a switch is not counted (it carries the
    # other mode's forward): drafting, plain, plain once more, then drafting again.
    assert modes[:9] == [True, True, False, False, False, False, False, True, True]


def test_a_mode_is_judged_by_its_median_window_not_its_best():
    """Drafting on prose: some windows catch a copied span and are fast, most are slow; on
    average it loses to plain steps, and must not win on its best windows."""
    import random

    from servicer.engine.speculation.config import ModeClock

    draw = random.Random(7)
    clock = ModeClock(window=4, first_gap=2, most_gap=8)
    modes, rate = [], 0.0
    for _ in range(2000):
        opens = 1 not in clock._open
        mode = clock.drafting(1)
        if opens:  # each window of drafting: a fast one in three, on average 880 tokens/s
            rate = (1600 if draw.random() < 1 / 3 else 520) if mode else 1000
        modes.append(mode)
        clock.record(1, round(rate * 0.01), 0.01, clean=True)
    assert modes[-1000:].count(True) < 0.3 * 1000


def test_a_clear_loss_backs_off_faster_than_a_narrow_one():
    """Each look at drafting that loses costs about its shortfall for a window: drafting that
    measures 40 % below plain steps is looked at again only after 40 windows (1 % of the
    steps), a narrow loss after twice the last gap."""
    from servicer.engine.speculation.config import ModeClock

    def probes(drafting_rate: float) -> list[int]:
        clock = ModeClock(window=2, first_gap=2, most_gap=64)
        modes = _run_steps(clock, 1, {True: drafting_rate, False: 1000}, 600)
        return [i for i in range(1, 600) if modes[i] and not modes[i - 1]]

    clear, narrow = probes(600), probes(900)
    assert len(clear) < len(narrow)
    gaps = [b - a for a, b in itertools.pairwise(clear)]
    assert gaps[0] >= 40 * 2  # 40 windows of two counted steps
    narrow_gaps = [b - a for a, b in itertools.pairwise(narrow)]
    assert narrow_gaps[0] < narrow_gaps[1] < gaps[0]  # ten windows, then twice that


def test_the_step_index_is_the_same_a_position_at_a_time_or_in_bulk(monkeypatch):
    """Prompt lookup's index: a prompt's thousands of positions at once (numpy), a step's
    few in a loop; any mix of the two holds the same latest positions."""
    from servicer.engine.speculation import ngram

    draw = random.Random(3)
    for sizes in [(3, 2), (3, 2, 1), (2,), (1,), (3,)]:
        for _ in range(10):
            context = [draw.randrange(12) for _ in range(draw.randrange(1, 900))]
            cuts = sorted(draw.sample(range(1, len(context) + 1), min(len(context), 5)))
            built = []
            for bulk in (1, 10**9):
                monkeypatch.setattr(ngram, "_BULK", bulk)
                index = ngram.NgramIndex(sizes)
                for cut in cuts:
                    index._index(context, cut)
                built.append(index._ends)
            assert built[0] == built[1], (sizes, cuts)


def test_a_mode_measured_long_ago_does_not_take_the_lead_unmeasured():
    """Both modes slow down as the contexts grow, drafting always a quarter behind. Drafting's
    rate from early on must not beat plain steps' rate now: it runs only in the windows that
    measure it again (and loses them), never for longer."""
    from servicer.engine.speculation.config import ModeClock

    clock = ModeClock(window=4, first_gap=2, most_gap=8)
    modes = []
    for step in range(300):
        plain = 4000 * 0.99**step  # tokens a second, falling with the context
        mode = clock.drafting(1)
        modes.append(mode)
        rate = 0.75 * plain if mode else plain
        clock.record(1, round(rate * 0.1), 0.1, clean=True)
    runs = [len(list(group)) for mode, group in itertools.groupby(modes) if mode]
    assert max(runs[1:]) <= 4 + 1  # one window (and its switch step) at a time


def test_a_leader_that_slows_below_the_other_is_measured_against_it_at_once():
    """Drafting wins while the rows copy, then the text stops repeating and drafting falls
    below what plain steps gave: plain steps are measured again at once and take the lead,
    not after the gap a won probe set."""
    from servicer.engine.speculation.config import ModeClock

    clock = ModeClock(window=4, first_gap=32, most_gap=64)
    copying = _run_steps(clock, 1, {True: 1500, False: 1000}, 200)
    assert copying[-100:].count(True) > 90
    stopped = _run_steps(clock, 1, {True: 600, False: 1000}, 100)
    assert stopped[-60:].count(True) < 10  # back to plain steps within a few windows
