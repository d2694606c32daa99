"""/proc readers the benchmarks share (Linux): CPU seconds and resident memory.

Import it from a bench script run as ``python bench/X.py`` (its folder is on
``sys.path``): ``from _proc import cpu_s, rss_kb, reset_peak_rss, status_kb``.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

__all__ = ["cpu_s", "rss_kb", "reset_peak_rss", "status_kb"]


def cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of a process and its direct children (uvicorn
    workers, say); this process alone by default."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(stat.parent.name) == pid or int(fields[1]) == pid:  # fields[1] is the parent pid
            total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def status_kb(key: str, pid: int | str = "self") -> int:
    """One ``kB`` field of ``/proc/<pid>/status``: ``VmRSS`` (resident now), ``VmHWM`` (peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def rss_kb(pid: int | str = "self") -> tuple[int, int]:
    """(resident kB now, peak resident kB since start or ``reset_peak_rss``)."""
    return status_kb("VmRSS", pid), status_kb("VmHWM", pid)


def reset_peak_rss(pid: int | str = "self") -> None:
    """Reset ``VmHWM`` to the current RSS (``clear_refs`` 5), to measure one phase's peak."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
