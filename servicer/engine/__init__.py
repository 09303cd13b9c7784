"""The engine side: everything that touches MLX lives in this package (and the demo model).

Importing the package does not import MLX: `Engine` loads on first use, so the handler side
can share the pure modules here (`prefix.keys` names a prompt's blocks on both sides).

Who owns what (which thread holds which object): docs/layout.md, "Threads".
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
