"""A decode step that evaluates its logprobs as one array (engine thread only).

mlx-lm's step splits the batch's logprobs into one array a row (`list(logprobs)`), hands
every row to `mx.async_eval` with the sampled tokens, and evaluates every row of the step
before at the next one. Each row is a slice and a reshape in the graph: at 32 rows that is
~64 of a demo step's ~410 operations, all scheduled and evaluated every step for the few
requests that ask for logprobs. Here the same step evaluates the one array instead; the rows
are still handed out, as slices of it that only a reader evaluates. The tokens sampled, and
every logprob a reader gets, are the same.

The step is mlx-lm's own code, run with two of its names bound to these stand-ins: `list`,
which keeps the array beside its rows, and `mx`, whose evaluations take that array in place
of its rows. An mlx-lm whose step no longer splits this way runs as it is.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

# The module (its `generate` attribute is a function of the same name).
_generate = importlib.import_module("mlx_lm.generate")


class StepRows(list):
    """The rows of one step's logprobs (as mlx-lm keeps them), and the array they slice."""

    __slots__ = ("whole",)

    def __init__(self, whole: mx.array) -> None:
        super().__init__(whole)
        self.whole = whole


def _list(values: Iterable[Any] = ()) -> list[Any]:
    """`list` in mlx-lm's step: an array's rows remember the array."""
    return StepRows(values) if isinstance(values, mx.array) else list(values)


def _evaluable(value: Any) -> Any:
    """The array in place of its rows, while the rows are still just its rows (a batch that
    grew in the meantime has rows of another array too: those go as they are)."""
    if isinstance(value, StepRows) and len(value) == value.whole.shape[0]:
        return value.whole
    return value


class _StepMlx:
    """`mx` in mlx-lm's step: MLX itself (looked up at each call, so a test's stand-in for
    mlx-lm's `mx` sees these calls too), whose evaluations take whole arrays."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_generate.mx, name)

    def async_eval(self, *values: Any) -> None:
        _generate.mx.async_eval(*(_evaluable(v) for v in values))

    def eval(self, *values: Any) -> None:
        _generate.mx.eval(*(_evaluable(v) for v in values))


def _rebound(function: types.FunctionType) -> types.FunctionType:
    names = {**vars(_generate), "mx": _StepMlx(), "list": _list}
    return types.FunctionType(
        function.__code__, names, function.__name__, function.__defaults__, function.__closure__
    )


class WholeLogprobsBatch(GenerationBatch):
    """mlx-lm's GenerationBatch whose step evaluates its logprobs as one array."""

    _step = _rebound(GenerationBatch._step)  # type: ignore[arg-type]
