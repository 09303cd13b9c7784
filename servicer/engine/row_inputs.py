"""What each row of the batch feeds its forwards beside its tokens, from prefill through
decode (speculation's verify and rollback run decode forwards), and the one place a forward's
per-row context is set from it (engine thread only).

A new per-row input is a field of `RowInputs` and a line in `RowContext.forward`; the rows
carry it from admission to their end, through every join and filter of the batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .adapters import AdapterSet
from .mrope import RopePositions, RowPositions
from .vision import ImageSpan, RowRope


@dataclass(slots=True)
class RowInputs:
    """One row's inputs beside its tokens."""

    adapter: int = 0  # its LoRA adapter's index in the model's AdapterSet (0: the base)
    rope: RowRope | None = None  # its prompt's multimodal RoPE (None: standard positions)
    images: list[ImageSpan] = field(default_factory=list)  # those its prefill still needs

    def prefilled_to(self, end: int) -> None:
        """Its prompt is through the model up to `end`: drop the features no chunk needs."""
        self.images = [span for span in self.images if span.end > end]

    @property
    def plain(self) -> bool:
        """Nothing beside its tokens: it may share a packed forward with other rows."""
        return not (self.adapter or self.rope or self.images)


class RowContext:
    """The model's per-row hooks, set for each forward from its rows' inputs: multimodal RoPE
    positions (`rope`, mrope.py) and LoRA adapters (`adapters`, adapters.py)."""

    def __init__(
        self, rope: RopePositions | None = None, adapters: AdapterSet | None = None
    ) -> None:
        self.rope, self.adapters = rope, adapters

    def check(self, rows: Sequence[RowInputs]) -> None:
        """Each row's adapter is one the model holds (0: the base), or ValueError."""
        loaded = len(self.adapters) if self.adapters is not None else 0
        bad = sorted({row.adapter for row in rows if not 0 <= row.adapter <= loaded})
        if bad:
            raise ValueError(f"adapter indices {bad} are not loaded ({loaded} adapters)")

    @contextlib.contextmanager
    def forward(
        self, rows: Sequence[RowInputs], windows: Sequence[tuple[int, int]] | None = None
    ) -> Iterator[None]:
        """Within: each forward runs every row (batch axis) with its own context. A prefill
        chunk's row i covers prompt positions `windows[i]` (start, length); without windows
        the rows decode (positions from their rope delta on). Nothing is set where no row
        needs it, so a text batch runs exactly as without."""
        with contextlib.ExitStack() as stack:
            if self.rope is not None and any(row.rope is not None for row in rows):
                stack.enter_context(self.rope.forward(_positions(rows, windows)))
            if self.adapters is not None and any(row.adapter for row in rows):
                stack.enter_context(self.adapters.forward([row.adapter for row in rows]))
            yield


def _positions(
    rows: Sequence[RowInputs], windows: Sequence[tuple[int, int]] | None
) -> list[RowPositions]:
    if windows is None:
        return [None if row.rope is None else row.rope.delta for row in rows]
    return [
        None if row.rope is None else row.rope.ids[:, start : start + n]
        for row, (start, n) in zip(rows, windows, strict=True)
    ]
