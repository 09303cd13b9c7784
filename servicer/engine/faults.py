"""Failures injected on purpose, to test that faults stay local (never set in production).

Set with the environment variable MLX_GRPC_WORKER_FAULTS, e.g. `step:3,4` (engine steps 3 and 4
raise, the engine recovers) or `die:5` (step 5 kills the engine thread). Steps count from 1,
from the first step after warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass

ENV_VAR = "MLX_GRPC_WORKER_FAULTS"


class InjectedFault(RuntimeError):
    """A recoverable step failure."""


class InjectedDeath(BaseException):
    """A failure nothing inside the engine catches: the thread dies."""


@dataclass(frozen=True)
class FaultPlan:
    fail_steps: frozenset[int] = frozenset()
    die_at_step: int | None = None

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        fail: set[int] = set()
        die = None
        for part in filter(None, (p.strip() for p in text.split(";"))):
            kind, _, steps = part.partition(":")
            numbers = [int(s) for s in steps.split(",") if s.strip()]
            if kind == "step" and numbers:
                fail.update(numbers)
            elif kind == "die" and len(numbers) == 1:
                die = numbers[0]
            else:
                raise ValueError(f"bad fault spec {part!r}: use 'step:N[,M...]' or 'die:N'")
        return cls(frozenset(fail), die)

    def before_step(self, step: int) -> None:
        if step == self.die_at_step:
            raise InjectedDeath(f"injected engine death at step {step}")
        if step in self.fail_steps:
            raise InjectedFault(f"injected fault at step {step}")
