"""The block index's rule for the longest reusable prefix (pure, no MLX)."""

from __future__ import annotations

from servicer.engine.prefix.index import BlockIndex
from servicer.engine.prefix.keys import block_keys

BLOCK = 4


def _index(cuttable: bool, stored: list[tuple[list[int], bool]], block: int = BLOCK) -> BlockIndex:
    """An index holding each token list's blocks (the last one a snapshot if asked)."""
    index = BlockIndex(block, cuttable)
    for tokens, snapshot in stored:
        parent = None
        for start in range(0, len(tokens), block):
            piece = tuple(tokens[start : start + block])
            last = start + block >= len(tokens)
            parent = index.add(parent, piece)
            index.set_ram(parent, object(), 1, snapshot and last)
    return index


def _match(index: BlockIndex, prompt: list[int]) -> int:
    return index.match(prompt, block_keys(prompt, index.block_size)).length


def test_attention_only_reuses_any_length_and_leaves_the_last_token():
    index = _index(True, [(list(range(10)), False)])
    assert _match(index, list(range(10))) == 9  # identical: all but the last token
    assert _match(index, [*range(6), 99, 98]) == 6  # cut inside a block
    assert _match(index, [*range(10), 5, 6]) == 10


def test_a_prefix_shorter_than_the_least_worth_reusing_is_no_hit():
    stored = list(range(100, 140))
    index = _index(True, [(stored, False)], block=256)
    assert index.min_reuse == 16
    assert _match(index, [*stored[:15], 7, 8]) == 0  # a BOS, a template's first line
    assert _match(index, [*stored[:16], 7, 8]) == 16
    assert _index(True, [], block=16).min_reuse == 8  # at most half a block


def test_uncuttable_state_reuses_only_prefixes_ending_at_a_snapshot():
    index = _index(False, [(list(range(10)), True)])  # a snapshot at 10 only
    assert _match(index, [*range(10), 7]) == 10
    assert _match(index, [*range(9), 99, 98]) == 0  # shares 9, but no snapshot at 9


def test_a_snapshot_past_the_last_reusable_token_is_not_cut_back():
    # A longer prompt left a snapshot after token 33; a 33-token prompt must leave its last
    # token to the model, and the state after it cannot be rewound: a miss, not a wrong hit.
    prompt = list(range(33))
    index = _index(False, [(prompt, True), (prompt[:32], True)], block=64)
    assert _match(index, prompt) == 32  # the snapshot after 32, never the one after 33
    lone = _index(False, [(prompt, True)], block=64)
    assert _match(lone, prompt) == 0


def test_the_null_store_answers_everything_the_engine_asks_a_store():
    import re
    from pathlib import Path

    from servicer.engine.prefix.store import NoPrefixStore, PrefixStore

    engine = Path(__file__).resolve().parent.parent / "servicer" / "engine"
    asked = set()
    calls = (
        ("engine.py", r"self\.store\.(\w+)"),
        ("planner.py", r"self\._store\.(\w+)"),
        ("engine.py", r"\bstore\.(\w+)"),
        ("batch.py", r"self\._prefix\.(\w+)"),
    )
    for name, pattern in calls:
        asked |= set(re.findall(pattern, (engine / name).read_text()))
    assert {"fetch_admitted", "ready", "keep_later"} <= asked  # the patterns still find the calls
    from mlx_lm.models.cache import KVCache

    from servicer.engine.prefix.store import CacheLayout

    real = PrefixStore(CacheLayout.of([KVCache()]), 16, 64, 1 << 20)
    null = NoPrefixStore()
    assert all(hasattr(null, name) and hasattr(real, name) for name in asked), asked
    assert null.match(None).length == 0 and null.fetch_admitted(None) is None
    assert null.ready(None) and not null.loading and null.stats() is None


def test_a_hits_pins_are_released_once_whoever_holds_them():
    from servicer.engine.prefix.store import Hit, Pins

    released = []
    hit = Hit([], Pins(("a", "b"), released.append), 32)
    row_pins = hit.pins  # the row takes them over
    hit.release()
    row_pins.release()
    hit.release()
    assert released == [("a", "b")] and hit.nodes == ("a", "b")
