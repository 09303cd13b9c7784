"""The replay behind bench/spec_fixtures.py's numbers: n-gram drafts and greedy acceptance."""

from __future__ import annotations

import sys

from support import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from spec_fixtures import lookup_draft, ngram_draft, speculate, summarize


def test_ngram_draft_takes_the_latest_earlier_occurrence() -> None:
    context = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_draft(context, 3, 4) == [7, 8, 1, 2]  # not the older 4, 5, 9, 1
    assert ngram_draft([1, 2, 3, 4, 1, 2, 3], 3, 4) == [4, 1, 2, 3]
    assert ngram_draft([5, 1, 2, 3], 3, 4) == []  # no earlier occurrence
    assert ngram_draft([1, 2, 3, 1, 2, 3], 3, 4) == [1, 2, 3]  # runs into the tail: shorter


def test_speculate_counts_target_steps() -> None:
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12]
    # Step 1 drafts 13..16 after "10 11 12", all accepted, plus the target's own 17; step 2
    # drafts 10..13 after "15 16 17" and none is accepted (99); step 3 finds no 3-gram (98).
    out = [13, 14, 15, 16, 17, 99, 98]
    steps, drafted, accepted = speculate(prompt, out, lookup_draft)
    assert accepted == 4
    assert steps == 3  # [13..16]+17, 99, 98
    summary = summarize([prompt], [out], lookup_draft)
    assert summary["tokens_per_step"] == len(out) / 3
    assert summary["acceptance"] == accepted / drafted


def test_speculate_with_no_drafts_is_one_token_per_step() -> None:
    steps, drafted, accepted = speculate([1, 2, 3], [4, 5, 6], lambda context, k: [])
    assert (steps, drafted, accepted) == (3, 0, 0)
