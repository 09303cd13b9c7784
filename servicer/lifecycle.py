"""The worker's phase of life: owned and advanced by WorkerServer, only read by everyone else.

starting -> loading -> serving -> draining -> stopped, or failed from any of them. The model's
metadata answers from `loading` on; Generate is accepted only while `serving`.
"""

from __future__ import annotations

import asyncio
import contextlib
from enum import Enum
from types import MappingProxyType


class Phase(Enum):
    STARTING = "starting"  # bound; resolving the model's files
    LOADING = "loading"  # files read: metadata answers; the engine loads and warms up
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM: in-flight requests finish, new ones are refused
    FAILED = "failed"  # the engine could not start or died
    STOPPED = "stopped"


_REFUSALS = MappingProxyType(
    {
        Phase.STARTING: "the worker is starting: its model files are still being resolved",
        Phase.LOADING: "the model is still loading; health turns SERVING when it is ready",
        Phase.DRAINING: "the worker is shutting down",
        Phase.STOPPED: "the worker has stopped",
    }
)


class Lifecycle:
    """The current phase and why; `advance` belongs to the server alone."""

    def __init__(self) -> None:
        self._phase = Phase.STARTING
        self._reason = ""
        self._model_known = asyncio.Event()
        self._started = asyncio.Event()  # the start is over: serving, or never will be

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def serving(self) -> bool:
        return self._phase is Phase.SERVING

    @property
    def refusal(self) -> str:
        """Why a Generate call is refused now (meaningful outside `serving`)."""
        return self._reason or _REFUSALS.get(self._phase, "the worker is not serving")

    @property
    def starting(self) -> bool:
        """The worker is on its way to serving (its files or its model still loading)."""
        return self._phase in (Phase.STARTING, Phase.LOADING)

    async def wait_started(self, timeout_s: float) -> None:
        """Returns once the start is over (serving, failed, or shutting down), or after
        `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._started.wait(), max(0.0, timeout_s))

    async def model_known(self) -> None:
        """Returns once the model's files are read (at once after that)."""
        await self._model_known.wait()

    def advance(self, phase: Phase, reason: str = "") -> None:
        if self._phase is Phase.STOPPED:
            return
        if self._phase is Phase.FAILED:
            if phase is not Phase.STOPPED:
                return  # a failure is final; its reason stays
        else:
            self._reason = reason
        self._phase = phase
        if phase is not Phase.STARTING:
            self._model_known.set()
        if not self.starting:
            self._started.set()
