"""The engine process: `python -m servicer.engine.child FD`, started by `EngineProcess`.

It reads its configuration from the socket FD, runs one Engine (scheduler, loop, every MLX
object), forwards requests and aborts to it, and sends each hand-off back as one frame. It
ignores SIGINT and SIGTERM (the server drains it), dies with its parent (Linux), and exits as
soon as its socket closes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
import threading

from ..engine_process import (
    ABORT,
    CONFIG,
    DECODE_EMBED,
    DECODE_REQUEST,
    DECODE_TICKET,
    DECODE_TICKETS,
    EMBED,
    FAILED,
    FLUSH,
    LOG_LEVEL_ENV,
    READY,
    STEP,
    STOP,
    SUBMIT,
    Channel,
    Started,
)
from ..messages import EngineStartupError
from ..outbox import Outbox
from .engine import Engine

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def pipe_outbox(channel: Channel) -> Outbox:
    """The engine's outbox in the child: output waits (merged) until some handler needs it,
    then goes to the server as one frame."""

    def send() -> None:
        out = outbox.take()
        if out is None:
            return
        try:
            channel.send(STEP, out)
        except OSError:
            os._exit(0)  # the server is gone: nobody is left to serve

    outbox = Outbox(send)
    return outbox


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass  # the end of file on the socket still ends the process


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    channel = Channel(socket.socket(fileno=int(argv[0])))
    frame = channel.receive()
    if frame is None or frame[0] != CONFIG:
        return 1
    config, info = pickle.loads(frame[1])
    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s",
    )
    # Every request comes over the socket, its grammar uncompiled.
    engine = Engine(config, pipe_outbox(channel), exit_on_stall=True, crossed=True)
    engine.start(info)
    threading.Thread(target=_report_ready, args=(engine, channel), daemon=True).start()
    _serve(engine, channel)
    engine.shutdown(30)
    return 1 if engine.failure else 0


def _report_ready(engine: Engine, channel: Channel) -> None:
    try:
        engine.wait_ready()
    except EngineStartupError as exc:
        channel.send(FAILED, Started(None, str(exc)))
        return
    channel.send(READY, Started(engine.capabilities))


def _serve(engine: Engine, channel: Channel) -> None:
    """Requests, aborts, embeds and flushes from the server until it says stop or goes away."""
    while (frame := channel.receive()) is not None:
        kind, data = frame
        if kind == SUBMIT:
            engine.submit(DECODE_REQUEST.decode(data))
        elif kind == ABORT:
            engine.abort(DECODE_TICKETS.decode(data))
        elif kind == EMBED:
            engine.embed(DECODE_EMBED.decode(data))
        elif kind == FLUSH:
            engine.flush_cache(DECODE_TICKET.decode(data))
        elif kind == STOP:
            return


if __name__ == "__main__":
    code = main(sys.argv[1:])
    logging.shutdown()
    # Everything the engine owns is closed; the interpreter's own teardown would only race
    # MLX's native threads.
    os._exit(code)
