"""The run registry: one small JSON record per live emulation, so ``--cleanup`` finds killed runs.

A record is written before the first namespace exists and removed after the last one is gone. It names
the owner process (pid and kernel start time, so a reused pid is not mistaken for the owner), the
namespaces and any bpffs mount. Records live in /run (tmpfs), which a reboot clears along with the
namespaces they describe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
from pathlib import Path
from typing import Any

from netstorm.emulation.errors import EmulationError
from netstorm.emulation.netns import process_start_time
from netstorm.emulation.topology import NAMESPACE_PREFIX

REGISTRY_DIR = Path(os.environ.get("NETSTORM_EMU_REGISTRY", "/run/netstorm-emu"))


@dataclasses.dataclass
class RunRecord:
    run_id: str
    owner_pid: int
    owner_start: int | None
    namespaces: list[str] = dataclasses.field(default_factory=list)
    bpf_mount: str | None = None

    @property
    def path(self) -> Path:
        return REGISTRY_DIR / f"{self.run_id}.json"

    def owner_alive(self) -> bool:
        start = process_start_time(self.owner_pid)
        return start is not None and start == self.owner_start

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        tmp.replace(self.path)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _from_json(data: dict[str, Any]) -> RunRecord:
    return RunRecord(str(data["run_id"]), int(data["owner_pid"]), data.get("owner_start"),
                     [str(n) for n in data.get("namespaces", [])], data.get("bpf_mount"))


def reserve(existing_namespaces: list[str]) -> RunRecord:
    """A fresh run id, reserved atomically (O_EXCL) and unused by any namespace on the host."""
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    taken = {name[len(NAMESPACE_PREFIX):len(NAMESPACE_PREFIX) + 4] for name in existing_namespaces
             if name.startswith(NAMESPACE_PREFIX)}
    for _ in range(100):
        run_id = secrets.token_hex(2)
        if run_id in taken:
            continue
        record = RunRecord(run_id, os.getpid(), process_start_time(os.getpid()))
        try:
            fd = os.open(record.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump(dataclasses.asdict(record), fh)
        return record
    raise EmulationError(f"could not reserve a run id in {REGISTRY_DIR}")


def records() -> tuple[list[RunRecord], list[Path]]:
    """Every readable record, and the paths of unreadable ones (left for the caller to report)."""
    out: list[RunRecord] = []
    broken: list[Path] = []
    if not REGISTRY_DIR.is_dir():
        return out, broken
    for path in sorted(REGISTRY_DIR.glob("*.json")):
        try:
            out.append(_from_json(json.loads(path.read_text())))
        except (ValueError, KeyError, TypeError):
            broken.append(path)
    return out, broken
