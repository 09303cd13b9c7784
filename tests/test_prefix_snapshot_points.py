"""Where a prompt's prefill stops for snapshots: every stop is a prefill call of its own (a
read of all the weights on a memory-bound model), so a stop must save enough to pay for it."""

from __future__ import annotations

from servicer.engine.prefix.snapshots import snapshot_points

BOS, TURN, END = 2, 105, 106  # Gemma's BOS, <start_of_turn>, <end_of_turn>
SPECIALS = frozenset({BOS, TURN, END})
GAP = 128  # half of the default 256-token block


def _chat(system: int, question: int) -> list[int]:
    """BOS, a system turn and a user turn of plain tokens, then the generation prompt."""
    return [
        BOS,
        TURN,
        *range(1000, 1000 + system),
        END,
        *range(3000, 3000 + question),
        END,
        TURN,
        7,
        8,
    ]


def test_a_prompt_sharing_only_its_bos_is_not_split_there() -> None:
    prompt = [BOS, *range(1000, 1128)]
    assert snapshot_points(prompt, 0, 4096, shared=1, specials=SPECIALS, min_gap=GAP) == []
    # Without the gap the prompt's prefill stopped after its first token.
    assert snapshot_points(prompt, 0, 4096, shared=1, specials=SPECIALS) == [1]


def test_random_special_tokens_in_a_short_prompt_make_no_stops() -> None:
    prompt = [BOS, *range(1000, 1030), END, *range(2000, 2040), TURN, *range(3000, 3050)]
    assert snapshot_points(prompt, 0, 4096, shared=0, specials=SPECIALS, min_gap=GAP) == []


def test_a_long_system_message_still_ends_in_a_snapshot() -> None:
    prompt = _chat(system=1500, question=20)
    system_end = 2 + 1500 + 1  # after its <end_of_turn>
    points = snapshot_points(prompt, 0, 4096, shared=0, specials=SPECIALS, min_gap=GAP)
    assert points == [system_end]


def test_stops_are_at_least_the_gap_apart_and_a_shared_prefix_still_counts() -> None:
    prompt = [BOS, *range(1000, 2000)]
    points = snapshot_points(prompt, 0, 256, shared=300, specials=SPECIALS, min_gap=GAP)
    assert points == [256, 512, 768]  # 300 is too close to 256
    points = snapshot_points(prompt, 0, 4096, shared=300, specials=SPECIALS, min_gap=GAP)
    assert points == [300]


def test_the_last_turns_markers_make_no_stop_but_the_first_message_end_does() -> None:
    prompt = [BOS, TURN, *range(1000, 1300), END, *range(2000, 2200), END, TURN, 7, 8]
    first = 2 + 300 + 1
    points = snapshot_points(prompt, 0, 4096, shared=0, specials=SPECIALS, min_gap=GAP)
    assert points == [first]


def test_a_system_message_before_a_short_question_still_ends_in_a_snapshot() -> None:
    # What a second conversation with the same system message resumes from, however close
    # to the prompt's end (the bench's "Question 0?" is a few tokens).
    prompt = [BOS, TURN, *range(1000, 2500), END, TURN, 3000, 3001, END, TURN, 7, 8]
    system_end = 2 + 1500 + 2
    points = snapshot_points(prompt, 0, 4096, shared=0, specials=SPECIALS, min_gap=GAP)
    assert points == [system_end]
