"""Run the whole test suite several times in a row with every core kept busy, and record each run.

    .venv/bin/python scripts/suite_busy.py --runs 5            # writes results/suite-busy.md
    .venv/bin/python scripts/suite_busy.py --render            # its table again from the JSON it holds

Each run is the pytest stage of ``./run test`` (two workers, a file to each) with ``CI=true``, while one
spinning process per core competes with it: the suite's budget is 10 minutes on two busy cores, and a
test that fails only under load is a flake to find. The JSON holds per run its wall and CPU seconds,
the load average, the counts and the failed tests' ids; the Markdown's table is rendered from it, and
the JSON itself is the document's last block (one file in results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPIN = "while True: pass"


def _junit(path: Path) -> dict[str, Any]:
    """Counts and failed ids from pytest's JUnit XML."""
    if not path.exists():
        return {"tests": 0, "passed": 0, "failed": [], "why": {}, "skipped": 0}
    failed, why, skipped, tests = [], {}, 0, 0
    for case in ET.parse(path).iter("testcase"):
        tests += 1
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            failed.append(name)
            why[name] = (bad.get("message") or "")[:400]
        elif case.find("skipped") is not None:
            skipped += 1
    return {"tests": tests, "passed": tests - len(failed) - skipped, "failed": failed, "why": why,
            "skipped": skipped}


def one_run(index: int, spinners: int, pytest_args: list[str]) -> dict[str, Any]:
    """One suite run beside ``spinners`` busy loops; every figure of it as data."""
    base = Path(tempfile.mkdtemp(prefix="nst.", dir="/tmp"))
    junit = base / "junit.xml"
    spin = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(spinners)]
    loads: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(10.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started, wall0 = time.time(), time.monotonic()
    command = [str(ROOT / ".venv" / "bin" / "pytest"), "-q", "-n", "2", "--dist", "loadfile", "--basetemp",
               str(base / "t"), "--junitxml", str(junit), *pytest_args]
    try:
        proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "CI": "true"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        tail = proc.stdout.read().splitlines()[-3:]
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        done.set()
        for p in spin:
            p.kill()
            p.wait()
    record = {"run": index, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
              "wall_s": round(time.monotonic() - wall0, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
              "spinners": spinners, "load_avg_mean": round(sum(loads) / len(loads), 2) if loads else None,
              "exit_code": proc.returncode, **_junit(junit), "summary": tail[-1] if tail else ""}
    subprocess.run(["rm", "-rf", str(base)], check=False)
    return record


def render(document: dict[str, Any]) -> str:
    """The Markdown of a suite-busy JSON document."""
    lines = ["# The test suite, run after run with every core busy", "",
             f"Commit `{document['commit']}`, {document['host_cpus']} CPUs; each run is `./run test`'s pytest "
             f"stage (`-n 2 --dist loadfile`, `CI=true`) beside {document['spinners']} spinning process(es), one "
             "per core. Rendered by `scripts/suite_busy.py --render` from the JSON at the end of this page.", "",
             "| run | started (UTC) | wall | CPU s | load avg | passed | failed | skipped | failed tests |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in document["runs"]:
        minutes = f"{int(r['wall_s'] // 60)}:{int(r['wall_s'] % 60):02d}"
        lines.append(f"| {r['run']} | {r['started']} | {minutes} | {r['cpu_s']} | {r['load_avg_mean']} | "
                     f"{r['passed']} | {len(r['failed'])} | {r['skipped']} | {', '.join(r['failed']) or '-'} |")
    why = [(r["run"], name, text) for r in document["runs"] for name, text in r.get("why", {}).items()]
    if why:
        lines += ["", "What each failure said:", ""]
        lines += [f"- run {run}, `{name}`: {text.splitlines()[0] if text else '(no message recorded)'}"
                  for run, name, text in why]
    runs = document["runs"]
    clean = sum(1 for r in runs if not r["failed"] and r["exit_code"] == 0)
    lines += ["", f"{clean} of {len(runs)} runs passed whole; the longest took "
              f"{max((r['wall_s'] for r in runs), default=0) / 60:.1f} min."]
    lines += ["", "The runs as data (what this page is rendered from):", "", "```json",
              json.dumps(document, indent=1), "```"]
    return "\n".join(lines) + "\n"


def load(path: Path) -> dict[str, Any]:
    """The JSON document a rendered page holds in its last block."""
    text = path.read_text()
    block = text.rsplit("```json\n", 1)[1].split("\n```", 1)[0]
    return dict(json.loads(block))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/suite_busy.py")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--spinners", type=int, default=os.cpu_count() or 2, help="busy loops (default: one per core)")
    parser.add_argument("--out", default=str(ROOT / "results" / "suite-busy.md"))
    parser.add_argument("--render", action="store_true", help="only write the Markdown from the JSON")
    parser.add_argument("--resume", action="store_true", help="add the runs to those already in --out")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not args.render:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        document: dict[str, Any] = {"commit": commit.stdout.strip(), "host_cpus": os.cpu_count(),
                                    "spinners": args.spinners, "runs": []}
        if args.resume and out.exists():
            document["runs"] = load(out)["runs"]
        first = len(document["runs"]) + 1
        for index in range(first, first + args.runs):
            record = one_run(index, args.spinners, args.pytest_args)
            document["runs"].append(record)
            print(json.dumps(record), flush=True)
            out.write_text(render(document))  # after each run: a stopped series keeps its runs
    out.write_text(render(load(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
