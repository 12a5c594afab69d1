"""What every committed result records about where it was measured: the full commit, the versions of
the project and its key dependencies, and the host's load, so a figure can be traced to the code and the
conditions that made it (``write_result`` is the one place results are written)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

KEY_PACKAGES = ("netstorm", "numpy", "msgspec", "scipy", "highspy", "networkx", "numba", "torch", "matplotlib")
"""Distributions whose versions a result records (absent ones are recorded as null)."""

REPO = Path(__file__).resolve().parent.parent


def commit() -> dict[str, Any]:
    """The checkout's full commit hash and whether its tracked files differ from it (None outside git)."""
    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, timeout=10,
                                  check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": None if dirty is None else bool(dirty)}


def versions() -> dict[str, str | None]:
    """Installed versions of ``KEY_PACKAGES`` (read from their metadata; nothing is imported)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in KEY_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def host_load() -> dict[str, Any]:
    """The host's kernel, CPU count and load averages (1, 5 and 15 minutes) now."""
    return {"kernel": os.uname().release, "cpus": os.cpu_count(), "load_average": list(os.getloadavg())}


def provenance() -> dict[str, Any]:
    """The record ``write_result`` adds under ``provenance``."""
    return {"recorded": True, **commit(), "versions": versions(), "host": host_load(),
            "written_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def stamp(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its ``provenance``; a document that already has one keeps it."""
    return doc if "provenance" in doc else {**doc, "provenance": provenance()}


def write_result(path: str | os.PathLike[str], doc: dict[str, Any], indent: int = 1) -> dict[str, Any]:
    """Write the result ``doc`` to ``path`` as JSON with its provenance; returns what was written."""
    out = stamp(doc)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(out, indent=indent) + "\n")
    return out
