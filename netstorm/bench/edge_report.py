"""``python -m netstorm.bench.edge_report results/edge-*.json``: the markdown tables of committed edge
results, so the README's and ``results/``'s tables are generated from the JSON rather than typed: every
benchmark file (``netstorm bench edge --out``) path by path against gloo, and the end-to-end pair of
emulation results (``netstorm emulate ... --out``, one with LAN workers and one without) as the
slowdown per iteration the LAN tier costs, against its target. With ``--sweep``, the planned LAN tier's
runs (``bench edge --lan-scenario``) as JSON: each run's command, host load and resends, a planner's
advantage across one scenario's spread sweep (``sweep``) and every planner per DC (``planned``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PATHS = ("xdp", "userspace", "tcp", "gloo")
E2E_TARGET = 1.2
"""With LAN workers an iteration may take at most this many times as long as without."""


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
        mtu = r.get("mtu", doc.get("mtu", "-"))
        how = r.get("mode", "")
        if path == "xdp" and doc.get("results") == "kernel":
            how += ", results from the kernel"
        out.append(f"| {name} | {doc['workers']} | {doc['loss'] * 100:g} % | {doc['elements']:,} | {mtu} | {path} "
                   f"({how}) | {r['wall_gbit']:.3f} | {vs} | {r['host_cpu_seconds_per_gb']:.2f} | "
                   f"{cpu_vs} | {gateway} | {r['exact']} |")
    return out


def breakdown(docs: dict[str, dict[str, Any]]) -> list[str]:
    """Where each LAN path's CPU went, per datagram the gateway aggregated: the XDP program (kernel
    run-time statistics), the gateway's agent (its thread CPU), the workers' processes (building, sending
    and resending datagrams, taking ACKs and results), and the rest (the kernel's softirq threads and the
    gateway process's other work); then the profile of the gateway and worker processes by shared object and
    symbol, where recorded."""
    lines = ["| file | path | MTU | datagrams | resent | host CPU µs/datagram | XDP program | agent | "
             "workers (user / system) | rest |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    profiles = []
    for name, doc in docs.items():
        for path in ("xdp", "userspace"):
            r = doc.get(path)
            if r is None or "workers_cpu_seconds" not in r or not r.get("packets"):
                continue
            per = 1e6 / r["packets"]
            program = r.get("xdp_program_cpu_seconds", 0.0)
            agent = r.get("agent_cpu_seconds", 0.0)
            workers = r["workers_cpu_seconds"]
            rest = r["host_cpu_seconds"] - program - agent - workers
            split = (f" ({r['workers_cpu_user_seconds'] * per:.1f} / {r['workers_cpu_system_seconds'] * per:.1f})"
                     if "workers_cpu_user_seconds" in r else "")
            lines.append(f"| {name} | {path} | {r.get('mtu', '-')} | {r['packets']:,} | "
                         f"{r.get('retransmitted', 0):,} | "
                         f"{r['host_cpu_seconds'] * per:.1f} | {program * per:.1f} | {agent * per:.1f} | "
                         f"{workers * per:.1f}{split} | {rest * per:.1f} |")
            if r.get("perf"):
                dsos = ", ".join(f"{row['what']} {row['percent']:.0f} %" for row in r["perf"]["by_dso"][:5])
                symbols = ", ".join(f"{row['what'].split()[-1]} {row['percent']:.0f} %"
                                    for row in r["perf"]["by_symbol"][:6])
                profiles.append(f"- `{name}` {path}, the gateway and worker processes by shared object: {dsos}; "
                                f"top symbols: {symbols}")
    return [*lines, "", *profiles] if len(lines) > 2 else []


def end_to_end(docs: dict[str, dict[str, Any]]) -> list[str]:
    """The emulation results: each system's mean steady iteration with and without LAN workers."""
    from netstorm.emulation.results import system_stats

    lines = ["| file | LAN workers | system | gateway aggregation | mean iteration s | x limit | exact |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    means: dict[bool, float] = {}
    for name, doc in docs.items():
        lan = doc.get("features", {}).get("lan_workers")
        for system, stats in system_stats(doc).items():
            s = doc["systems"][system]
            modes = ", ".join(sorted(set(s.get("edge_mode", {}).values()))) or "-"
            lines.append(f"| {name} | {sum(lan.values()) if lan else 0} | {system} | {modes} | "
                         f"{stats['mean_s']:.2f} | {stats['x_limit']:.2f} | {s.get('exact')} |"
                         + (f" error: {s['error'][:80]!r}" if s.get("error") else ""))
            if system == "netstorm":
                means[bool(lan)] = stats["mean_s"]
    if len(means) == 2:
        ratio = means[True] / means[False]
        verdict = "meets" if ratio <= E2E_TARGET else "misses"
        lines += ["", f"With LAN workers an iteration takes {ratio:.2f}x as long as without ({verdict} the "
                      f"{E2E_TARGET:.2f}x target)."]
    return lines


def markdown(files: Sequence[Path]) -> str:
    docs = {path.name: json.loads(path.read_text()) for path in files}
    emulations = {name: doc for name, doc in docs.items() if "systems" in doc}
    maps = {name: doc for name, doc in docs.items() if "maps" in doc}
    benches = [path for path in files if path.name not in emulations and path.name not in maps
               and "planned" not in docs[path.name]]
    out = _bench_table(benches) if benches else ""
    for name, doc in maps.items():
        out += (f"\n- `{name}`: `{doc.get('command', '?')}`: the XDP aggregator for {doc['elements']:,} elements "
                f"({doc['chunks']:,} chunks of {doc['lanes']} lanes, a pool of {doc['pool_slots']:,} slots) holds "
                f"{doc['kernel_map_bytes'] / 2**20:.1f} MiB of maps in the kernel ({len(doc['maps'])} maps, "
                f"their memlock)\n")
    split = breakdown({path.name: docs[path.name] for path in benches})
    if split:
        out += "\n" + "\n".join(split) + "\n"
    if emulations:
        out += ("\n" if out else "") + "\n".join(end_to_end(emulations)) + "\n"
    return out


def _bench_table(files: Sequence[Path]) -> str:
    lines = ["| file | workers | loss | elements | MTU | path | wall Gbit/s | vs gloo | host CPU-s/GB | vs gloo | "
             "gateway CPU-s/GB | exact |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
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


def planned(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per scenario DC, every planner's LAN tier from ``bench edge --lan-scenario`` files (their userspace
    path) against flat and gloo among the same workers: seconds per iteration (the wall window over the
    iterations), aggregation throughput (``wall_gbit``: the workers' float32 gradient bits per second),
    exactness, and the ratios the planners' papers claim: communication time against flat and gloo, and
    throughput against the precision-oblivious assignment. Repeated runs (the same planner and DC) are
    listed in file order; ratios use their means, and each planner's ``gbit_range`` is the lowest and
    highest run. A run that sent its results after the whole iteration (``"results": "whole"``) is listed
    as ``<planner> whole``, apart from the streamed runs the ratios compare."""
    table: dict[str, Any] = {}
    for name, doc in docs.items():
        lan = doc.get("lan_scenario")
        if lan is None:
            continue
        dc = table.setdefault(f"{lan['scenario']} DC {lan['dc']}", {"runs": {}, "gloo": []})
        for path in ("userspace", "xdp"):
            r = doc.get(path)
            if r is not None:
                key = (lan.get("planner") or "configured") + (" whole" if doc.get("results") == "whole" else "")
                dc["runs"].setdefault(key, []).append({
                    "file": name, "path": path, "iteration_s": round(r["wall_seconds"] / doc["iterations"], 4),
                    "aggregation_gbit": round(r["wall_gbit"], 5), "exact": r["exact"],
                    "clusters": lan.get("clusters", {}), "predicted_gbit": lan.get("predicted_gbit"),
                    "retransmitted": r.get("retransmitted"),
                    "streamed_result_chunks": r.get("streamed_result_chunks"),
                    "host_load_before": doc.get("host", {}).get("load_average_before")})
        if doc.get("gloo") is not None:
            g = doc["gloo"]
            dc["gloo"].append({"file": name, "iteration_s": round(g["wall_seconds"] / doc["iterations"], 4),
                               "aggregation_gbit": round(g["wall_gbit"], 5), "exact": g["exact"]})

    def mean(rows: list[dict[str, Any]], key: str) -> float | None:
        return sum(r[key] for r in rows) / len(rows) if rows else None

    for dc in table.values():
        flat_s = mean(dc["runs"].get("flat", []), "iteration_s")
        gloo_s = mean(dc["gloo"], "iteration_s")
        oblivious = mean(dc["runs"].get("precision-oblivious", []), "aggregation_gbit")
        ratios = {}
        for planner, rows in dc["runs"].items():
            s = mean(rows, "iteration_s")
            gbit = mean(rows, "aggregation_gbit")
            assert s is not None and gbit is not None
            ratios[planner] = {
                "iteration_s": round(s, 4), "aggregation_gbit": round(gbit, 5), "runs": len(rows),
                "gbit_range": [min(r["aggregation_gbit"] for r in rows), max(r["aggregation_gbit"] for r in rows)],
                "less_time_than_flat": round(1 - s / flat_s, 4) if flat_s else None,
                "less_time_than_gloo": round(1 - s / gloo_s, 4) if gloo_s else None,
                "more_throughput_than_oblivious": round(gbit / oblivious - 1, 4) if oblivious else None}
        dc["summary"] = ratios
    return table


ALEPH_TARGET = 0.2
"""ALEPH's claim: at least this much less communication time per iteration than flat and than gloo."""


def _drawn_spread(doc: dict[str, Any]) -> float:
    """The std over mean (population) of a run's worker uplink rates, as drawn from its scenario."""
    rates = [up for up, _ in doc["lan_scenario"]["rates_gbit"]]
    mean = sum(rates) / len(rates)
    return (sum((r - mean) ** 2 for r in rates) / len(rates)) ** 0.5 / mean


def sweep(docs: dict[str, dict[str, Any]], planner: str = "aleph",
          target: float = ALEPH_TARGET) -> dict[str, Any]:
    """A planner's advantage over flat and gloo across one scenario's DCs ordered by their drawn spread:
    per DC the means of ``planned`` and every run's seconds per iteration (the run-to-run spread), the
    ratios from each planner's slowest and fastest run against flat's and gloo's mean (``*_range``), and
    where the advantage starts: the smallest drawn spread from which on (at it and at every larger spread
    swept) the planner takes at least ``target`` less time than both (``onset``), and from which on it
    takes any less time than gloo (``beats_gloo_from``); None where the largest spread does not."""
    table = planned(docs)
    spreads = {}
    for doc in docs.values():
        lan = doc.get("lan_scenario")
        if lan is not None and lan.get("rates_gbit"):
            spreads[f"{lan['scenario']} DC {lan['dc']}"] = (lan["dc"], round(_drawn_spread(doc), 3))
    rows = []
    for key, (dc, spread) in sorted(spreads.items(), key=lambda kv: (kv[1][1], kv[1][0])):
        entry = table[key]
        mine, flat, gloo = entry["runs"].get(planner), entry["runs"].get("flat"), entry["gloo"]
        if not mine or not flat or not gloo:
            continue
        flat_s = sum(r["iteration_s"] for r in flat) / len(flat)
        gloo_s = sum(r["iteration_s"] for r in gloo) / len(gloo)
        runs = [r["iteration_s"] for r in mine]
        row: dict[str, Any] = {
            "dc": dc, "spread_drawn": spread, f"{planner}_s": entry["summary"][planner]["iteration_s"],
            "flat_s": round(flat_s, 4), "gloo_s": round(gloo_s, 4),
            "runs": {planner: runs, "flat": [r["iteration_s"] for r in flat],
                     "gloo": [r["iteration_s"] for r in gloo]},
            "less_time_than_flat": entry["summary"][planner]["less_time_than_flat"],
            "less_time_than_gloo": entry["summary"][planner]["less_time_than_gloo"],
            "less_time_than_flat_range": [round(1 - max(runs) / flat_s, 4), round(1 - min(runs) / flat_s, 4)],
            "less_time_than_gloo_range": [round(1 - max(runs) / gloo_s, 4), round(1 - min(runs) / gloo_s, 4)],
            "clusters": [r["clusters"] for r in mine], "exact": all(r["exact"] for r in [*mine, *flat, *gloo])}
        rows.append(row)

    def onset(holds: Any) -> float | None:
        start = None
        for row in reversed(rows):
            if not holds(row):
                break
            start = row["spread_drawn"]
        return start

    return {"planner": planner, "target": target, "rows": rows,
            "onset": onset(lambda r: min(r["less_time_than_flat"], r["less_time_than_gloo"]) >= target),
            "beats_gloo_from": onset(lambda r: r["less_time_than_gloo"] > 0)}


def sweep_table(result: dict[str, Any]) -> list[str]:
    """The markdown table of ``sweep``'s result: per DC by drawn spread, the run counts, the mean seconds
    per iteration, and the planner's advantage on the means with its range over the planner's runs; then
    where the advantage starts."""
    planner, target = result["planner"], result["target"]

    def pct(value: float) -> str:
        return f"{round(value * 100) + 0:+d} %"

    lines = [f"| DC | drawn spread | runs ({planner}/flat/gloo) | flat s | {planner} s | gloo s | "
             f"{planner} less than flat | {planner} less than gloo |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        runs = row["runs"]
        flat_lo, flat_hi = row["less_time_than_flat_range"]
        gloo_lo, gloo_hi = row["less_time_than_gloo_range"]
        mine = f"{row[f'{planner}_s']:.2f}" + (f" ({min(runs[planner]):.2f}-{max(runs[planner]):.2f})"
                                               if len(runs[planner]) > 1 else "")
        flat = pct(row["less_time_than_flat"]) + (f" ({pct(flat_lo)} to {pct(flat_hi)})" if flat_lo != flat_hi else "")
        gloo = pct(row["less_time_than_gloo"]) + (f" ({pct(gloo_lo)} to {pct(gloo_hi)})" if gloo_lo != gloo_hi else "")
        lines.append(f"| {row['dc']} | {row['spread_drawn']:.2f} | {len(runs[planner])}/{len(runs['flat'])}/"
                     f"{len(runs['gloo'])} | {row['flat_s']:.2f} | {mine} | {row['gloo_s']:.2f} | {flat} | {gloo} |")

    def since(value: float | None) -> str:
        return "at no spread swept" if value is None else f"from a drawn spread of {value:.2f} on"

    lines += ["", f"On the means, {planner} takes at least {target * 100:.0f} % less time per iteration than both "
                  f"flat and gloo {since(result['onset'])}, and less than gloo at all "
                  f"{since(result['beats_gloo_from'])}."]
    return lines


def run_record(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What each planned LAN run was: its command, the host's load average before and after, and where it
    resent (the userspace path's resends, by the stall rule and by NACK, and the drops of the shaped
    ports' queues and of the sockets' receive buffers)."""
    out: dict[str, Any] = {"commands": {}, "host_load": {}, "resends": {}}
    for name, doc in docs.items():
        if doc.get("lan_scenario") is None:
            continue
        out["commands"][name] = doc.get("command")
        host = doc.get("host", {})
        out["host_load"][name] = {"before": host.get("load_average_before"), "after": host.get("load_average_after")}
        r = doc.get("userspace")
        if r is not None:
            drops = r.get("lan_drops", {})
            out["resends"][name] = {
                "retransmitted": r.get("retransmitted"), "stall_resends": r.get("stall_resends"),
                "resent_by_nack": r.get("resent_by_nack"),
                "queue_drops": sum(sum(drops.get(k, {}).values()) for k in ("ports", "uplinks")) if drops else None,
                "udp_rcvbuf_drops": sum(drops.get("udp_rcvbuf", {}).values()) if drops else None}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    as_sweep = bool(args) and args[0] == "--sweep"
    files = [Path(a) for a in args[as_sweep:]]
    if not files:
        print("usage: python -m netstorm.bench.edge_report [--sweep] results/edge-*.json", file=sys.stderr)
        return 2
    if as_sweep:
        docs = {path.name: json.loads(path.read_text()) for path in files}
        doc = {**run_record(docs), "sweep": sweep(docs), "planned": planned(docs)}
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
        return 0
    sys.stdout.write(markdown(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
