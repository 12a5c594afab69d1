"""WAN scenarios: DCs, overlay links with a rate per direction, latency, loss and rate dynamics.

Scenarios are TOML files in ``klonet-scenarios/`` (format in ``klonet-scenarios/README.md``). Loading
validates everything and names the file, the entry and the problem, so a typo never becomes a
silently different experiment.
"""

from __future__ import annotations

import dataclasses
import json
import random
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from netstorm.errors import ScenarioError
from netstorm.lan_scenario import MAX_WORKERS, LanSpec, count, number, parse_lan
from netstorm.schema import MAX_NODE_ID, MAX_NODES

MAX_MBIT = 1e7
"""The fastest WAN link a scenario may describe (10 Tbit/s): above it is a unit slip, not a link."""
MAX_LATENCY_MS = 60_000.0
"""The longest one-way delay a link may describe (a minute)."""
MAX_PERIOD_S = 86_400.0
"""The longest period between rate changes (a day)."""

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "klonet-scenarios"

Rates = dict[tuple[int, int], float]
"""Directed link rates in Mbit/s, keyed by (from, to)."""
PRIOR_MBIT = 100.0
"""The prior rate of a link a scenario gives no rate for (``[defaults] prior_mbit`` overrides it)."""


@dataclasses.dataclass(frozen=True)
class DataCenter:
    id: int
    name: str
    lan_workers: int = 0
    """LAN workers behind this DC's gateway (aggregated in XDP before the WAN step)."""
    lan: LanSpec | None = None
    """The LAN described worker by worker (rates, compute, precision, racks), if the scenario does;
    its worker count is ``lan_workers``."""
    address: str = ""
    """Where the DC's node is reached on real hosts (a host name or IP; what ``netstorm probe`` measures
    towards), empty when the scenario does not say."""


@dataclasses.dataclass(frozen=True)
class Link:
    """An undirected overlay link; each direction has its own rate."""

    a: int
    b: int
    rate_ab_mbit: float
    rate_ba_mbit: float
    latency_ms: float = 0.0
    loss: float = 0.0
    """Packet loss probability per direction, as a fraction (0.0002 = 0.02 %)."""
    measured: bool = True
    """The scenario states the rates; False: they are the scenario's prior, to be measured."""

    def rate(self, src: int, dst: int) -> float:
        if (src, dst) == (self.a, self.b):
            return self.rate_ab_mbit
        if (src, dst) == (self.b, self.a):
            return self.rate_ba_mbit
        raise KeyError((src, dst))


@dataclasses.dataclass(frozen=True)
class Dynamics:
    """Every ``period_s`` seconds each direction of each link gets a new uniform integer rate."""

    period_s: float
    rate_min_mbit: int
    rate_max_mbit: int
    seed: int


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    nodes: tuple[DataCenter, ...]
    links: tuple[Link, ...]
    dynamics: Dynamics | None = None
    source: str = "<memory>"
    prior_mbit: float = PRIOR_MBIT
    """The rate assumed for a link whose rate the scenario does not state, until it is measured."""

    @property
    def unknown(self) -> frozenset[tuple[int, int]]:
        """Directed links whose rate the scenario does not state (their ``rates()`` are the prior)."""
        return frozenset(pair for lk in self.links if not lk.measured for pair in ((lk.a, lk.b), (lk.b, lk.a)))

    def with_rates(self, rates: Rates) -> Scenario:
        """This scenario with ``rates`` stated for the links they cover (as measured)."""
        links = tuple(dataclasses.replace(lk, rate_ab_mbit=rates[(lk.a, lk.b)], rate_ba_mbit=rates[(lk.b, lk.a)],
                                          measured=True)
                      if (lk.a, lk.b) in rates and (lk.b, lk.a) in rates else lk for lk in self.links)
        return dataclasses.replace(self, links=links)

    @property
    def node_ids(self) -> list[int]:
        return [n.id for n in self.nodes]

    def node(self, node_id: int) -> DataCenter:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def rates(self) -> Rates:
        """The initial directed rates (Mbit/s)."""
        out: Rates = {}
        for link in self.links:
            out[(link.a, link.b)] = link.rate_ab_mbit
            out[(link.b, link.a)] = link.rate_ba_mbit
        return out

    def neighbors(self, node_id: int) -> list[int]:
        out = [lk.b for lk in self.links if lk.a == node_id] + [lk.a for lk in self.links if lk.b == node_id]
        return sorted(out)

    def link(self, u: int, v: int) -> Link:
        for lk in self.links:
            if {lk.a, lk.b} == {u, v}:
                return lk
        raise KeyError((u, v))

    def rates_at_epoch(self, epoch: int) -> Rates:
        """Rates in force during dynamics epoch ``epoch`` (0 = the file's rates).

        Epoch j >= 1 draws from ``random.Random(seed * 1_000_003 + j)``, links in file order, a->b then
        b->a, so any epoch can be computed on its own and every run of the same seed agrees.
        """
        if epoch == 0 or self.dynamics is None:
            return self.rates()
        dyn = self.dynamics
        rng = random.Random(dyn.seed * 1_000_003 + epoch)
        out: Rates = {}
        for link in self.links:
            out[(link.a, link.b)] = float(rng.randint(dyn.rate_min_mbit, dyn.rate_max_mbit))
            out[(link.b, link.a)] = float(rng.randint(dyn.rate_min_mbit, dyn.rate_max_mbit))
        return out

    def rate_schedule(self, duration_s: float) -> Iterator[tuple[float, Rates]]:
        """(start time, rates) for every epoch that begins before ``duration_s``."""
        yield 0.0, self.rates()
        if self.dynamics is None:
            return
        epoch = 1
        while epoch * self.dynamics.period_s < duration_s:
            yield epoch * self.dynamics.period_s, self.rates_at_epoch(epoch)
            epoch += 1


def seeded_rates(edges: list[tuple[int, int]], seed: int, low: int, high: int) -> Rates:
    """The reference draw: ``random.Random(seed)``, edges in order, ``randint`` for a->b then b->a."""
    rng = random.Random(seed)
    out: Rates = {}
    for a, b in edges:
        out[(a, b)] = float(rng.randint(low, high))
        out[(b, a)] = float(rng.randint(low, high))
    return out


class _Ctx:
    """Error context: the file and the entry being read."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> ScenarioError:
        return ScenarioError(f"{self.source}: {where}: {problem}")


def _number(ctx: _Ctx, where: str, value: Any, *, positive: bool = False, minimum: float | None = None,
            maximum: float | None = None) -> float:
    return number(ctx.fail, where, value, positive=positive, minimum=minimum, maximum=maximum)


def _int(ctx: _Ctx, where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ctx.fail(where, f"expected an integer, got {value!r}")
    return value


def _check_keys(ctx: _Ctx, where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            raise ctx.fail(where, f"unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")


def parse(data: Mapping[str, Any], source: str = "<memory>") -> Scenario:
    """Build and validate a Scenario from parsed TOML."""
    ctx = _Ctx(source)
    _check_keys(ctx, "top level", data, {"name", "description", "defaults", "node", "link", "dynamics", "rates"})
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ctx.fail("name", "a non-empty string is required")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ctx.fail("description", "must be a string")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ctx.fail("defaults", "must be a table")
    _check_keys(ctx, "defaults", defaults, {"latency_ms", "loss_pct", "lan_workers", "prior_mbit"})
    prior = _number(ctx, "defaults.prior_mbit", defaults.get("prior_mbit", PRIOR_MBIT), positive=True)

    raw_nodes = data.get("node")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ctx.fail("node", "at least one [[node]] entry is required")
    if len(raw_nodes) > MAX_NODES:
        raise ctx.fail("node", f"{len(raw_nodes)} nodes; a job holds at most {MAX_NODES}")
    nodes: list[DataCenter] = []
    seen_ids: set[int] = set()
    for i, raw in enumerate(raw_nodes):
        where = f"node[{i}]"
        if not isinstance(raw, dict):
            raise ctx.fail(where, "must be a table")
        _check_keys(ctx, where, raw, {"id", "name", "lan_workers", "lan", "address"})
        if "id" not in raw:
            raise ctx.fail(where, "missing 'id'")
        node_id = count(ctx.fail, f"{where}.id", raw["id"], maximum=MAX_NODE_ID)
        if node_id in seen_ids:
            raise ctx.fail(f"{where}.id", f"duplicate node id {node_id}")
        seen_ids.add(node_id)
        node_name = raw.get("name", f"dc{node_id}")
        if not isinstance(node_name, str):
            raise ctx.fail(f"{where}.name", "must be a string")
        workers = count(ctx.fail, f"{where}.lan_workers", raw.get("lan_workers", defaults.get("lan_workers", 0)),
                        maximum=MAX_WORKERS)
        lan = None
        if "lan" in raw:
            lan = parse_lan(ctx.fail, f"{where}.lan", raw["lan"], raw.get("lan_workers"))
            workers = len(lan.workers)
        address = raw.get("address", "")
        if not isinstance(address, str):
            raise ctx.fail(f"{where}.address", "must be a string (a host name or IP address)")
        nodes.append(DataCenter(node_id, node_name, workers, lan, address))

    rate_gen = data.get("rates")
    generated: Rates | None = None
    raw_links = data.get("link")
    if raw_links is None:  # no links: every pair of DCs is one, at rates to be measured
        ids = [n.id for n in nodes]
        raw_links = [{"a": a, "b": b} for i, a in enumerate(ids) for b in ids[i + 1:]]
        if not raw_links:
            raise ctx.fail("node", "a job needs at least two DCs")
    if not isinstance(raw_links, list) or not raw_links:
        raise ctx.fail("link", "give at least one [[link]] entry, or none at all for a full mesh")
    if rate_gen is not None:
        if not isinstance(rate_gen, dict):
            raise ctx.fail("rates", "must be a table")
        _check_keys(ctx, "rates", rate_gen, {"seed", "range_mbit"})
        seed = _int(ctx, "rates.seed", rate_gen.get("seed"))
        low, high = _range(ctx, "rates.range_mbit", rate_gen.get("range_mbit"))
        edges = [(_int(ctx, f"link[{i}].a", lk.get("a")), _int(ctx, f"link[{i}].b", lk.get("b")))
                 for i, lk in enumerate(raw_links) if isinstance(lk, dict)]
        generated = seeded_rates(edges, seed, low, high)

    links: list[Link] = []
    seen_pairs: set[frozenset[int]] = set()
    for i, raw in enumerate(raw_links):
        where = f"link[{i}]"
        if not isinstance(raw, dict):
            raise ctx.fail(where, "must be a table")
        _check_keys(ctx, where, raw, {"a", "b", "rate_mbit", "latency_ms", "loss_pct"})
        for end in ("a", "b"):
            if end not in raw:
                raise ctx.fail(where, f"missing '{end}'")
        a = _int(ctx, f"{where}.a", raw["a"])
        b = _int(ctx, f"{where}.b", raw["b"])
        for end, node_id in (("a", a), ("b", b)):
            if node_id not in seen_ids:
                raise ctx.fail(f"{where}.{end}", f"unknown node {node_id}")
        if a == b:
            raise ctx.fail(where, f"a link from node {a} to itself")
        pair = frozenset((a, b))
        if pair in seen_pairs:
            raise ctx.fail(where, f"duplicate link {a}-{b}")
        seen_pairs.add(pair)
        if "rate_mbit" in raw:
            rate = raw["rate_mbit"]
            if isinstance(rate, list):
                if len(rate) != 2:
                    raise ctx.fail(f"{where}.rate_mbit", "give one rate or [a->b, b->a]")
                r_ab = _number(ctx, f"{where}.rate_mbit[0]", rate[0], positive=True, maximum=MAX_MBIT)
                r_ba = _number(ctx, f"{where}.rate_mbit[1]", rate[1], positive=True, maximum=MAX_MBIT)
            else:
                r_ab = r_ba = _number(ctx, f"{where}.rate_mbit", rate, positive=True, maximum=MAX_MBIT)
        elif generated is not None:
            r_ab, r_ba = generated[(a, b)], generated[(b, a)]
        else:  # no rate stated: the prior until measured (netstorm probe, the scheduler's first probe)
            r_ab = r_ba = prior
        latency = _number(ctx, f"{where}.latency_ms", raw.get("latency_ms", defaults.get("latency_ms", 0.0)),
                          minimum=0.0, maximum=MAX_LATENCY_MS)
        loss_pct = _number(ctx, f"{where}.loss_pct", raw.get("loss_pct", defaults.get("loss_pct", 0.0)),
                           minimum=0.0)
        if loss_pct >= 100.0:
            raise ctx.fail(f"{where}.loss_pct", f"must be below 100, got {loss_pct}")
        links.append(Link(a, b, r_ab, r_ba, latency, loss_pct / 100.0,
                          measured="rate_mbit" in raw or generated is not None))

    dynamics = None
    raw_dyn = data.get("dynamics")
    if raw_dyn is not None:
        if not isinstance(raw_dyn, dict):
            raise ctx.fail("dynamics", "must be a table")
        _check_keys(ctx, "dynamics", raw_dyn, {"period_s", "range_mbit", "seed"})
        period = _number(ctx, "dynamics.period_s", raw_dyn.get("period_s"), positive=True, maximum=MAX_PERIOD_S)
        low, high = _range(ctx, "dynamics.range_mbit", raw_dyn.get("range_mbit"))
        dynamics = Dynamics(period, low, high, _int(ctx, "dynamics.seed", raw_dyn.get("seed", 0)))

    _check_connected(ctx, [n.id for n in nodes], links)
    return Scenario(name, description, tuple(nodes), tuple(links), dynamics, source, prior)


def _range(ctx: _Ctx, where: str, value: Any) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2):
        raise ctx.fail(where, f"expected [low, high] in Mbit/s, got {value!r}")
    low, high = (_int(ctx, where, v) for v in value)
    if low <= 0 or high < low or high > MAX_MBIT:
        raise ctx.fail(where, f"need 0 < low <= high <= {MAX_MBIT:g}, got [{low}, {high}]")
    return low, high


def _check_connected(ctx: _Ctx, node_ids: list[int], links: list[Link]) -> None:
    adjacency: dict[int, set[int]] = {n: set() for n in node_ids}
    for lk in links:
        adjacency[lk.a].add(lk.b)
        adjacency[lk.b].add(lk.a)
    start = node_ids[0]
    seen = {start}
    stack = [start]
    while stack:
        for nxt in adjacency[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    missing = sorted(set(node_ids) - seen)
    if missing:
        raise ctx.fail("link", f"overlay is disconnected: nodes {missing} cannot reach node {start}")


def load(name_or_path: str | Path) -> Scenario:
    """Load a scenario by file path, or by name from ``klonet-scenarios/`` (``internet2-9``)."""
    path = Path(name_or_path)
    if not path.exists():
        candidate = SCENARIO_DIR / f"{name_or_path}.toml"
        if candidate.exists():
            path = candidate
        else:
            known = ", ".join(available())
            raise ScenarioError(f"{name_or_path}: no such scenario file or name (known names: {known})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    return parse(data, str(path))


def available() -> list[str]:
    """Names of the scenarios shipped in ``klonet-scenarios/``."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def to_toml(scenario: Scenario, description: str | None = None) -> str:
    """The scenario as a file ``load`` reads back: its DCs (ids, names, addresses, LAN worker counts) and
    its links with their rates, latencies and losses (a LAN described worker by worker is not written)."""

    def text(value: str) -> str:
        return json.dumps(value)  # a TOML basic string is a JSON string

    lines = [f"name = {text(scenario.name)}",
             f"description = {text(scenario.description if description is None else description)}", ""]
    if scenario.unknown:
        lines += ["[defaults]", f"prior_mbit = {scenario.prior_mbit!r}", ""]
    for node in scenario.nodes:
        lines += ["[[node]]", f"id = {node.id}", f"name = {text(node.name)}"]
        if node.address:
            lines.append(f"address = {text(node.address)}")
        if node.lan_workers:
            lines.append(f"lan_workers = {node.lan_workers}")
        lines.append("")
    for link in scenario.links:
        lines += ["[[link]]", f"a = {link.a}", f"b = {link.b}"]
        if link.measured:
            lines.append(f"rate_mbit = [{link.rate_ab_mbit:.3f}, {link.rate_ba_mbit:.3f}]")
        lines += [f"latency_ms = {link.latency_ms!r}", f"loss_pct = {link.loss * 100:.6g}", ""]
    return "\n".join(lines)
