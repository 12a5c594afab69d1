"""A DC's LAN as a scenario describes it: workers with their rates, compute and precision, and racks.

The tier inside a DC is planned (which workers aggregate whom, at which rates) and emulated (each
worker's bridge port shaped to its rates) from this description, so it lives in the library beside the
WAN scenario. A scenario either lists workers one by one or draws them from a seeded spread, so the
heterogeneity a planner is measured against can be varied from one number.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

PRECISIONS = ("fp32", "fp16", "bf16", "int8")
"""Lane precisions a LAN worker may send (int8 travels with a scale)."""

DEFAULT_RATE_GBIT = 10.0
"""A worker's rate per direction when the scenario gives none."""
MAX_GBIT = 1e4
"""The fastest port, uplink or aggregator a LAN may describe (10 Tbit/s): anything above is a typo (a
rate in bit/s written as Gbit/s), and the planners' sums must stay far from float overflow."""
MAX_COMPUTE_S = 3600.0
"""The longest computation per iteration a worker may describe."""
MAX_WORKERS = 64
"""Workers one described LAN holds (the emulation's and the data plane's bound)."""


@dataclasses.dataclass(frozen=True)
class LanWorker:
    """One LAN worker; ``index`` is its position in the DC (worker ``i`` of the emulation)."""

    index: int
    up_gbit: float
    """Worker to LAN rate (its bridge port's ingress direction)."""
    down_gbit: float
    """LAN to worker rate."""
    compute_s: float = 0.0
    """Seconds of computation per iteration before its gradient is ready: the emulator's worker spends
    them before it pushes. No planner uses it (ALEPH's C_w is ``agg_gbit``; PAHInA and EINA model no
    compute)."""
    precision: str = "fp32"
    rack: int | None = None
    """The rack whose aggregator it sits under, if the DC describes racks."""
    agg_gbit: float | None = None
    """What it can sum per second when it aggregates others (its XDP program's capacity: ALEPH's C_w);
    None: bounded by its ports alone."""


@dataclasses.dataclass(frozen=True)
class Rack:
    """A rack with a ToR-level aggregator (EINA's edge aggregator, PAHInA's programmable node)."""

    id: int
    aggregator_gbit: float
    """What the rack's aggregator can sum per second (its processing capacity)."""
    uplink_gbit: float
    """Rack to gateway rate."""
    precision_gbit: tuple[tuple[str, float], ...] = ()
    """Per-precision capacities of the aggregator (PAHInA's C_{s,p}); a precision not listed gets
    ``aggregator_gbit``, one listed with 0 is not supported by this aggregator."""

    def capacity(self, precision: str) -> float:
        """What the aggregator sums per second of ``precision`` inputs (0: it cannot)."""
        return dict(self.precision_gbit).get(precision, self.aggregator_gbit)


@dataclasses.dataclass(frozen=True)
class LanSpec:
    workers: tuple[LanWorker, ...]
    racks: tuple[Rack, ...] = ()
    gateway_gbit: float = DEFAULT_RATE_GBIT * 4
    """The gateway's own port rate per direction."""

    def rack(self, rack_id: int) -> Rack:
        for r in self.racks:
            if r.id == rack_id:
                return r
        raise KeyError(rack_id)


Fail = Callable[[str, str], Exception]
"""(where, problem) -> the error to raise; the scenario loader's, so messages name the file."""


def number(fail: Fail, where: str, value: Any, *, positive: bool = False, minimum: float | None = None,
           maximum: float | None = None) -> float:
    """``value`` as a finite float within the bounds, else ``fail`` naming the key and the problem (TOML
    reads ``nan`` and ``inf`` as floats, so finiteness is checked, not assumed)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail(where, f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise fail(where, f"must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise fail(where, f"must be positive, got {value!r}")
    if minimum is not None and value < minimum:
        raise fail(where, f"must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise fail(where, f"must be at most {maximum:g}, got {value!r}")
    return float(value)


def count(fail: Fail, where: str, value: Any, *, minimum: int = 0, maximum: int) -> int:
    """``value`` as a whole count in [minimum, maximum], else ``fail`` naming the key and the problem."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(where, f"expected a whole number, got {value!r}")
    if not minimum <= value <= maximum:
        raise fail(where, f"expected an integer in {minimum}..{maximum}, got {value!r}")
    return value


def _num(fail: Fail, where: str, value: Any, *, positive: bool = False, minimum: float | None = None) -> float:
    """A rate or capacity in Gbit/s (at most ``MAX_GBIT``)."""
    return number(fail, where, value, positive=positive, minimum=minimum, maximum=MAX_GBIT)


def _keys(fail: Fail, where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            raise fail(where, f"unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")


def _precision(fail: Fail, where: str, value: Any) -> str:
    if value not in PRECISIONS:
        raise fail(where, f"expected one of {', '.join(PRECISIONS)}, got {value!r}")
    return str(value)


_WORKER_KEYS = {"up_gbit", "down_gbit", "compute_s", "precision", "rack", "agg_gbit"}
_DRAW_KEYS = {"workers", "mean_gbit", "spread", "seed", "precisions", "compute_s", "min_gbit", "agg_gbit"}


def parse_lan(fail: Fail, where: str, raw: Any, lan_workers: int | None) -> LanSpec:
    """A ``[node.lan]`` table -> LanSpec; ``lan_workers`` is the node's count, if it gave one."""
    if not isinstance(raw, dict):
        raise fail(where, "must be a table")
    if lan_workers is not None:
        count(fail, f"{where} (lan_workers)", lan_workers, maximum=MAX_WORKERS)
    _keys(fail, where, raw, {"worker", "draw", "rack", "gateway_gbit", *_WORKER_KEYS - {"rack"}})
    defaults = {k: raw[k] for k in _WORKER_KEYS - {"rack"} if k in raw}
    racks = _racks(fail, where, raw.get("rack", []))
    if "worker" in raw and "draw" in raw:
        raise fail(where, "give either [[...lan.worker]] entries or a [...lan.draw] table, not both")
    if "worker" in raw:
        entries = raw["worker"]
        if not isinstance(entries, list) or not entries:
            raise fail(f"{where}.worker", "must be a non-empty array of tables")
        workers = tuple(_worker(fail, f"{where}.worker[{i}]", i, e, defaults, racks) for i, e in enumerate(entries))
    elif "draw" in raw:
        workers = _draw(fail, f"{where}.draw", raw["draw"], defaults, racks)
    else:
        if not lan_workers:
            raise fail(where, "give [[...lan.worker]] entries, a [...lan.draw] table, or the node's lan_workers")
        workers = tuple(_worker(fail, where, i, {}, defaults, racks) for i in range(lan_workers))
    if len(workers) > MAX_WORKERS:
        raise fail(f"{where}.worker", f"describes {len(workers)} workers; a LAN holds at most {MAX_WORKERS}")
    if lan_workers and lan_workers != len(workers):
        raise fail(where, f"describes {len(workers)} workers but the node's lan_workers is {lan_workers}")
    gateway = _num(fail, f"{where}.gateway_gbit", raw.get("gateway_gbit", DEFAULT_RATE_GBIT * 4), positive=True)
    return LanSpec(workers, racks, gateway)


def _racks(fail: Fail, where: str, raw: Any) -> tuple[Rack, ...]:
    if not isinstance(raw, list):
        raise fail(f"{where}.rack", "must be an array of tables")
    out: list[Rack] = []
    for i, r in enumerate(raw):
        w = f"{where}.rack[{i}]"
        if not isinstance(r, dict):
            raise fail(w, "must be a table")
        _keys(fail, w, r, {"id", "aggregator_gbit", "uplink_gbit", "precision_gbit"})
        rid = count(fail, f"{w}.id", r.get("id"), maximum=2**31 - 1)
        if any(x.id == rid for x in out):
            raise fail(f"{w}.id", f"duplicate rack id {rid}")
        per = r.get("precision_gbit", {})
        if not isinstance(per, dict):
            raise fail(f"{w}.precision_gbit", "must be a table {precision = Gbit/s}")
        caps = tuple((_precision(fail, f"{w}.precision_gbit", k), _num(fail, f"{w}.precision_gbit.{k}", v, minimum=0.0))
                     for k, v in sorted(per.items()))
        out.append(Rack(rid, _num(fail, f"{w}.aggregator_gbit", r.get("aggregator_gbit"), positive=True),
                        _num(fail, f"{w}.uplink_gbit", r.get("uplink_gbit", DEFAULT_RATE_GBIT * 4), positive=True),
                        caps))
    return tuple(out)


def _worker(fail: Fail, where: str, index: int, raw: Any, defaults: Mapping[str, Any],
            racks: tuple[Rack, ...]) -> LanWorker:
    if not isinstance(raw, dict):
        raise fail(where, "must be a table")
    _keys(fail, where, raw, _WORKER_KEYS)
    merged = {**defaults, **raw}
    up = _num(fail, f"{where}.up_gbit", merged.get("up_gbit", DEFAULT_RATE_GBIT), positive=True)
    down = _num(fail, f"{where}.down_gbit", merged.get("down_gbit", up), positive=True)
    compute = number(fail, f"{where}.compute_s", merged.get("compute_s", 0.0), minimum=0.0, maximum=MAX_COMPUTE_S)
    precision = _precision(fail, f"{where}.precision", merged.get("precision", "fp32"))
    rack = merged.get("rack")
    if rack is not None and (isinstance(rack, bool) or not isinstance(rack, int) or all(r.id != rack for r in racks)):
        raise fail(f"{where}.rack", f"unknown rack {rack!r} (racks: {[r.id for r in racks]})")
    agg = merged.get("agg_gbit")
    agg_gbit = None if agg is None else _num(fail, f"{where}.agg_gbit", agg, positive=True)
    return LanWorker(index, up, down, compute, precision, rack, agg_gbit)


def _draw(fail: Fail, where: str, raw: Any, defaults: Mapping[str, Any],
          racks: tuple[Rack, ...]) -> tuple[LanWorker, ...]:
    """Workers whose rates are normal around ``mean_gbit`` with std ``spread`` x mean (clamped below at
    ``min_gbit``), drawn from ``random.Random(seed)``; precisions cycle through ``precisions``; with
    racks, workers are dealt to them in turn."""
    if not isinstance(raw, dict):
        raise fail(where, "must be a table")
    _keys(fail, where, raw, _DRAW_KEYS)
    workers = count(fail, f"{where}.workers", raw.get("workers"), minimum=1, maximum=MAX_WORKERS)
    mean = _num(fail, f"{where}.mean_gbit", raw.get("mean_gbit", DEFAULT_RATE_GBIT), positive=True)
    spread = number(fail, f"{where}.spread", raw.get("spread", 0.0), minimum=0.0, maximum=10.0)
    floor = _num(fail, f"{where}.min_gbit", raw.get("min_gbit", mean * 0.05), positive=True)
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise fail(f"{where}.seed", f"expected an integer, got {seed!r}")
    precisions = raw.get("precisions", [defaults.get("precision", "fp32")])
    if not isinstance(precisions, list) or not precisions:
        raise fail(f"{where}.precisions", "must be a non-empty array")
    for p in precisions:
        _precision(fail, f"{where}.precisions", p)
    compute = number(fail, f"{where}.compute_s", raw.get("compute_s", defaults.get("compute_s", 0.0)), minimum=0.0,
                     maximum=MAX_COMPUTE_S)
    agg = raw.get("agg_gbit", defaults.get("agg_gbit"))
    agg_gbit = None if agg is None else _num(fail, f"{where}.agg_gbit", agg, positive=True)
    rng = random.Random(seed)
    out = []
    for i in range(workers):
        rate = round(max(floor, rng.gauss(mean, spread * mean)), 3)
        out.append(LanWorker(i, rate, rate, compute, str(precisions[i % len(precisions)]),
                             racks[i % len(racks)].id if racks else None, agg_gbit))
    return tuple(out)


def uniform_lan(workers: int, like: LanSpec | None = None) -> LanSpec:
    """A LAN of ``workers`` alike workers, for a DC that is given a worker count its scenario does not describe
    (``--lan-workers N`` on a run that plans the tier).

    Without ``like`` every worker gets the format's defaults: ``DEFAULT_RATE_GBIT`` each way, no compute,
    fp32, no racks, the default gateway port. With ``like`` (the DC's description of another count) the
    workers take its means (uplink, downlink, compute, aggregation capacity), its precisions in turn and
    its racks in turn, and the gateway keeps its port: the same LAN, resized."""
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"a described LAN holds 1..{MAX_WORKERS} workers, got {workers}")
    if like is None:
        return LanSpec(tuple(LanWorker(i, DEFAULT_RATE_GBIT, DEFAULT_RATE_GBIT) for i in range(workers)))
    given = like.workers
    n = len(given)
    aggs = [w.agg_gbit for w in given if w.agg_gbit is not None]
    up = round(sum(w.up_gbit for w in given) / n, 6)
    down = round(sum(w.down_gbit for w in given) / n, 6)
    compute = round(sum(w.compute_s for w in given) / n, 6)
    agg = round(sum(aggs) / len(aggs), 6) if aggs else None
    precisions = list(dict.fromkeys(w.precision for w in given))
    out = tuple(LanWorker(i, up, down, compute, precisions[i % len(precisions)],
                          like.racks[i % len(like.racks)].id if like.racks else None, agg) for i in range(workers))
    return LanSpec(out, like.racks, like.gateway_gbit)


def lan_toml(lan: LanSpec) -> str:
    """``lan`` as the scenario format's ``[node.lan]`` table, written at the top level (``load_lan_file``
    reads it back): its gateway, racks and every worker listed one by one."""
    lines = [f"gateway_gbit = {lan.gateway_gbit!r}"]
    for r in lan.racks:
        lines += ["", "[[rack]]", f"id = {r.id}", f"aggregator_gbit = {r.aggregator_gbit!r}",
                  f"uplink_gbit = {r.uplink_gbit!r}"]
        if r.precision_gbit:
            lines.append("precision_gbit = { " + ", ".join(f"{p} = {v!r}" for p, v in r.precision_gbit) + " }")
    for w in lan.workers:
        lines += ["", "[[worker]]", f"up_gbit = {w.up_gbit!r}", f"down_gbit = {w.down_gbit!r}",
                  f"compute_s = {w.compute_s!r}", f'precision = "{w.precision}"']
        if w.rack is not None:
            lines.append(f"rack = {w.rack}")
        if w.agg_gbit is not None:
            lines.append(f"agg_gbit = {w.agg_gbit!r}")
    return "\n".join(lines) + "\n"


def load_lan_file(path: str) -> LanSpec:
    """A LAN description file (``lan_toml``'s format: a scenario's ``[node.lan]`` table at the top level);
    errors name the file, the key and the problem."""
    import tomllib

    from netstorm.errors import ScenarioError

    def fail(where: str, problem: str) -> Exception:
        return ScenarioError(f"{path}: {where}: {problem}")

    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read the LAN description: {exc}") from None
    return parse_lan(fail, "lan", raw, None)
