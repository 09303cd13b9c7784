"""When engine output reaches a request's handler, and where it waits until then.

This module owns the one output rule; nothing else decides when tokens go to a client.
`handoff_due` says it for one request: it needs its handler for its first token (alone, so the
time to first token never waits for a batch), for every `tokens_per_handoff` tokens after
that once its hand-off window has passed, and for its finish. The engine's rows apply it
(`Row.handoff_due`) to hold a step's output back while no request needs it; each stream
applies it (without the window) to decide when its handler wakes. `output_due` says it for a
whole step's output (what the engine hands to its `Outbox`): due when a row's tokens are, or
when it answers something or finishes a request, or when nothing runs. `Outbox` is the one
place output is merged on its way out of the engine: to the event loop, or, in the engine
process, to the pipe; it wakes its reader when the output put into it is due.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from .messages import StepOutput


def handoff_due(
    *,
    started: bool,
    pending: int,
    per_handoff: int,
    finished: bool,
    waited: float = math.inf,
    window: float = 0.0,
) -> bool:
    """Whether `pending` undelivered events of one request must go to its handler now
    (`started`: it has had tokens before). After the first token a message waits for at least
    `per_handoff` tokens, and while its oldest token would not have waited `window` seconds by
    the end of the next step (`waited`), so a fast model's tokens share messages."""
    return pending > 0 and (
        not started or finished or (pending >= per_handoff and waited >= window)
    )


def output_due(out: StepOutput, rows_due: bool, running: bool) -> bool:
    """Whether a step's output must wake its reader now: some row's tokens are due
    (`rows_due`, from `handoff_due`), it ends a request or answers one (a failure, an
    embedding, a flush), or no row is `running` (no later hand-off would bring it soon)."""
    if rows_due or not running or out.failures or out.embeddings or out.flushed:
        return True
    return any(event.finish_reason for event in out.events)


class Outbox:
    """Engine output waiting for its reader (the event loop, or in the engine process the
    pipe to the server): merged until the reader takes it, with one wake of the reader per
    take, and only once some handler needs what is waiting."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._cond = threading.Condition()
        self._pending: StepOutput | None = None
        self._woken = False

    def put(self, out: StepOutput, due: bool) -> None:
        """From the engine thread: a step's output, and whether some handler needs it now."""
        with self._cond:
            if self._pending is None:
                self._pending = out
            else:
                self._pending.merge(out)
            wake = due and not self._woken
            self._woken = self._woken or wake
        if wake:
            self._wake()

    def take(self) -> StepOutput | None:
        """From the reader, once woken: everything waiting."""
        with self._cond:
            out, self._pending, self._woken = self._pending, None, False
            self._cond.notify_all()
        return out

    def delivered(self, timeout: float) -> bool:
        """Wait until the reader has taken everything put so far (False: `timeout` passed)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None, timeout)
