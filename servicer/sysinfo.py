"""Small process helpers shared by the worker, the tests, the benchmarks and the scripts: a
free port to bind, the CPU time a process has used, and a heap the collector leaves alone."""

from __future__ import annotations

import gc
import os
import random
import resource
import socket
from pathlib import Path

LOWEST_CHOSEN_PORT = 10_000


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to right now, chosen below the kernel's ephemeral range: a port
    the kernel hands out itself can be taken between choosing it and binding it, by another
    bind to port 0 or as an outgoing connection's source port (a router retrying this very
    port can connect to itself there)."""
    chooser = random.SystemRandom()
    ceiling = _ephemeral_floor()
    for _ in range(200 if ceiling > LOWEST_CHOSEN_PORT else 0):
        port = chooser.randrange(LOWEST_CHOSEN_PORT, ceiling)
        try:
            with socket.socket() as sock:
                sock.bind((host, port))
        except OSError:
            continue
        return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out by itself (Linux's default where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process, or of process `pid` and its children (a
    worker's engine process among them); 0.0 when unknown."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    own = _stat(pid)
    if own is None:
        return 0.0
    total = own[0]
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (child := _stat(int(entry))) is not None and child[1] == pid:
            total += child[0]
    return total


def _stat(pid: int) -> tuple[float, int] | None:
    """(CPU seconds, parent pid) of a process, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command name: state, ppid (field 4 of stat(5)), ..., utime and stime (14, 15).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[1])


def freeze_startup_heap() -> None:
    """Everything alive once a process is ready to serve (the model's modules and arrays, the
    libraries) lives as long as the process: out of the collector's generations, a full
    collection scans only what serving made since. Without it, one scanned ~90,000 startup
    objects on the demo engine and stopped its thread for ~55 ms (a gap in every stream)."""
    gc.collect()
    gc.freeze()


def thaw_startup_heap() -> None:
    """The collector's generations get every object back (a stopped engine or server in a
    process that goes on, as in the tests: its cycles are garbage now)."""
    gc.unfreeze()
