"""The engine side: everything that touches MLX lives in this package (and the demo model)."""

from .engine import Engine, EngineStartupError
from .provider import EngineConfig

__all__ = ["Engine", "EngineConfig", "EngineStartupError"]
