"""What a draft source does for a speculating decoding batch.

Rows are positional, as in the decoding batch: `extend` appends rows, `filter` keeps
some, in the batch's own order. A row's context is `tokens` (what the target's cache holds,
prompt included) followed by its pending token, which the target has sampled but not run.

A source may also have `begin_step(tokens: int | None)`: the runner calls it at the start of
every step with the plan's share of the step for a draft model's catch-up (0 in a step that
prefills prompts: the budget is theirs; None: no bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class DraftSource(Protocol):
    def extend(self, tokens: Sequence[list[int]]) -> None:
        """Rows joined the batch; `tokens` is what each holds in the target's cache."""

    def filter(self, keep: Sequence[int]) -> None:
        """Only these rows stay, in this order."""

    def draft(
        self, tokens: Sequence[list[int]], pending: Sequence[int], ks: Sequence[int]
    ) -> list[list[int]]:
        """Up to `ks[i]` tokens that may follow row i's context (fewer, or none, is fine).
        Rows with `ks[i] == 0` want nothing."""

    def accepted(self, kept: Sequence[int]) -> None:
        """After the step that used the last `draft`: row i kept its pending token and its
        first `kept[i]` drafts; the rest are gone."""
