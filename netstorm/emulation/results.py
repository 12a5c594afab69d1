"""The result document of an emulation run, its physical bounds and its terminal summary.

Layout (JSON): scenario, seed, scales, model, features applied and not applied, host CPU per system,
``"systems": {"<name>": {"iteration_s": [...], "sync_s": [...], "limit_s": [...], "link_rate_log":
[...], "started_at_s": [...], "cpu": {...}, "limit_errors": [...], "policy_trees": {...}, ...}}``
(``limit_s``: per iteration, the least time its synchronization could take at the rates in force from
when it began, ``started_at_s``, integrated over any re-draw in between; ``limit_errors``: iterations
faster than their limit, errors of the run; ``policy_trees``: per policy version, its trees as ``netstorm
plan --json`` prints them), ``"limit_s"`` (M/λ at the initial rates) and ``"star_bound_s"`` (the best a
STAR parameter server can do over the emulator's static routes: every other DC's gradient into the hub
and the sum back out, the busiest link deciding, at the best hub).
"""

from __future__ import annotations

import math
import os
import platform
import time
from typing import Any

from netstorm.emulation import recovery
from netstorm.emulation.cpu import CPU_BOUND_PCT, STEAL_WARN_PCT
from netstorm.scenario import Rates, Scenario

FORMAT_VERSION = 1


class Bounds:
    """Physical bounds for a model of ``model_bytes`` over scenario rates scaled by ``bw_scale``."""

    def __init__(self, model_bytes: int, bw_scale: float) -> None:
        self.model_bytes = model_bytes
        self.bw_scale = bw_scale

    def scaled(self, rates: Rates) -> Rates:
        return {k: v * self.bw_scale for k, v in rates.items()}

    def limit_s(self, rates: Rates) -> float:
        """M/λ at scenario ``rates`` (before scaling)."""
        return limit_of_scaled(self.model_bytes, self.scaled(rates))

    def star_bound(self, rates: Rates) -> tuple[float, int]:
        """(seconds, hub) of the best STAR hub at scenario ``rates``."""
        return star_bound_of_scaled(self.model_bytes, self.scaled(rates))


def limit_of_scaled(model_bytes: int, rates: Rates) -> float:
    from netstorm.planning.limit import limit_s

    return float(limit_s(model_bytes, rates))


def star_bound_of_scaled(model_bytes: int, rates: Rates) -> tuple[float, int]:
    """The best STAR hub's time bound and the hub, over the static routes the emulator installs (the hub
    system ``star`` runs at; ``netstorm.planning.baselines.star_bounds`` says how)."""
    from netstorm.planning.baselines import star_bound

    return star_bound(model_bytes, rates)


def new_result(scenario: Scenario, opts: Any, parameters: int, bounds: Bounds) -> dict[str, Any]:
    star_s, hub = bounds.star_bound(scenario.rates())
    dyn = scenario.dynamics
    return {
        "format": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "scenario": scenario.name,
        "scenario_source": scenario.source,
        "nodes": scenario.node_ids,
        "links": [[lk.a, lk.b] for lk in scenario.links],
        "initial_rates_mbit": {f"{a}->{b}": r * bounds.bw_scale for (a, b), r in sorted(scenario.rates().items())},
        "dynamic": dyn is not None,
        "seed": dyn.seed if dyn is not None else None,
        "dynamics_period_s": dyn.period_s * opts.time_scale if dyn is not None else None,
        "bw_scale": opts.bw_scale,
        "time_scale": opts.time_scale,
        "model": {"spec": opts.model, "parameters": parameters, "bytes": 4 * parameters},
        "iterations": opts.iterations,
        "compute_s": opts.compute_s,
        "overlap": opts.overlap,
        "config_flags": list(opts.config_flags),
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "limit_s": bounds.limit_s(scenario.rates()),
        "star_bound_s": star_s,
        "star_bound_hub": hub,
        "features": {},
        "systems": {},
    }


def _parse_rates(text_rates: dict[str, Any]) -> Rates:
    out: Rates = {}
    for key, value in text_rates.items():
        a, b = key.split("->")
        out[(int(a), int(b))] = float(value)
    return out


def rate_segments(rate_log: list[dict[str, Any]]) -> list[Any]:
    """The link rate log as piecewise constant rate segments (``netstorm.planning.limit.RateSegment``).

    A re-draw re-shapes one namespace after another, so for a moment some links have their new rates and
    others their old ones. An entry's ``t`` is when the last link had its new rate; an entry that also
    says when re-shaping began (``t_begin``) gets a segment in between at, per link, the larger of its
    old and new rates: whichever a link had at a given instant, the limit never credits it with less.
    """
    from netstorm.planning.limit import RateSegment

    out: list[RateSegment] = []
    for entry in sorted(rate_log, key=lambda e: float(e["t"])):
        rates = _parse_rates(entry["rates_mbit"])
        begin = float(entry.get("t_begin", entry["t"]))
        if out and begin < float(entry["t"]):
            previous = out[-1].rates
            out.append(RateSegment(begin, {k: max(v, previous.get(k, v)) for k, v in rates.items()}))
        out.append(RateSegment(float(entry["t"]), rates))
    return out


def iteration_starts(outcome: dict[str, Any], result: dict[str, Any] | None = None) -> list[float]:
    """When each iteration's synchronization could first move a byte, in rate-log seconds.

    From the trainers' own clocks when the run recorded them (``started_at_s``: the earliest DC's start
    of each iteration), plus the compute that precedes any push (all of it, or the forward share with
    ``--overlap``); for older results, the end of the previous iteration as the runner saw it.
    """
    from netstorm.models import FORWARD_SHARE

    n = len(outcome["iteration_s"])
    if outcome.get("started_at_s") is not None and len(outcome["started_at_s"]) >= n:
        compute = float((result or {}).get("compute_s", 0.0))
        lead = compute * FORWARD_SHARE if (result or {}).get("overlap") else compute
        return [float(t) + lead for t in outcome["started_at_s"][:n]]
    return [0.0, *outcome["completed_at_s"]][:n]


def iteration_limits(outcome: dict[str, Any], rate_log: list[dict[str, Any]], bounds: Bounds,
                     scenario: Scenario, result: dict[str, Any] | None = None) -> list[float]:
    """The least time each completed iteration's synchronization could have taken, from when it began
    (``iteration_starts``), at the rates in force meanwhile: M/λ while they hold, the integrated bound
    (``window_limit_s``) when a re-draw lands in the window."""
    if not rate_log:
        return [bounds.limit_s(scenario.rates())] * len(outcome["iteration_s"])
    from netstorm.planning.limit import window_limit_s as integrated

    segments = rate_segments(rate_log)
    return [round(integrated(bounds.model_bytes, segments, t), 4) for t in iteration_starts(outcome, result)]


def window_limit_s(model_bytes: int, rate_log: list[dict[str, Any]], start: float) -> float:
    """The least T in which M can leave every cut, from ``start`` on, at the logged rates
    (``netstorm.planning.limit.window_limit_s`` over ``rate_segments``)."""
    from netstorm.planning.limit import window_limit_s as integrated

    return integrated(model_bytes, rate_segments(rate_log), start)


def steady(values: list[float]) -> list[float]:
    """Iterations after the first (which also pays for connection set-up), when there are two or more."""
    return values[1:] if len(values) >= 2 else values


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else float("nan")


def with_compute(sync_s: float, result: dict[str, Any]) -> float:
    """The fastest an iteration can be when its synchronization alone needs ``sync_s``: plus the compute
    time, or, with ``--overlap``, the forward third of it plus the longer of the backward two thirds and
    the synchronization (it starts no earlier than backward and ends no earlier than ``sync_s`` after)."""
    from netstorm.models import FORWARD_SHARE

    compute = float(result.get("compute_s", 0.0))
    if not result.get("overlap"):
        return compute + sync_s
    forward = compute * FORWARD_SHARE
    return forward + max(compute - forward, sync_s)


LIMIT_TOLERANCE_S = 2e-4
"""Iteration times and limits are each rounded to 0.1 ms in a result: a time this far below its limit
is rounding, not an iteration that beat it."""


def failed_steps(system: dict[str, Any]) -> set[int]:
    """Steps of a ``--chaos`` run that failed at every DC: a failure's time is how long the error took to
    arrive, not a synchronization, so no limit bounds it and no mean counts it."""
    steps = (system.get("chaos") or {}).get("steps") or []
    return {int(st["step"]) for st in steps if st.get("failed") and not st.get("contributors")}


def limit_errors(system: dict[str, Any], result: dict[str, Any]) -> list[dict[str, Any]]:
    """The iterations of ``system`` faster than their limit (compute included): none can be, since the
    limit is the least time M can cross the min cut at the rates in force, so each is an error of the run
    (a clock, a log or a limit that is wrong), not a result. Index ``iteration`` counts from 0.
    A compressed row (``emulate --compression``) moves fewer bytes than M: the limit does not bound it."""
    if system.get("compression", "none") != "none":
        return []
    limits = system.get("limit_s") or []
    failed = failed_steps(system)
    out: list[dict[str, Any]] = []
    for k, (seconds, limit) in enumerate(zip(system["iteration_s"], limits, strict=False)):
        if k in failed:
            continue
        bound = with_compute(float(limit), result)
        if seconds + LIMIT_TOLERANCE_S < bound:
            out.append({"iteration": k, "iteration_s": seconds, "limit_s": round(bound, 4),
                        "ratio": round(seconds / bound, 4)})
    return out


def system_stats(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per system: mean steady iteration time, mean limit over the same iterations (compute included),
    their ratio. Iterations that beat their limit (``limit_errors``) and steps that failed everywhere
    (``failed_steps``) are left out of all three."""
    out: dict[str, dict[str, float]] = {}
    for name, s in result["systems"].items():
        wrong = {e["iteration"] for e in limit_errors(s, result)} | failed_steps(s)
        n = len(s["iteration_s"])
        kept = range(1, n) if n >= 2 else range(n)  # as ``steady`` keeps them
        per_limit = s.get("limit_s") or []
        times = [s["iteration_s"][k] for k in kept if k not in wrong]
        limits = [per_limit[k] for k in kept if k not in wrong and k < len(per_limit)]
        t = mean(times)
        lim = with_compute(mean(limits) if limits else result["limit_s"], result)
        out[name] = {"mean_s": t, "limit_s": lim, "x_limit": t / lim if times else float("nan")}
    return out


def summary(result: dict[str, Any]) -> str:
    """The terminal table: time per iteration, ratio to the limit, speed-up over STAR and gloo."""
    stats = system_stats(result)
    model = result["model"]
    lines = [
        f"scenario {result['scenario']} ({'dynamic' if result['dynamic'] else 'static'}), seed {result['seed']}, "
        f"rates x{result['bw_scale']}, time x{result['time_scale']}, model {model['spec']} "
        f"({model['parameters'] / 1e6:.2f} M parameters, {model['bytes'] / 1e6:.1f} MB), "
        f"{result['iterations']} iteration(s), compute {result['compute_s']} s"
        + (" overlapped with synchronization" if result.get("overlap") else ""),
    ]
    feats = result.get("features", {})
    if feats:
        lines.append("applied: " + ", ".join(feats.get("applied", [])))
        lines += [f"NOT applied: {k}: {v}" for k, v in feats.get("not_applied", {}).items()]
    if feats.get("lan_workers"):
        modes = {name: m for name, m in feats.get("edge_mode", {}).items() if isinstance(m, dict)}
        lines.append("LAN workers per DC: " + ", ".join(f"DC {dc}: {n}" for dc, n in feats["lan_workers"].items())
                     + "; gateway aggregation: " + ("; ".join(
                         f"{name} " + ", ".join(f"DC {dc} {mode}" for dc, mode in m.items())
                         for name, m in modes.items()) or "none ran"))
    star = stats.get("star", {}).get("mean_s")
    gloo = stats.get("gloo", {}).get("mean_s")
    wide = max([10, *(len(name) + 1 for name in result["systems"])])  # row names like netstorm+fediac:k=0.2
    header = f"{'system':<{wide}}{'iter s':>10}{'limit s':>10}{'x limit':>9}{'vs STAR':>9}{'vs gloo':>9}" \
             f"{'exact':>7}{'CPU %':>7}{'done':>6}"
    lines += ["", header, "-" * len(header)]
    for name, s in result["systems"].items():
        st = stats[name]
        vs_star = f"{star / st['mean_s']:.2f}x" if star and st["mean_s"] == st["mean_s"] else "-"
        vs_gloo = f"{gloo / st['mean_s']:.2f}x" if gloo and st["mean_s"] == st["mean_s"] else "-"
        lines.append(f"{name:<{wide}}{st['mean_s']:>10.2f}{st['limit_s']:>10.2f}{st['x_limit']:>9.2f}{vs_star:>9}"
                     f"{vs_gloo:>9}{'yes' if s.get('exact') else 'NO':>7}{s['cpu']['mean_pct']:>7.0f}"
                     f"{s['iterations_completed']:>4}/{result['iterations']}")
    lines.append("")
    lines.append(f"iteration times are means over iterations 2..N (the first also sets connections up); "
                 f"limit = M/lambda, the directed min cut (initial: {result['limit_s']:.2f} s)"
                 + (", with the compute time (see with_compute)" if result.get("compute_s") else ""))
    star_bound = result["star_bound_s"]
    lines.append(f"STAR's physical bound: {star_bound:.2f} s at hub {result['star_bound_hub']} (every spoke's M in and "
                 f"out over the static routes, busiest link); a system at the limit can beat STAR by at most "
                 f"{star_bound / result['limit_s']:.2f}x at these rates")
    if star and "netstorm" in stats:
        lines.append(f"measured netstorm vs star: {star / stats['netstorm']['mean_s']:.2f}x")
    for name, s in result["systems"].items():
        if s.get("error"):
            lines.append(f"{name}: FAILED: {s['error']}")
        for e in limit_errors(s, result):
            lines.append(f"ERROR: {name}: iteration {e['iteration'] + 1} took {e['iteration_s']:.2f} s, below its "
                         f"limit {e['limit_s']:.2f} s ({e['ratio']:.2f}x): no iteration can beat its limit, so "
                         "this run's clock, logs or limits are wrong; left out of the means")
        if s["cpu"]["mean_pct"] >= CPU_BOUND_PCT:
            lines.append(f"WARNING: {name}: host CPU averaged {s['cpu']['mean_pct']:.0f}% (this run's own processes "
                         f"{s['cpu'].get('run_pct', float('nan')):.0f}%): CPU-bound, its ratios are not network "
                         "results (scale --bw-scale and --model down together)")
        if s["cpu"].get("steal_pct", 0.0) >= STEAL_WARN_PCT:
            lines.append(f"WARNING: {name}: the hypervisor took {s['cpu']['steal_pct']:.1f}% of the host's CPU "
                         "(steal time) during its run: its iterations carry that noise; compare it with runs "
                         "at none")
    for name, s in result["systems"].items():
        if s.get("chaos"):
            lines += ["", f"{name} under chaos ({s['chaos']['spec']}; times from the system's start):",
                      *recovery.lines(s)]
    return "\n".join(lines)


def allreduce_bound_s(result: dict[str, Any]) -> float:
    """2(n-1)·M / ΣC_in at the initial rates: an all-reduce over n DCs delivers 2(n-1)/n of the model into
    every DC on average (each tree edge carries a share up and the result back down, and no algorithm
    moves less), so the DCs' total incoming capacity bounds it. On equal-capacity overlays this bound
    grows with n while M/λ stays put, which caps scaling efficiency below 1 for any system."""
    n = len(result["nodes"])
    capacity = sum(result["initial_rates_mbit"].values()) * 1e6
    return 2 * (n - 1) * result["model"]["bytes"] * 8 / capacity if capacity > 0 else float("nan")


def scaling(results_list: list[dict[str, Any]]) -> list[str]:
    """Scaling efficiency between the smallest and the largest run of each system and training setup
    (model, compute time, overlap: runs that differ in these are not compared).

    Every DC runs the same trainer, so samples/s grows with n / t(n); the efficiency from n1 to n2 DCs is
    (n2 / t2) / (n1 / t1) / (n2 / n1) = t1 / t2 (1.0: adding DCs costs no time per iteration).
    """
    by_setup: dict[tuple[str, str, float, bool], list[tuple[int, float, float, float, str]]] = {}
    for result in results_list:
        stats = system_stats(result)
        setup = (str(result["model"]["spec"]), float(result.get("compute_s", 0.0)), bool(result.get("overlap")))
        for name, st in stats.items():
            if result["systems"][name]["iteration_s"]:
                by_setup.setdefault((name, *setup), []).append(
                    (len(result["nodes"]), st["mean_s"], st["limit_s"],
                     with_compute(allreduce_bound_s(result), result), result["scenario"]))
    lines: list[str] = []
    for (name, model, compute, overlap), runs in by_setup.items():
        sizes = sorted(runs)
        (n1, t1, lim1, ar1, s1), (n2, t2, lim2, ar2, s2) = sizes[0], sizes[-1]
        if n1 == n2:
            continue
        if compute:
            training = f"model {model}, {compute:g} s compute{' overlapped' if overlap else ''}"
            caveat = " with that compute time"
        else:
            training = f"model {model}, synchronization only"
            caveat = " without compute time to hide the synchronization behind"
        lines.append(f"{name} ({training}): {n1} DCs ({s1}) {t1:.2f} s/iteration -> {n2} DCs ({s2}) {t2:.2f} "
                     f"s/iteration: samples/s x{(n2 / t2) / (n1 / t1):.2f} for x{n2 / n1:.2f} the DCs, scaling "
                     f"efficiency {t1 / t2:.2f}; at the min-cut limit M/λ it would be {lim1 / lim2:.2f}, at the "
                     f"all-reduce bound 2(n-1)M/ΣC_in ({ar1:.2f} s -> {ar2:.2f} s) {ar1 / ar2:.2f}, which no "
                     f"system can beat{caveat}")
    return lines
