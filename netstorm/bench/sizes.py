"""``netstorm bench sizes``: every feature at the model sizes the README names, in emulation, exact or not.

Each row is one ``netstorm emulate`` run on a scenario (internet2-9 by default) at ``--bw-scale``, with a
few iterations of the synthetic trainer, which checks every sum exactly. A row records whether every
iteration was exact, the iteration times and their limits, the peak resident memory of the run's
largest process, and the error if any: a failure is a result, written to the file like any other row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from netstorm.provenance import write_result

HELP = ("the size matrix: model sizes up to alexnet and resnet50 x features (compression, topology, LAN edge "
        "modes, DC planners, overlap, secret and wan_tls, paced rates) in emulation; exactness, time, peak RSS")


@dataclass(frozen=True)
class Row:
    """One run of the matrix: its name, the model and the ``netstorm emulate`` flags that select the feature."""

    name: str
    model: str
    flags: tuple[str, ...] = ()
    system: str = "netstorm"
    secret: str = ""
    """``plain`` or ``tls``: the run's processes share a job secret (and with ``tls`` its certificate)."""


LARGEST = ("resnet50", "alexnet")
SIZES = ("250k", "2.5M/20", "25M")
LAN = ("--lan-workers", "2")
HEARTBEAT_30 = ("--heartbeat-timeout", "30", "--heartbeat-interval", "2")


def matrix(quick: bool = False) -> list[Row]:
    """The rows, most telling first: every size with the default system, then each feature at the largest
    models, then the LAN tier (two workers per DC) at a mid size.

    Chosen to finish on a loaded 2-core host: each WAN feature runs at resnet50 (25.6 M parameters), the
    sizes themselves up to alexnet (61.1 M), the LAN options at 2.5M. ``quick`` keeps one small row per
    feature (a smoke run).
    """
    big = "resnet50" if not quick else "2.5M"
    lan = "2.5M" if not quick else "250k"
    rows = [Row(f"size {size}", size) for size in (*SIZES, *LARGEST)] if not quick else [Row("size 250k", "250k")]
    rows += [Row(f"{big} compression {c}", big, ("--compression", c)) for c in ("fp16", "topk", "fediac")]
    rows += [Row(f"{big} topology {s}", big, system=s) for s in ("star", "mst", "fapt")]
    rows.append(Row(f"{big} overlap", big, ("--overlap", "--compute-s", "0.5")))
    rows.append(Row(f"{big} wan_tls", big, ("--wan-tls", "true"), secret="tls"))
    for mode in ("userspace", "tcp", "xdp", "auto"):
        rows.append(Row(f"{lan} edge {mode}", lan, (*LAN, "--edge-mode", mode)))
    for planner in ("pahina", "aleph", "eina"):
        rows.append(Row(f"{lan} dc_planner {planner}", lan,
                        (*LAN, "--edge-mode", "userspace", "--dc-planner", planner)))
    rows.append(Row(f"{lan} pahina unpaced", lan,
                    (*LAN, "--edge-mode", "userspace", "--dc-planner", "pahina", "--dc-pace-rates", "false")))
    rows.append(Row(f"{lan} edge userspace fediac", lan, (*LAN, "--edge-mode", "userspace", "--compression", "fediac")))
    rows.append(Row(f"{big} secret", big, secret="plain"))
    # The failures above at the largest sizes are missed heartbeats on a loaded host: the same runs with
    # a longer heartbeat_timeout tell that cause from a wrong sum.
    rows += [Row(f"{model} heartbeat_timeout 30", model, HEARTBEAT_30) for model in LARGEST[1:]]
    rows.append(Row(f"{big} compression fp16 heartbeat_timeout 30", big, ("--compression", "fp16", *HEARTBEAT_30)))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="internet2-9")
    parser.add_argument("--bw-scale", type=float, default=10.0, help="multiply every WAN rate (default 10)")
    parser.add_argument("--iterations", type=int, default=2, help="iterations per row (default 2)")
    parser.add_argument("--only", default="", help="comma-separated substrings: run the rows whose name has one")
    parser.add_argument("--quick", action="store_true", help="one small row per feature (a smoke run)")
    parser.add_argument("--row-timeout", type=float, default=900.0, help="seconds one row may take in all")
    parser.add_argument("--keep-logs", metavar="DIR", default="",
                        help="keep each row's process logs under DIR/<row> (the evidence of a failed row)")
    parser.add_argument("--out", metavar="FILE", default="results/size-matrix.json",
                        help="result JSON (rewritten after each row)")


def _peak_rss_runner() -> str:
    """A child that runs the command and reports the largest resident set among its descendants."""
    return ("import json, resource, subprocess, sys\n"
            "rc = subprocess.run(sys.argv[2:]).returncode\n"
            "kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
            "open(sys.argv[1], 'w').write(json.dumps({'rc': rc, 'peak_rss_mb': round(kb / 1024, 1)}))\n")


def run_row(row: Row, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Run one row; every outcome, a crash included, is returned as data."""
    out = tmp / "row.json"
    rss = tmp / "rss.json"
    out.unlink(missing_ok=True)
    rss.unlink(missing_ok=True)
    flags = list(row.flags)
    if row.secret:
        secret = tmp / f"secret-{row.secret}"
        if not secret.exists():
            extra = ["--tls"] if row.secret == "tls" else []
            subprocess.run([sys.executable, "-m", "netstorm.cli", "secret", *extra, str(secret)], check=True,
                           capture_output=True)
        flags += ["--secret-file", str(secret)]
    command = [sys.executable, "-m", "netstorm.cli", "emulate", args.scenario, "--system", row.system,
               "--iterations", str(args.iterations), "--model", row.model, "--bw-scale", str(args.bw_scale),
               "--no-loss", "--timeout", str(args.row_timeout), "--out", str(out), *flags]
    if args.keep_logs:
        command += ["--run-dir", str(_row_dir(args, row))]
    started = time.monotonic()
    log = tmp / "row.log"
    # A row that outlives its timeout is recorded below as a row without a result.
    # In its own session, so a row past its timeout is stopped whole (SIGTERM: the emulator tears down).
    with log.open("w") as stream:
        proc = subprocess.Popen([sys.executable, "-c", _peak_rss_runner(), str(rss), *command], stdout=stream,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=args.row_timeout + 120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
    record: dict[str, Any] = {"row": row.name, "model": row.model, "system": row.system,
                              "flags": [f for f in flags if "secret-" not in f], "secret": row.secret or None,
                              "wall_s": round(time.monotonic() - started, 1)}
    measured = json.loads(rss.read_text()) if rss.exists() else {"rc": None, "peak_rss_mb": None}
    record.update(measured)
    tail = log.read_text(errors="replace").splitlines()[-8:]
    if not out.exists():
        record.update(exact=False, error=f"no result written (rc {measured['rc']}): " + " | ".join(tail))
        return record
    result = json.loads(out.read_text())
    systems = result.get("systems", {})
    if not systems:
        record.update(exact=False, error="no system ran: " + " | ".join(tail))
        return record
    name, system = next(iter(systems.items()))
    times = [float(t) for t in system.get("iteration_s", [])]
    limits = [float(t) for t in system.get("limit_s", []) if t is not None]
    record.update(
        system_row=name, parameters=result.get("parameters"), exact=bool(system.get("exact")),
        iterations=len(times), iteration_s=[round(t, 3) for t in times],
        median_iteration_s=round(median(times), 3) if times else None,
        limit_s=round(min(limits), 3) if limits else None, error=system.get("error"),
        edge_mode=system.get("edge_mode"), features=result.get("features", {}).get("not_applied"),
    )
    if not record["exact"] and not record["error"]:
        record["error"] = "not exact: " + " | ".join(tail[-3:])
    return record


def evidence(run_dir: Path) -> str | None:
    """The scheduler's first warning or error in a kept run directory: what went wrong first (a node
    declared dead, a refused registration), where the row's own error is often only a traceback's tail."""
    for log in sorted(run_dir.glob("**/scheduler.log")):
        for line in log.read_text(errors="replace").splitlines():
            if " WARNING " in line or " ERROR " in line:
                return line[:400]
    return None


def _row_dir(args: argparse.Namespace, row: Row) -> Path:
    return Path(args.keep_logs) / row.name.replace(" ", "-").replace("/", "_")


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("netstorm bench sizes: needs root (it runs netstorm emulate)", file=sys.stderr)
        return 2
    rows = matrix(args.quick)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        rows = [r for r in rows if any(w in r.name for w in wanted)]
    out_path = Path(args.out)
    document: dict[str, Any] = {
        "benchmark": "sizes", "scenario": args.scenario, "bw_scale": args.bw_scale, "iterations": args.iterations,
        "trainer": "synthetic (every sum checked exactly)", "host_cpus": os.cpu_count(), "rows": [],
    }
    if out_path.exists():  # resumable: rows already measured are kept unless asked again
        previous = json.loads(out_path.read_text())
        document["rows"] = [r for r in previous.get("rows", []) if r["row"] not in {row.name for row in rows}]
    with tempfile.TemporaryDirectory(prefix="netstorm-sizes-") as tmp:
        for row in rows:
            print(f"[sizes] {row.name} ...", file=sys.stderr, flush=True)
            record = run_row(row, args, Path(tmp))
            if args.keep_logs and not record["exact"]:
                record["evidence"] = evidence(_row_dir(args, row))
            document["rows"].append(record)
            document["all_exact"] = all(r["exact"] for r in document["rows"])
            document.pop("provenance", None)  # this revision's, not the one an earlier part ran at
            document = write_result(out_path, document)
            status = "exact" if record["exact"] else f"FAILED: {record['error']}"
            print(f"[sizes] {row.name}: {status}; median {record.get('median_iteration_s')} s, limit "
                  f"{record.get('limit_s')} s, peak RSS {record.get('peak_rss_mb')} MB, {record['wall_s']} s",
                  file=sys.stderr, flush=True)
    return 0 if document.get("all_exact") else 1
