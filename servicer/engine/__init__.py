"""The engine side: everything that touches MLX lives in this package (and the demo model)."""

from .engine import Engine, EngineConfig, EngineStartupError

__all__ = ["Engine", "EngineConfig", "EngineStartupError"]
