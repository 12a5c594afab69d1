"""The paper's evaluation (Figs. 13-20) as emulation runs, and each figure's tables from their results.

A ``Profile`` sizes the evaluation for a host: ``quick`` (under an hour on a 2-core machine) or ``full``
(a few hours). ``runs(profile)`` lists every ``netstorm emulate`` run the figures need, each once: the
static and dynamic internet2-9 runs serve Figs. 13, 14, 16 and 18 and the default point of Figs. 15,
17 and 20. ``FIGURES`` builds, from the results by run name, each figure's table beside the paper's own
numbers (``paper_numbers``) and the data of its chart (``plots.figure_chart`` draws it).

Conventions: "MXNET" is a STAR parameter server at the best-connected hub (system ``star-mxnet``), what
the paper's users ran; ``star`` is STAR at the hub with the best bound, reported beside it. Times are
mean iterations 2..N (``results.system_stats``); throughput is 1 / time (every DC trains the same
batch), so "over MXNET" is MXNET's time over the system's. The paper's design runs as ``paper``,
``paper-std`` and ``paper-lite`` (its lite/std/pro), this project's as ``lite``, ``std`` and ``netstorm``.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from netstorm.emulation import results
from netstorm.emulation.paper_numbers import PaperNumber, by_key, for_figure

PAPER_SYSTEMS = ("paper", "paper-std", "paper-lite")
MXNET = "star-mxnet"
STATIC = "static"
DYNAMIC = "dynamic"
MAIN_SCENARIO = "internet2-9"


@dataclasses.dataclass(frozen=True)
class Run:
    """One ``netstorm emulate`` run: its result is ``<name>.json`` in the output directory."""

    name: str
    scenario: str
    systems: tuple[str, ...]
    iterations: int
    model: str
    bw_scale: float
    time_scale: float = 1.0
    flags: tuple[str, ...] = ()
    figures: tuple[str, ...] = ()
    """Figures that read it (the first one names it in the progress view)."""

    def argv(self, out: str) -> list[str]:
        """``netstorm`` arguments of this run, writing its result to ``out``."""
        argv = ["emulate", self.scenario, "--system", ",".join(self.systems), "--iterations", str(self.iterations),
                "--model", self.model, "--bw-scale", f"{self.bw_scale:g}"]
        if self.time_scale != 1.0:
            argv += ["--time-scale", f"{self.time_scale:g}"]
        return [*argv, *self.flags, "--out", out]

    def command(self, out: str) -> str:
        return "netstorm " + shlex.join(self.argv(out))

    def with_systems(self, names: Sequence[str]) -> Run:
        return dataclasses.replace(self, systems=tuple(names))


@dataclasses.dataclass(frozen=True)
class Profile:
    """How much of the evaluation to run, and at what scale."""

    name: str
    iterations: int
    """Iterations of the main, roots, grid and sensitivity runs."""
    model: str = "1M"
    bw_scale: float = 0.25
    time_scale: float = 0.06
    """The dynamic scenario's 180 s period x this: 10.8 s at 0.06, five to six iterations of a 1 M model
    per period, as the paper's four to seven AlexNet iterations per 3 minutes."""
    roots: tuple[int, ...] = (1, 3, 5, 9)
    busy_bounds: tuple[int, ...] = (1, 2, 4)
    queue_lengths: tuple[int, ...] = (1, 5)
    sweep_systems: tuple[str, ...] = ("paper",)
    """Systems of the grid and sensitivity runs (the paper mode, and in ``full`` ours too)."""
    roots_systems: tuple[str, ...] = ("paper", "netstorm")
    models: tuple[str, ...] = ("3M",)
    """Fig. 19a's sizes beyond ``model`` (parameters; AlexNet x0.25 is 15.3 M, 61 MB)."""
    model_iterations: int = 3
    model_systems: tuple[str, ...] = ("netstorm", "paper", MXNET)
    scales: tuple[str, ...] = ("scale-5", "scale-15")
    scale_model: str = "0.5M"
    scale_bw: float = 0.025
    scale_iterations: int = 4
    chunks_per_model: tuple[int, ...] = (36, 576)
    """Fig. 20's CHUNK_SIZE as chunks per model, beside the default (``DEFAULT_CHUNKS``)."""
    update_times: tuple[float, ...] = (1.0, 20.0)
    probe_chunk_nums: tuple[int, ...] = (1, 32)
    probe_fractions: tuple[float, ...] = (0.05, 1.5)
    """Fig. 20's PROBE_CHUNK_SIZE as a fraction of a chunk's bytes, beside the default (half)."""


QUICK = Profile("quick", iterations=5)
FULL = Profile("full", iterations=12, roots=(1, 2, 3, 4, 5, 6, 7, 8, 9), busy_bounds=(1, 2, 3, 4),
               queue_lengths=(1, 2, 3, 5), sweep_systems=("paper", "netstorm"),
               models=("4M", "6.4M", "11.1M", "15.3M"), model_iterations=4,
               scales=("scale-5", "scale-10", "scale-15"), scale_iterations=6,
               chunks_per_model=(18, 36, 72, 288, 576), update_times=(1.0, 2.0, 10.0, 20.0),
               probe_chunk_nums=(1, 2, 8, 16, 32), probe_fractions=(0.01, 0.05, 0.25, 1.0, 1.5))
PROFILES = {p.name: p for p in (QUICK, FULL)}

DEFAULT_BUSY_BOUND = 2
DEFAULT_QUEUE_LENGTH = 1
DEFAULT_UPDATE_TIME = 5.0
DEFAULT_PROBE_CHUNK_NUM = 4
DEFAULT_PROBE_FRACTION = 0.5
"""The paper's Table II (and this project's config defaults): PRIMARY_BUSY_BOUND 2, AUXILIARY_QUEUE_LENGTH
1, UPDATE_TIME 5 s, PROBE_CHUNK_NUM 4, PROBE_CHUNK_SIZE half a 1 M-parameter chunk."""


def default_chunks(scenario_nodes: int) -> int:
    """Chunks per model the emulator cuts when CHUNK_SIZE is not given (``runner.chunk_flags``)."""
    from netstorm.emulation.runner import CHUNKS_PER_MODEL, CHUNKS_PER_ROOT

    return max(CHUNKS_PER_MODEL, CHUNKS_PER_ROOT * scenario_nodes)


def _parameters(model: str) -> int:
    from netstorm.emulation.gloo_trainer import model_parameters

    return model_parameters(model)


def chunk_elements(model: str, chunks: int) -> int:
    return max(1, -(-_parameters(model) // chunks))


def runs(profile: Profile, nodes: int = 9) -> list[Run]:
    """Every run the figures read, each once, in the order they run (the main runs first)."""
    p = profile
    ours_and_baselines = ("netstorm", "fapt", "mst", "bkt", "star", MXNET)
    main = Run(STATIC, MAIN_SCENARIO, ("paper", *ours_and_baselines), p.iterations, p.model, p.bw_scale,
               figures=("13", "14", "19a"))
    dynamic = Run(DYNAMIC, f"{MAIN_SCENARIO}-dynamic", (*PAPER_SYSTEMS, "netstorm", "std", "lite", "fapt", "mst",
                                                       "bkt", "star", MXNET),
                  p.iterations, p.model, p.bw_scale, p.time_scale, figures=("13", "14", "16", "18", "15", "17", "20"))
    out = [main, dynamic]

    def sweep(name: str, flags: Sequence[str], figure: str, names: Sequence[str] = p.sweep_systems) -> Run:
        return Run(name, f"{MAIN_SCENARIO}-dynamic", tuple(names), p.iterations, p.model, p.bw_scale,
                   p.time_scale, tuple(flags), (figure,))

    out += [sweep(f"roots-{n}", ["--num-root-servers", str(n)], "15", p.roots_systems) for n in p.roots if n != nodes]
    out += [sweep(f"aux-b{b}-q{q}", ["--primary-busy-bound", str(b), "--auxiliary-queue-length", str(q)], "17")
            for b in p.busy_bounds for q in p.queue_lengths if (b, q) != (DEFAULT_BUSY_BOUND, DEFAULT_QUEUE_LENGTH)]
    out += [Run(f"model-{m}", MAIN_SCENARIO, p.model_systems, p.model_iterations, m, p.bw_scale, figures=("19a",))
            for m in p.models]
    out += [Run(s, s, ("paper", "netstorm"), p.scale_iterations, p.scale_model, p.scale_bw, figures=("19b",))
            for s in p.scales]
    chunk_default = chunk_elements(p.model, default_chunks(nodes))
    out += [sweep(f"chunks-{c}", ["--chunk-size", str(chunk_elements(p.model, c))], "20") for c in p.chunks_per_model]
    out += [sweep(f"update-{t:g}", ["--update-time", f"{t:g}"], "20") for t in p.update_times]
    out += [sweep(f"probe-num-{n}", ["--probe-chunk-num", str(n)], "20") for n in p.probe_chunk_nums]
    out += [sweep(f"probe-size-{f:g}", ["--probe-chunk-size", str(max(1, round(4 * chunk_default * f)))], "20")
            for f in p.probe_fractions]
    return out


# --- what the figures compute ---------------------------------------------------------------------------

Results = dict[str, dict[str, Any]]
"""Result documents by run name (absent: not run, or not yet)."""


@dataclasses.dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]


@dataclasses.dataclass
class Chart:
    """What ``plots.figure_chart`` draws: ``kind`` ``bar`` (categories x series), ``line`` (x values x
    series) or ``grid`` (a heat map of ``cells``)."""

    kind: str
    title: str
    ylabel: str
    x: list[str] = dataclasses.field(default_factory=list)
    series: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)
    xlabel: str = ""
    cells: list[list[float | None]] = dataclasses.field(default_factory=list)
    rows: list[str] = dataclasses.field(default_factory=list)
    panels: list[Chart] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class FigureReport:
    figure: str
    title: str
    what: str
    tables: list[Table]
    chart: Chart | None
    runs: list[str]
    missing: list[str]


def seconds(res: Results, run: str, system: str) -> float | None:
    """Mean steady iteration time of ``system`` in ``run`` (None when absent, failed or empty)."""
    result = res.get(run)
    if result is None or system not in result["systems"]:
        return None
    s = result["systems"][system]
    if s.get("error") or not s.get("iteration_s"):
        return None
    t = results.system_stats(result)[system]["mean_s"]
    return t if math.isfinite(t) and t > 0 else None


def x_limit(res: Results, run: str, system: str) -> float | None:
    result = res.get(run)
    if seconds(res, run, system) is None or result is None:
        return None
    v = results.system_stats(result)[system]["x_limit"]
    return v if math.isfinite(v) else None


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def fmt(value: float | None, kind: str = "x") -> str:
    if value is None:
        return "-"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "%":
        return f"{100 * value:+.0f} %"
    if kind == "s":
        return f"{value:.2f}"
    return f"{value:.3g}"


def _paper_row(number: PaperNumber, paper_mode: str, ours: str) -> list[str]:
    return [number.quantity, number.stated, paper_mode, ours]


PAPER_HEADER = ["quantity", "the paper", "paper mode (measured here)", "this project's design (measured here)"]


def fig13(res: Results, profile: Profile) -> FigureReport:
    rows = []
    for run, key in ((STATIC, "speedup_static"), (DYNAMIC, "speedup_dynamic")):
        mx = seconds(res, run, MXNET)
        rows.append(_paper_row(by_key(key), fmt(ratio(mx, seconds(res, run, "paper"))),
                               fmt(ratio(mx, seconds(res, run, "netstorm")))))
    for run in (STATIC, DYNAMIC):
        best = seconds(res, run, "star")
        rows.append([f"over STAR at the hub with the best bound (`star`), {run}", "-",
                     fmt(ratio(best, seconds(res, run, "paper"))), fmt(ratio(best, seconds(res, run, "netstorm")))])
    systems = ["paper", "netstorm", "mst", "bkt", "star", MXNET]
    detail = Table("Per system (seconds per iteration, ratio to the per-iteration limit, speed-up over MXNET)",
                   ["system", "static s", "static x limit", "static over MXNET", "dynamic s", "dynamic x limit",
                    "dynamic over MXNET"], [])
    chart = Chart("bar", "Fig. 13: training speed over MXNET (star-mxnet)", "speed-up over MXNET", x=systems)
    for run in (STATIC, DYNAMIC):
        chart.series[run] = [ratio(seconds(res, run, MXNET), seconds(res, run, s)) for s in systems]
    for s in systems:
        detail.rows.append([f"`{s}`", *[v for run in (STATIC, DYNAMIC) for v in (
            fmt(seconds(res, run, s), "s"), fmt(x_limit(res, run, s)),
            fmt(ratio(seconds(res, run, MXNET), seconds(res, run, s))))]])
    return _report("13", "NetStorm against the baselines, static and dynamic",
                   "MXNET (STAR), MLNET (BKT) and TSEngine (MST) against NetStorm on internet2-9, static and with "
                   "rates re-drawn on schedule.", [Table("Beside the paper", PAPER_HEADER, rows), detail], chart,
                   res, [STATIC, DYNAMIC])


def fig14(res: Results, profile: Profile) -> FigureReport:
    single = "roots-1"
    rows = [
        _paper_row(by_key("fapt_over_star"), "-",
                   fmt(ratio(seconds(res, STATIC, MXNET), seconds(res, STATIC, "fapt")))),
        _paper_row(by_key("fapt_over_bkt_static"), "-",
                   fmt(ratio(seconds(res, STATIC, "bkt"), seconds(res, STATIC, "fapt")))),
        _paper_row(by_key("fapt_over_bkt_dynamic"),
                   fmt(ratio(seconds(res, DYNAMIC, "bkt"), seconds(res, single, "paper"))),
                   fmt(ratio(seconds(res, DYNAMIC, "bkt"), seconds(res, DYNAMIC, "fapt")))),
    ]
    topologies = [MXNET, "star", "bkt", "mst", "fapt"]
    detail = Table("Normalized throughput (MXNET = 1; `fapt` is this project's FAPT with one root)",
                   ["topology", "static", "dynamic"],
                   [[f"`{t}`", *[fmt(ratio(seconds(res, run, MXNET), seconds(res, run, t)))
                                 for run in (STATIC, DYNAMIC)]] for t in topologies])
    chart = Chart("bar", "Fig. 14: normalized throughput per overlay topology", "throughput / MXNET's",
                  x=topologies, series={run: [ratio(seconds(res, run, MXNET), seconds(res, run, t)) for t in topologies]
                                        for run in (STATIC, DYNAMIC)})
    return _report("14", "Overlay topologies", "STAR, BKT, MST and single-root FAPT, static and dynamic. The paper "
                   "mode's single root is Fig. 15's one-root run.",
                   [Table("Beside the paper", PAPER_HEADER, rows), detail], chart, res, [STATIC, DYNAMIC, single])


def _roots_run(n: int, nodes: int = 9) -> str:
    return DYNAMIC if n == nodes else f"roots-{n}"


def fig15(res: Results, profile: Profile) -> FigureReport:
    roots = sorted(set(profile.roots) | {9})
    systems = list(profile.roots_systems)
    table = Table("Seconds per iteration and throughput over one root", ["roots", *[
        h for s in systems for h in (f"`{s}` s", f"`{s}` over 1 root")]], [])
    chart = Chart("line", "Fig. 15: throughput against the number of roots", "throughput / one root's",
                  x=[str(n) for n in roots], xlabel="roots (NUM_ROOT_SERVERS)")
    for s in systems:
        one = seconds(res, _roots_run(1), s)
        chart.series[s] = [ratio(one, seconds(res, _roots_run(n), s)) for n in roots]
    for n in roots:
        table.rows.append([str(n), *[v for s in systems for v in (
            fmt(seconds(res, _roots_run(n), s), "s"), fmt(ratio(seconds(res, _roots_run(1), s),
                                                                seconds(res, _roots_run(n), s))))]])
    one_p, one_o = seconds(res, _roots_run(1), "paper"), seconds(res, _roots_run(1), "netstorm")
    rows = [_paper_row(by_key("roots_9_over_1"), fmt(ratio(one_p, seconds(res, DYNAMIC, "paper"))),
                       fmt(ratio(one_o, seconds(res, DYNAMIC, "netstorm"))))]
    return _report("15", "Number of roots", "Dynamic internet2-9, auxiliary paths on, NUM_ROOT_SERVERS from 1 to 9.",
                   [Table("Beside the paper", PAPER_HEADER, rows), table], chart, res,
                   [_roots_run(n) for n in roots])


def fig16(res: Results, profile: Profile) -> FigureReport:
    pairs = {"paper mode": ("paper-lite", "paper-std"), "this project's design": ("lite", "std")}
    values = {k: (seconds(res, DYNAMIC, off), seconds(res, DYNAMIC, on)) for k, (off, on) in pairs.items()}

    def saved(off: float | None, on: float | None) -> float | None:
        return None if off is None or on is None else 1 - on / off

    pm, ours = values["paper mode"], values["this project's design"]
    rows = [_paper_row(by_key("awareness_off_s"), fmt(pm[0], "s"), fmt(ours[0], "s")),
            _paper_row(by_key("awareness_on_s"), fmt(pm[1], "s"), fmt(ours[1], "s")),
            _paper_row(by_key("awareness_gain"), fmt(saved(*pm), "%"), fmt(saved(*ours), "%"))]
    result = res.get(DYNAMIC)
    chart = Chart("line", "Fig. 16: iteration time with awareness off and on (dynamic)", "seconds",
                  xlabel="iteration")
    if result is not None:
        names = [n for pair in pairs.values() for n in pair if n in result["systems"]]
        longest = max((len(result["systems"][n]["iteration_s"]) for n in names), default=0)
        chart.x = [str(k) for k in range(1, longest + 1)]
        for n in names:
            times = list(result["systems"][n]["iteration_s"])
            chart.series[n] = [*times, *[None] * (longest - len(times))]
    return _report("16", "Network awareness on and off",
                   "Multi-root FAPT without auxiliary paths, planned once (lite) or re-planned from measurements "
                   "(std), on dynamic internet2-9. \"Gained\" is the time saved per iteration, 1 - on/off, as "
                   "the paper's 24 % is (66 - 50) / 66.", [Table("Beside the paper", PAPER_HEADER, rows)], chart,
                   res, [DYNAMIC])


def _grid_run(b: int, q: int) -> str:
    return DYNAMIC if (b, q) == (DEFAULT_BUSY_BOUND, DEFAULT_QUEUE_LENGTH) else f"aux-b{b}-q{q}"


def fig17(res: Results, profile: Profile) -> FigureReport:
    baselines = {"paper": "paper-std", "netstorm": "std"}
    tables: list[Table] = []
    summary: dict[str, tuple[float | None, float | None, str]] = {}
    chart: Chart | None = None
    for system in profile.sweep_systems:
        off = seconds(res, DYNAMIC, baselines.get(system, "std"))
        grid = [[ratio(off, seconds(res, _grid_run(b, q), system)) for q in profile.queue_lengths]
                for b in profile.busy_bounds]
        gains = [[None if g is None else g - 1 for g in row] for row in grid]
        flat = [(g, b, q) for row, b in zip(gains, profile.busy_bounds, strict=True)
                for g, q in zip(row, profile.queue_lengths, strict=True) if g is not None]
        best = max(flat, default=None)
        summary[system] = (min((g for g, _, _ in flat), default=None), max((g for g, _, _ in flat), default=None),
                           f"{best[1]}, {best[2]}" if best else "-")
        tables.append(Table(f"`{system}`: gain of auxiliary paths (Eq. 15) over `{baselines.get(system, 'std')}`, "
                            "rows PRIMARY_BUSY_BOUND, columns AUXILIARY_QUEUE_LENGTH",
                            ["PRIMARY_BUSY_BOUND", *[str(q) for q in profile.queue_lengths]],
                            [[str(b), *[fmt(g, "%") for g in row]] for b, row in zip(profile.busy_bounds, gains,
                                                                                      strict=True)]))
        if chart is None:
            chart = Chart("grid", f"Fig. 17: auxiliary-path gain of `{system}`", "gain",
                          x=[str(q) for q in profile.queue_lengths], rows=[str(b) for b in profile.busy_bounds],
                          cells=gains, xlabel="AUXILIARY_QUEUE_LENGTH")
    pm = summary.get("paper", (None, None, "-"))
    ours = summary.get("netstorm", (None, None, "not run in this profile"))
    rows = [_paper_row(by_key("aux_gain_min"), fmt(pm[0], "%"), fmt(ours[0], "%")),
            _paper_row(by_key("aux_gain_max"), fmt(pm[1], "%"), fmt(ours[1], "%")),
            _paper_row(by_key("aux_best_cell"), pm[2], ours[2])]
    names = sorted({_grid_run(b, q) for b in profile.busy_bounds for q in profile.queue_lengths})
    return _report("17", "PRIMARY_BUSY_BOUND x AUXILIARY_QUEUE_LENGTH",
                   "Gain = t(aux paths off) / t(aux paths on) - 1 on dynamic internet2-9, awareness on, 9 roots; the "
                   "aux-off time is the dynamic run's `paper-std` (`std` for this project's design).",
                   [Table("Beside the paper", PAPER_HEADER, rows), *tables], chart, res, [DYNAMIC, *names])


def fig18(res: Results, profile: Profile) -> FigureReport:
    mx = seconds(res, DYNAMIC, MXNET)
    stages = {"paper mode": ("paper-lite", "paper-std", "paper"), "this project's design": ("lite", "std", "netstorm")}
    pm, ours = stages["paper mode"], stages["this project's design"]

    def t(name: str) -> float | None:
        return seconds(res, DYNAMIC, name)

    rows = [_paper_row(by_key("lite_over_mxnet"), fmt(ratio(mx, t(pm[0]))), fmt(ratio(mx, t(ours[0])))),
            _paper_row(by_key("std_over_lite"), fmt(_gain(t(pm[0]), t(pm[1])), "%"),
                       fmt(_gain(t(ours[0]), t(ours[1])), "%")),
            ["NetStorm-pro over NetStorm-std", "(7.5 / 5.5 / 1.2 = +14 %)", fmt(_gain(t(pm[1]), t(pm[2])), "%"),
             fmt(_gain(t(ours[1]), t(ours[2])), "%")],
            _paper_row(by_key("pro_over_mxnet"), fmt(ratio(mx, t(pm[2]))), fmt(ratio(mx, t(ours[2]))))]
    detail = Table("Seconds per iteration and ratio to the per-iteration limit (dynamic)",
                   ["stage", "paper mode s", "x limit", "ours s", "x limit"],
                   [[stage, fmt(t(a), "s"), fmt(x_limit(res, DYNAMIC, a)), fmt(t(b), "s"),
                     fmt(x_limit(res, DYNAMIC, b))]
                    for stage, a, b in zip(("lite", "std", "pro"), pm, ours, strict=True)])
    detail.rows.insert(0, ["MXNET (`star-mxnet`)", fmt(mx, "s"), fmt(x_limit(res, DYNAMIC, MXNET)), "", ""])
    chart = Chart("bar", "Fig. 18: ablation, speed-up over MXNET (dynamic)", "speed-up over MXNET",
                  x=["lite", "std", "pro"], series={k: [ratio(mx, t(n)) for n in v] for k, v in stages.items()})
    return _report("18", "Ablation: lite, std, pro",
                   "Multi-root FAPT alone (lite), + awareness (std), + auxiliary paths (pro), for the paper's "
                   "design and this project's, on dynamic internet2-9.",
                   [Table("Beside the paper", PAPER_HEADER, rows), detail], chart, res, [DYNAMIC])


def _gain(slower: float | None, faster: float | None) -> float | None:
    r = ratio(slower, faster)
    return None if r is None else r - 1


def _model_runs(profile: Profile) -> list[tuple[str, str]]:
    return [(profile.model, STATIC), *[(m, f"model-{m}") for m in profile.models]]


def fig19a(res: Results, profile: Profile) -> FigureReport:
    systems = list(profile.model_systems)
    table = Table("Seconds per iteration against model size (static internet2-9)",
                  ["model", "parameters", "MB", *[f"`{s}` s" for s in systems], "limit s"], [])
    chart = Chart("line", "Fig. 19a: iteration time against model size (static)", "seconds per iteration",
                  xlabel="model (MB, float32)")
    for s in systems:
        chart.series[s] = []
    for model, run in _model_runs(profile):
        result = res.get(run)
        params = _parameters(model)
        chart.x.append(f"{4 * params / 1e6:.0f}")
        for s in systems:
            chart.series[s].append(seconds(res, run, s))
        limit = fmt(result["limit_s"], "s") if result else "-"
        table.rows.append([model, f"{params / 1e6:.2f} M", f"{4 * params / 1e6:.1f}",
                           *[fmt(seconds(res, run, s), "s") for s in systems], limit])
    first, last = _model_runs(profile)[0][1], _model_runs(profile)[-1][1]
    growth = {s: ratio(seconds(res, last, s), seconds(res, first, s)) for s in systems}
    def grew(system: str) -> str:
        value = growth.get(system)
        return "-" if value is None else f"x{value:.3g}"

    rows = [_paper_row(by_key("model_trend"), f"time {grew('paper')} from the smallest model to the largest",
                       f"time {grew('netstorm')} (MXNET's: {grew(MXNET)})")]
    return _report("19a", "Model size", "NetStorm and MXNET from a 1 M-parameter model up to AlexNet's size x0.25 "
                   "(15.3 M parameters, 61 MB) in the full profile.",
                   [Table("Beside the paper", PAPER_HEADER, rows), table], chart, res,
                   [run for _, run in _model_runs(profile)])


def fig19b(res: Results, profile: Profile) -> FigureReport:
    systems = ["paper", "netstorm"]
    sizes = [(int(s.rsplit("-", 1)[1]), s) for s in profile.scales]
    table = Table("Seconds per iteration and throughput per DC count (static, roots = DCs)",
                  ["DCs", *[h for s in systems for h in (f"`{s}` s", f"`{s}` throughput / 5 DCs'")]], [])
    chart = Chart("line", "Fig. 19b: normalized throughput against cluster size", "samples/s over the smallest",
                  x=[str(n) for n, _ in sizes], xlabel="DCs",
                  series={"ideal (linear)": [n / sizes[0][0] for n, _ in sizes]})
    n0, run0 = sizes[0]

    def normalized(n: int, run: str, system: str) -> float | None:
        t, t0 = seconds(res, run, system), seconds(res, run0, system)
        return None if t is None or t0 is None else (n / t) / (n0 / t0)

    for s in systems:
        chart.series[s] = [normalized(n, run, s) for n, run in sizes]
    for n, run in sizes:
        table.rows.append([str(n), *[v for s in systems for v in (fmt(seconds(res, run, s), "s"),
                                                                  fmt(normalized(n, run, s)))]])
    last = sizes[-1][1]
    rows = [_paper_row(by_key("scaling_efficiency"),
                       fmt(ratio(seconds(res, run0, "paper"), seconds(res, last, "paper")), "g"),
                       fmt(ratio(seconds(res, run0, "netstorm"), seconds(res, last, "netstorm")), "g"))]
    return _report("19b", "Cluster size", "Scaling efficiency t(5 DCs) / t(15 DCs): every DC trains the same batch, "
                   "so samples/s grows as n / t(n). The scale-N scenarios have equal-capacity links, so an "
                   "all-reduce bound 2(n-1)M/ΣC_in caps efficiency below 1 (`netstorm report` prints it).",
                   [Table("Beside the paper", PAPER_HEADER, rows), table], chart, res, [r for _, r in sizes])


def _sensitivity(profile: Profile, nodes: int = 9) -> list[tuple[str, str, list[tuple[str, str, float]]]]:
    """(parameter, unit note, [(value label, run, numeric x)]) with the default point in place."""
    default = default_chunks(nodes)
    chunks = sorted({*profile.chunks_per_model, default})
    params = _parameters(profile.model)
    return [
        ("CHUNK_SIZE", "elements (in parentheses: the same share of AlexNet's 61 M parameters)",
         [(f"{chunk_elements(profile.model, c)} ({61.1 * chunk_elements(profile.model, c) / params:.2g} M)",
           DYNAMIC if c == default else f"chunks-{c}", float(chunk_elements(profile.model, c)))
          for c in reversed(chunks)]),
        ("UPDATE_TIME", "seconds", [(f"{t:g}", DYNAMIC if t == DEFAULT_UPDATE_TIME else f"update-{t:g}", t)
                                    for t in sorted({*profile.update_times, DEFAULT_UPDATE_TIME})]),
        ("PROBE_CHUNK_NUM", "reports per estimate",
         [(str(n), DYNAMIC if n == DEFAULT_PROBE_CHUNK_NUM else f"probe-num-{n}", float(n))
          for n in sorted({*profile.probe_chunk_nums, DEFAULT_PROBE_CHUNK_NUM})]),
        ("PROBE_CHUNK_SIZE", "fraction of a chunk's bytes",
         [(f"{f:g}", DYNAMIC if f == DEFAULT_PROBE_FRACTION else f"probe-size-{f:g}", f)
          for f in sorted({*profile.probe_fractions, DEFAULT_PROBE_FRACTION})]),
    ]


def fig20(res: Results, profile: Profile) -> FigureReport:
    tables: list[Table] = []
    chart = Chart("panels", "Fig. 20: sensitivity (throughput over the default's)", "throughput / default's")
    names: list[str] = []
    best: dict[str, dict[str, str]] = {}
    for param, unit, points in _sensitivity(profile):
        for s in ("paper", "netstorm"):
            timed = [(t, label) for label, run, _ in points if (t := seconds(res, run, s)) is not None]
            best.setdefault(param, {})[s] = (f"fastest here: {min(timed)[1]}" if len(timed) >= 2 else
                                            "-" if s in profile.sweep_systems else "not run in this profile")
        default_run = DYNAMIC
        table = Table(f"{param} ({unit})", ["value", *[h for s in profile.sweep_systems for h in
                                                      (f"`{s}` s", f"`{s}` over the default")]], [])
        panel = Chart("line", param, "throughput / default's", x=[label.split(" ")[0] for label, _, _ in points],
                      xlabel=unit)
        for s in profile.sweep_systems:
            base = seconds(res, default_run, s)
            panel.series[s] = [ratio(base, seconds(res, run, s)) for _, run, _ in points]
        for label, run, _ in points:
            names.append(run)
            table.rows.append([label + (" (default)" if run == default_run else ""), *[
                v for s in profile.sweep_systems
                for v in (fmt(seconds(res, run, s), "s"),
                          fmt(ratio(seconds(res, default_run, s), seconds(res, run, s))))]])
        tables.append(table)
        chart.panels.append(panel)
    params = {"chunk_size_best": "CHUNK_SIZE", "update_time_best": "UPDATE_TIME",
              "probe_chunk_num_range": "PROBE_CHUNK_NUM", "probe_chunk_size_range": "PROBE_CHUNK_SIZE"}
    rows = [_paper_row(n, best[params[n.key]]["paper"], best[params[n.key]]["netstorm"]) for n in for_figure("20")]
    return _report("20", "Sensitivity", "CHUNK_SIZE, UPDATE_TIME, PROBE_CHUNK_NUM and PROBE_CHUNK_SIZE varied one "
                   "at a time from the defaults on dynamic internet2-9.",
                   [Table("Beside the paper", PAPER_HEADER, rows), *tables], chart, res, sorted(set(names)))


def _report(figure: str, title: str, what: str, tables: list[Table], chart: Chart | None, res: Results,
            run_names: list[str]) -> FigureReport:
    names = list(dict.fromkeys(run_names))
    return FigureReport(figure, title, what, tables, chart, names, [n for n in names if n not in res])


FIGURES: dict[str, Callable[[Results, Profile], FigureReport]] = {
    "13": fig13, "14": fig14, "15": fig15, "16": fig16, "17": fig17, "18": fig18, "19a": fig19a, "19b": fig19b,
    "20": fig20,
}
