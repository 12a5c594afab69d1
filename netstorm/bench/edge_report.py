"""``python -m netstorm.bench.edge_report results/edge-*.json``: the markdown table of committed edge
benchmark results (each file written by ``netstorm bench edge --out``), every path against gloo, so the
README's and ``results/``'s tables are generated from the JSON rather than typed."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PATHS = ("xdp", "userspace", "gloo")


def _cell(r: dict[str, Any] | None, key: str, fmt: str) -> str:
    if r is None or r.get(key) is None:
        return "-"
    return format(r[key], fmt)


def rows(doc: dict[str, Any], name: str) -> list[str]:
    out = []
    for path in PATHS:
        r = doc.get(path)
        if r is None:
            continue
        vs = f"{r['wall_gbit_vs_gloo']:.2f}x" if "wall_gbit_vs_gloo" in r else "-"
        cpu_vs = f"{r['host_cpu_per_gb_vs_gloo']:.2f}x" if "host_cpu_per_gb_vs_gloo" in r else "-"
        gateway = _cell(r, "gateway_cpu_seconds_per_gb", ".2f")
        out.append(f"| {name} | {doc['workers']} | {doc['loss'] * 100:g} % | {doc['elements']:,} | {path} "
                   f"({r.get('mode', '')}) | {r['wall_gbit']:.3f} | {vs} | {r['host_cpu_seconds_per_gb']:.2f} | "
                   f"{cpu_vs} | {gateway} | {r['exact']} |")
    return out


def markdown(files: Sequence[Path]) -> str:
    lines = ["| file | workers | loss | elements | path | wall Gbit/s | vs gloo | host CPU-s/GB | vs gloo | "
             "gateway CPU-s/GB | exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    for path in files:
        doc = json.loads(path.read_text())
        lines += rows(doc, path.name)
        extra = []
        if "kernel_map_bytes" in doc:
            extra.append(f"XDP maps in the kernel {doc['kernel_map_bytes'] / 2**20:.1f} MiB")
        if doc.get("auto_pick"):
            extra.append(f"edge_mode=auto takes {doc['auto_pick']}")
        load = doc.get("host", {}).get("load_average_before")
        if load:
            extra.append(f"host load average before {load[0]:.1f}")
        notes.append(f"- `{path.name}`: `{doc.get('command', '?')}`" + (f"; {'; '.join(extra)}" if extra else ""))
    return "\n".join([*lines, "", *notes]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    files = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not files:
        print("usage: python -m netstorm.bench.edge_report results/edge-*.json", file=sys.stderr)
        return 2
    sys.stdout.write(markdown(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
