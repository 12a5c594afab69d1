"""Tear runs down: every process in a run's namespaces, the namespaces, any bpffs mount, the record.

``cleanup()`` removes what killed runs left behind: registry records whose owner process is gone, and
namespaces carrying this emulator's prefix whose run has no live owner.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from netstorm.emulation import lossfilter, netns, registry
from netstorm.emulation.topology import run_of_namespace

log = logging.getLogger(__name__)


def teardown_namespaces(names: list[str]) -> list[int]:
    """Kill every process inside ``names``, then delete them; returns the pids that were signalled."""
    pids: list[int] = []
    for name in names:
        pids += netns.pids_in(name)
    signalled = netns.terminate(sorted(set(pids)))
    for name in names:
        netns.delete_namespace(name)
    return signalled


def teardown_record(record: registry.RunRecord) -> list[int]:
    """Remove everything ``record`` names, then the record itself."""
    signalled = teardown_namespaces(record.namespaces)
    if record.bpf_mount:
        lossfilter.release(Path(record.bpf_mount))
    record.remove()
    return signalled


@dataclasses.dataclass
class CleanupReport:
    runs: list[str] = dataclasses.field(default_factory=list)
    namespaces: list[str] = dataclasses.field(default_factory=list)
    processes: list[int] = dataclasses.field(default_factory=list)
    broken_records: list[str] = dataclasses.field(default_factory=list)
    live_runs: list[str] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        if not (self.runs or self.namespaces or self.broken_records):
            out = ["nothing to clean up"]
        else:
            out = [f"removed run {r}" for r in self.runs]
            out += [f"deleted namespace {n}" for n in self.namespaces]
            out += [f"stopped {len(self.processes)} process(es): {self.processes}"] if self.processes else []
            out += [f"removed unreadable registry entry {p}" for p in self.broken_records]
        out += [f"left live run {r} alone (its owner is running)" for r in self.live_runs]
        return out


def cleanup() -> CleanupReport:
    """Remove leftovers of runs whose owner is dead; live runs are left alone and reported."""
    report = CleanupReport()
    records, broken = registry.records()
    live = {r.run_id for r in records if r.owner_alive()}
    report.live_runs = sorted(live)
    for record in records:
        if record.run_id in live:
            continue
        present = [n for n in record.namespaces if netns.namespace_exists(n)]
        report.processes += teardown_record(record)
        report.runs.append(record.run_id)
        report.namespaces += present
    for path in broken:
        path.unlink(missing_ok=True)
        report.broken_records.append(str(path))
    orphans = [n for n in netns.list_namespaces() if (run_of_namespace(n) or "") not in live
               and run_of_namespace(n) is not None]
    if orphans:
        report.processes += teardown_namespaces(orphans)
        report.namespaces += orphans
    for mount in Path("/run").glob("netstorm-emu-bpf-*"):
        if mount.name.rsplit("-", 1)[-1] not in live:
            lossfilter.release(mount)
    return report
