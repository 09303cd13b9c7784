"""The engine side: everything that touches MLX lives in this package (and the demo model)."""

from ..engine_config import EngineConfig
from ..messages import EngineStartupError
from .engine import Engine

__all__ = ["Engine", "EngineConfig", "EngineStartupError"]
