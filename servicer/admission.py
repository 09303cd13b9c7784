"""The admission guard's policy: what a request's cache costs, and how much may be reserved at
once. Measured on the engine side (`engine.memory`), applied on both: the handlers refuse what
could never fit, the scheduler holds back what cannot fit yet. Pure (no MLX)."""

from __future__ import annotations

import msgspec


class MemoryModel(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Cache bytes one request needs: per token for attention layers (up to a sliding
    window), a fixed amount for recurrent state."""

    per_token: tuple[tuple[int, int | None], ...]  # (bytes per token, window or None)
    fixed_bytes: int
    allocation_step: int  # caches grow in steps of this many tokens (cache_kinds.GROWTH_STEP)

    def estimate(self, tokens: int) -> int:
        step = self.allocation_step
        total = self.fixed_bytes
        for per_token, window in self.per_token:
            total += per_token * (min(tokens, window) if window else -(-tokens // step) * step)
        return total


class Admission(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What requests cost and what may be reserved at once (`limit_bytes`)."""

    memory: MemoryModel
    limit_bytes: int

    def estimate(self, tokens: int) -> int:
        """Cache bytes of a request that may hold `tokens` (its prompt and max_tokens)."""
        return self.memory.estimate(tokens)

    def token_capacity(self) -> int:
        """About how many tokens of cache the limit holds (sliding windows counted whole)."""
        per_token = sum(size for size, _ in self.memory.per_token)
        return self.limit_bytes // per_token if per_token else 0
