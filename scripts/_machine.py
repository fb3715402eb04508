"""What the machine and a benchmark's children use: memory, CPU time, load, read from ``/proc``.

A benchmark on a shared machine states the load it ran under (other work shares the cores) and, where it starts
processes, what they used. Linux only (``/proc``); a process that ends while it is looked at counts as using nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only its type: the machine's figures need nothing of the launcher
    from p2p_diloco.local.launcher import Child

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
"""``/proc`` CPU times are in these ticks per second."""
GIB, MIB = 2**30, 2**20


def session_memory(child: "Child") -> tuple[int, int]:
    """(PSS, RSS) in bytes of every live process of one child's session (main, DHT, averagers, p2pd)."""
    pss = rss = 0
    for pid, _ in child.session():
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except (FileNotFoundError, ProcessLookupError):  # it ended while we looked: it uses nothing now
            continue
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in ("Pss", "Rss"):
                kib = int(value.split()[0]) * 1024
                pss, rss = (pss + kib, rss) if key == "Pss" else (pss, rss + kib)
    return pss, rss


def session_cpu_s(child: "Child") -> float:
    """CPU seconds (user + system) used so far by the live processes of one child's session."""
    ticks = 0
    for pid, _ in child.session():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # it ended while we looked: its time is lost to the sum
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, ..., utime (12th), stime (13th)
        ticks += int(fields[11]) + int(fields[12])
    return ticks / CLOCK_TICKS


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores (``/proc/stat``)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values) - idle) / CLOCK_TICKS, sum(values) / CLOCK_TICKS


def mem_available() -> int:
    """The machine's available memory (``MemAvailable``), bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo: no MemAvailable line")


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, to two decimals (what a page states beside its timings)."""
    return [round(x, 2) for x in os.getloadavg()]
