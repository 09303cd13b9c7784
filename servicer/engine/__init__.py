"""The engine side: everything that touches MLX lives in this package (and the demo model).

Importing the package does not import MLX: `Engine` loads on first use, so the handler side
can share the pure modules here (`prefix.keys` names a prompt's blocks on both sides).

Who owns what:
- The engine thread owns its `EngineLoop` and everything in it: the model and sampling
  (`parts`), the `Batch` and its `BatchRunner`, the `Scheduler`, the `PrefixStore` with its
  index, RAM tier, `DiskLink` and every counter (the disk tier's too). No other thread reads
  them: the loop publishes `EngineFigures` with its output when they change, and everyone
  else reads the latest published ones.
- Other threads reach the engine only through queues: the `Inbox` (requests, aborts, stop,
  a nudge) in, the `Outbox` (its sink) out.
- The disk tier's writer and loader threads own their files and queues; they hand results
  back as `Completion`s on a deque the engine thread empties, and wake it with a nudge.
- In process mode the child's main thread feeds the `Inbox` from the socket, and the
  server's reader thread (`EngineProcess`) feeds the server's `Outbox` from it.
- With `--distributed`, the lockstep watchdog thread reads only the time of the last
  progress, and on a stall sends the fatal output and waits for it to be taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..engine_config import EngineConfig
from ..messages import EngineStartupError

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Engine", "EngineConfig", "EngineStartupError"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
