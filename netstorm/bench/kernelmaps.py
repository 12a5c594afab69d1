"""Kernel memory of the BPF maps this process holds, as the kernel accounts it.

Every map fd's ``/proc/self/fdinfo`` entry carries the map's ``memlock`` (what the kernel charged for it,
including its own overhead) and its ``map_id``; summing them, once per map id, gives the memory a loaded
XDP aggregator pins, read from the kernel rather than computed from our own sizes.
"""

from __future__ import annotations

import os
from pathlib import Path


def map_memory(pid: str = "self") -> dict[int, int]:
    """memlock bytes per map id over the BPF map fds of process ``pid``."""
    out: dict[int, int] = {}
    fd_dir = Path(f"/proc/{pid}/fd")
    for entry in fd_dir.iterdir():
        try:
            if os.readlink(entry) != "anon_inode:bpf-map":
                continue
            info = Path(f"/proc/{pid}/fdinfo/{entry.name}").read_text()
        except OSError:  # closed meanwhile
            continue
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        if "map_id" in fields and "memlock" in fields:
            out[int(fields["map_id"])] = int(fields["memlock"])
    return out


def kernel_map_bytes(pid: str = "self") -> int:
    """Total memlock of the distinct BPF maps process ``pid`` holds."""
    return sum(map_memory(pid).values())
