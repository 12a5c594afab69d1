#!/usr/bin/env python3
"""Measure two revisions of NetStorm side by side on this machine, one run right after the other.

A refactoring must not cost speed, and only measurements taken alternately on the same host under the
same conditions can show that: each round runs the base revision and then the head revision (and the
next round the other way round, so neither always runs on a warmer host), for the loopback benchmark
and for a static and a dynamic internet2-9 emulation of netstorm against star. The spread between the
rounds of one revision is the run-to-run noise a difference between revisions must exceed.

Usage (as root, from the repository, after ./run setup):
    .venv/bin/python scripts/compare_revisions.py --base REV [--head REV] [--rounds 2] --out DIR

Every raw result lands in DIR as JSON; DIR/summary.json holds the comparison, and
``scripts/compare_revisions.py --summarize DIR`` prints it again (and writes DIR/README.md) from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

LOOPBACK = ["bench", "loopback", "--nodes", "9", "--model-mb", "100", "--iterations", "3"]
STATIC = ["emulate", "internet2-9", "--system", "netstorm,star", "--iterations", "8", "--model", "1M",
          "--bw-scale", "0.25"]
DYNAMIC = ["emulate", "internet2-9-dynamic", "--system", "netstorm,star", "--iterations", "15", "--model", "1M",
           "--bw-scale", "0.25", "--time-scale", "0.1"]


def checkout(rev: str, into: Path) -> Path:
    """A detached worktree of ``rev`` (the measured code imports from it through PYTHONPATH)."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(into), rev], check=True,
                   capture_output=True)
    return into


def run_cli(tree: Path, args: list[str], out: Path, log: Path) -> None:
    """One CLI run of the code in ``tree``; its result JSON goes to ``out``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    flag = "--json" if args[0] == "bench" else "--out"
    cmd = [sys.executable, "-m", "netstorm.cli", *args, flag, str(out)]
    started = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=sink, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed in {tree} (exit {proc.returncode}); see {log}")
    print(f"  {' '.join(args[:2])}: {time.monotonic() - started:.0f} s", flush=True)


def measure(args: argparse.Namespace) -> None:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from netstorm.provenance import write_result

    meta = {"base": rev_name(args.base), "head": rev_name(args.head), "rounds": args.rounds,
            "base_commit": rev_name(args.base, short=False), "head_commit": rev_name(args.head, short=False),
            "commands": {"loopback": LOOPBACK, "static": STATIC, "dynamic": DYNAMIC}}
    write_result(out / "meta.json", meta, indent=2)   # the host's load and versions when the rounds began
    with tempfile.TemporaryDirectory(prefix="netstorm-compare-") as tmp:
        trees = {"base": checkout(args.base, Path(tmp) / "base"), "head": checkout(args.head, Path(tmp) / "head")}
        try:
            for r in range(args.rounds):
                order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
                for what, cmd in (("loopback", LOOPBACK), ("static", STATIC), ("dynamic", DYNAMIC)):
                    if what not in args.only:
                        continue
                    for side in order:
                        print(f"round {r + 1}: {what} on {side}", flush=True)
                        stem = out / f"{what}-{side}-{r + 1}"
                        run_cli(trees[side], cmd, stem.with_suffix(".json"), stem.with_suffix(".log"))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False,
                               capture_output=True)
    summarize(out)


def rev_name(rev: str, short: bool = True) -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", *(["--short"] if short else []), rev], check=True,
                          capture_output=True, text=True).stdout.strip()


def figures(what: str, doc: dict[str, Any]) -> dict[str, float]:
    """The figures compared: CPU per node and per MB for the loopback bench; per system, the mean
    iteration time and its ratio to the limit (iterations 2..N, as the emulation tables average), and
    the host's CPU use while it ran."""
    if what == "loopback":
        return {"node_cpu_ms_per_mb": 1e3 * doc["node_cpu_s_per_mb"],
                "node_cpu_s_per_iteration_max": doc["node_cpu_s_per_iteration_max"],
                "sync_mb_per_s": doc["sync_bytes_per_s"] / 1e6}
    out: dict[str, float] = {}
    for name, system in doc["systems"].items():
        its = system["iteration_s"][1:]
        limits = system.get("limit_s", [])[1:]
        out[f"{name}_iteration_s"] = statistics.fmean(its)
        if limits and len(limits) == len(its):
            out[f"{name}_x_limit"] = statistics.fmean(t / lim for t, lim in zip(its, limits, strict=True))
        cpu = system.get("cpu", {})
        if "mean_pct" in cpu:  # a CPU-bound host measures contention, not the runtime: say how busy it was
            out[f"{name}_host_cpu_pct"] = float(cpu["mean_pct"])
    return out


def summarize(out: Path) -> dict[str, Any]:
    meta = json.loads((out / "meta.json").read_text())
    summary: dict[str, Any] = {"base": meta["base"], "head": meta["head"], "rounds": meta["rounds"],
                               "commands": meta["commands"], "figures": {}}
    lines = [f"# {meta['base']} (base) against {meta['head']} (head), measured alternately on one host", "",
             "Each figure: the mean over rounds, then every round's value. Spread = max - min over the rounds of",
             "one revision; a difference smaller than the larger spread is run-to-run noise.", "",
             "| benchmark | figure | base | head | head - base | spread base | spread head |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for what in ("loopback", "static", "dynamic"):
        per_side: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
        for side in per_side:
            for path in sorted(out.glob(f"{what}-{side}-*.json")):
                per_side[side].append(figures(what, json.loads(path.read_text())))
        if not per_side["base"] or not per_side["head"]:
            continue
        names = sorted(set(per_side["base"][0]) & set(per_side["head"][0]))
        for name in names:
            b = [f[name] for f in per_side["base"]]
            h = [f[name] for f in per_side["head"]]
            row: dict[str, Any] = {"base": b, "head": h, "base_mean": statistics.fmean(b),
                                   "head_mean": statistics.fmean(h), "spread_base": max(b) - min(b),
                                   "spread_head": max(h) - min(h)}
            summary["figures"][f"{what}.{name}"] = row
            lines.append(f"| {what} | {name} | {row['base_mean']:.3f} ({', '.join(f'{v:.3f}' for v in b)}) | "
                         f"{row['head_mean']:.3f} ({', '.join(f'{v:.3f}' for v in h)}) | "
                         f"{row['head_mean'] - row['base_mean']:+.3f} | {row['spread_base']:.3f} | "
                         f"{row['spread_head']:.3f} |")
    lines += ["", "Commands (each run with `--json`/`--out` into this folder):", ""]
    lines += [f"- {what}: `netstorm {' '.join(cmd)}`" for what, cmd in meta["commands"].items()]
    lines += ["", "Regenerate this page: `.venv/bin/python scripts/compare_revisions.py --summarize DIR`.", ""]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the revision before the change")
    parser.add_argument("--head", default="HEAD", help="the revision after it (default HEAD)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--only", default="loopback,static,dynamic", help="which benchmarks (comma-separated)")
    parser.add_argument("--out", help="folder for the raw results and the summary")
    parser.add_argument("--summarize", metavar="DIR", help="only rebuild DIR's summary from its JSON")
    args = parser.parse_args()
    if args.summarize:
        summarize(Path(args.summarize))
        return
    if not args.base or not args.out:
        parser.error("--base and --out are required to measure")
    args.only = set(args.only.split(","))
    measure(args)


if __name__ == "__main__":
    main()
