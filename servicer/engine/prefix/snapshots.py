"""Where a prompt's prefill stops to snapshot the state that cannot be cut (recurrent layers,
sliding windows): the positions a later prompt is likely to resume from. Pure (no MLX).

A snapshot costs the model's whole uncuttable state (tens of MiB on a real hybrid), so a
prompt takes few: every `interval` tokens, where it stops sharing with what is stored (the
next prompt like it resumes there), and where a chat message ends. A message ends where the
chat template's special tokens (role markers, end of turn) follow its content; a second
conversation with the same system message resumes right after that message, whatever the
interval. Of the message ends, only the first past the cached prefix (a system message, as
a rule) and the last two (the latest turns) are taken.

Every point also costs a prefill call of its own: the prompt's prefill stops there, and on a
memory-bound model each call reads all the weights (about a decode step), and rows that stop
at different points fall out of step with each other. So a point must save at least `min_gap`
tokens over the one before it (or the cached prefix), and a message end other than the first
within MESSAGE_TAIL tokens of the prompt's end (the last turn's markers) is left to the
finished request, which keeps the whole prompt and its output anyway.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

LAST_MESSAGE_ENDS = 2
MESSAGE_TAIL = 8  # a message end this close to the prompt's end is its generation prompt


def snapshot_points(
    prompt: Sequence[int],
    start: int,
    interval: int,
    shared: int,
    specials: Collection[int] = (),
    min_gap: int = 1,
) -> list[int]:
    """Positions past `start` (tokens already cached) and before the prompt's last token at
    which to snapshot. `shared`: how many leading tokens it shares with stored prompts;
    `min_gap`: the fewest tokens a point must add over the previous one."""
    end = len(prompt) - 1
    points = set(range(interval, end, interval))
    if 0 < shared < end:
        points.add(shared)
    ends = message_ends(prompt, start, end, specials)
    # The first message end stays even right before the prompt's end: a system message
    # followed by a short question is what a second conversation resumes from.
    points.update(p for i, p in enumerate(ends) if i == 0 or p + MESSAGE_TAIL < end)
    chosen: list[int] = []
    for point in sorted(p for p in points if start < p < end):
        if point - (chosen[-1] if chosen else start) >= min_gap:
            chosen.append(point)
    return chosen


def message_ends(
    prompt: Sequence[int], start: int, end: int, specials: Collection[int]
) -> list[int]:
    """The ends of the runs of special tokens that follow content, within (start, end): the
    first of them and the last LAST_MESSAGE_ENDS."""
    if not specials or end - start < 2:
        return []
    tokens = np.asarray(prompt[start:end])
    special = np.isin(tokens, np.fromiter(specials, dtype=np.int64))
    # A run of special tokens ends at i (exclusive) when i-1 is special and i is not, and it
    # began after some content (a run at the prompt's start is no message end).
    run_ends = np.flatnonzero(special[:-1] & ~special[1:]) + 1
    content_seen = np.cumsum(~special)
    ends = [int(i) + start for i in run_ends if content_seen[i - 1] > 0]  # each past `start`
    chosen = {*ends[:1], *ends[-LAST_MESSAGE_ENDS:]}
    return sorted(chosen)
