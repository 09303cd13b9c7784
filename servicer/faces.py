"""The two wire faces of one worker: the router's MlxEngine and VllmEngine services.

Both carry the same Generate stream (chunks and a GenerateComplete, field for field alike but
for a few names), so the handlers build each face's messages from one description of it. The
smg router refuses n > 1, stop strings, constraints and embeddings for MLX workers and sends
them to vLLM ones: serving VllmEngine too is how a worker gets them (`--protocols`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from .proto import mlx_engine_pb2, vllm_engine_pb2

PROTOCOLS = ("mlx", "vllm")


@dataclass(frozen=True, slots=True)
class Face:
    """How one service spells the Generate messages."""

    name: str
    pb: ModuleType  # the generated module: GenerateResponse, OutputLogProbs, ...
    matched_token_field: str  # GenerateComplete: the stop token that ended generation
    matched_text_field: str  # GenerateComplete: the stop string that ended generation
    carries_text: bool  # chunks and completes have the decoded text (our extension fields)


MLX_FACE = Face("mlx", mlx_engine_pb2, "matched_stop_token_id", "matched_stop", True)
VLLM_FACE = Face("vllm", vllm_engine_pb2, "matched_token_id", "matched_stop_str", False)


def parse_protocols(text: str) -> tuple[str, ...]:
    """`mlx`, `vllm` or `mlx,vllm` (ValueError otherwise)."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in PROTOCOLS]
    if not names or unknown:
        raise ValueError(f"--protocols takes mlx, vllm or mlx,vllm; got {text!r}")
    return names
