"""Small process helpers shared by the tests, the benchmarks and the scripts: a free port to
bind, and the CPU time a process has used."""

from __future__ import annotations

import os
import resource
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (another process may still take it first)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process, or of process `pid` (0.0 when unknown)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # utime and stime are fields 14 and 15 of stat(5), counted after the command name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
