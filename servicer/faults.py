"""Failures and delays injected on purpose, for tests only (never set in production).

Set with the environment variable MLX_GRPC_WORKER_FAULTS, parts separated by `;`:
`step:3,4` (engine steps 3 and 4 raise, the engine recovers), `die:5` (step 5 kills the engine
thread), `hang:5` (step 5 blocks for an hour: a hung step, for the step watchdog),
`resolve:2.5` (resolving the model's files takes 2.5 s longer), `load:8` (loading the
weights takes 8 s longer), `diskfull` (every prompt-cache file write fails with ENOSPC),
`diskro` (the prompt-cache directory is read-only: EROFS), `fetch:2` (the second prompt-cache
lookup raises), `build:N` (the Nth build of a request's cache from blocks raises), `collect:N`
(taking in the Nth block loaded from disk raises), `keep:N` (the Nth keeping of blocks raises),
`plan:N` (the Nth look at a waiting request while planning a step raises),
`slow:MS` (every engine step takes MS milliseconds longer: a slowed worker for the nightly's
regression check),
`reader:N` (the server's reader of the engine process fails on the Nth output frame).
Steps count from 1, from the first step after warm-up; the other counts from 1 too.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass, field

ENV_VAR = "MLX_GRPC_WORKER_FAULTS"
HANG_S = 3600.0  # how long a `hang:N` step blocks: longer than any test waits
COUNTED = (
    "fetch",
    "build",
    "collect",
    "keep",
    "plan",
    "reader",
)  # faults at the Nth call of a kind


class InjectedFault(RuntimeError):
    """A recoverable step failure."""


class InjectedDeath(BaseException):
    """A failure nothing inside the engine catches: the thread dies."""


@dataclass(frozen=True)
class FaultPlan:
    fail_steps: frozenset[int] = frozenset()
    die_at_step: int | None = None
    resolve_delay_s: float = 0.0
    load_delay_s: float = 0.0
    disk_full: bool = False
    disk_read_only: bool = False
    counted: frozenset[tuple[str, int]] = frozenset()  # (kind, N): the Nth call raises
    step_delay_s: float = 0.0
    hang_at_step: int | None = None
    _calls: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        fail: set[int] = set()
        counted: set[tuple[str, int]] = set()
        die = hang = None
        delays = {"resolve": 0.0, "load": 0.0, "slow": 0.0}
        disk = {"diskfull": False, "diskro": False}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            kind, _, value = part.partition(":")
            if kind in disk:
                disk[kind] = True
                continue
            try:
                if kind in delays:
                    delays[kind] = float(value)
                    continue
                numbers = [int(s) for s in value.split(",") if s.strip()]
            except ValueError:
                numbers = []
            if kind == "step" and numbers:
                fail.update(numbers)
            elif kind in COUNTED and numbers:
                counted.update((kind, n) for n in numbers)
            elif kind == "die" and len(numbers) == 1:
                die = numbers[0]
            elif kind == "hang" and len(numbers) == 1:
                hang = numbers[0]
            else:
                usage = (
                    "'step:N[,M...]', 'die:N', 'hang:N', 'resolve:S', 'load:S', 'slow:MS', "
                    "'diskfull', 'diskro', "
                    f"or one of {', '.join(COUNTED)} with ':N[,M...]'"
                )
                raise ValueError(f"bad fault spec {part!r}: use {usage}")
        return cls(
            frozenset(fail),
            die,
            delays["resolve"],
            delays["load"],
            disk["diskfull"],
            disk["diskro"],
            frozenset(counted),
            step_delay_s=delays["slow"] / 1000,
            hang_at_step=hang,
        )

    def before_step(self, step: int) -> None:
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        if step == self.hang_at_step:
            time.sleep(HANG_S)
        if step == self.die_at_step:
            raise InjectedDeath(f"injected engine death at step {step}")
        if step in self.fail_steps:
            raise InjectedFault(f"injected fault at step {step}")

    def before_resolve(self) -> None:
        if self.resolve_delay_s > 0:
            time.sleep(self.resolve_delay_s)

    def before_load(self) -> None:
        if self.load_delay_s > 0:
            time.sleep(self.load_delay_s)

    def before_disk_open(self) -> None:
        if self.disk_read_only:
            raise OSError(errno.EROFS, "Read-only file system (injected)")

    def before_disk_write(self) -> None:
        if self.disk_read_only:
            raise OSError(errno.EROFS, "Read-only file system (injected)")
        if self.disk_full:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def before_call(self, kind: str) -> None:
        """Raise when this is a call of `kind` the plan names (counted per process)."""
        count = self._calls[kind] = self._calls.get(kind, 0) + 1
        if (kind, count) in self.counted:
            raise InjectedFault(f"injected {kind} fault (call {count})")
