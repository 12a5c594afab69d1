"""The paper mode: the published NetStorm's rules, each against the paper's own definition.

Algorithm 1 and 2 (trees, roots, quality scores) are rebuilt here literally with networkx: every node's
fastest path to each root, traversed into parent links; shares are q_i / sum q over the roots; the
sender follows Fig. 7 against a reference model of the rule under random sends and completions; the
scheduler re-plans every UPDATE_TIME from each link's newest report, with UPDATE_RATE as Table I's
threshold of a significant change, under a fake clock.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
from collections.abc import Sequence

import networkx as nx
import pytest

from netstorm import control
from netstorm.allot import allot_chunks, split_chunks
from netstorm.cli import main
from netstorm.config import DESIGN_SWITCHES, PAPER_DESIGN, Config
from netstorm.emulation import systems
from netstorm.planning.fapt import theorem1_delay
from netstorm.planning.plan import plan
from netstorm.policy import Policy
from netstorm.probe import LinkReport
from netstorm.scenario import Rates
from netstorm.sendsched import LinkView
from node.forwarding import Forwarding
from scheduler.consistency import Consistency
from scheduler.planner import Planner
from scheduler.replan import Action, Log, Plan, PlanMoves, Publish, PushBeliefs, Replanner
from tests.policy_graphs import internet2, internet2_redrawn, random_overlay

PAPER = Config().replace(**PAPER_DESIGN)
NODES = tuple(range(1, 10))


def _float_overlay(seed: int) -> Rates:
    """A random overlay with real-valued rates, so no two paths tie."""
    rng = random.Random(seed)
    return {pair: rate + rng.random() for pair, rate in random_overlay(12, 3.0, seed).items()}


CASES = {
    "internet2": internet2(0.25),
    "internet2-epoch1": internet2_redrawn(1),
    "internet2-epoch4": internet2_redrawn(4),
    "random-a": _float_overlay(3),
    "random-b": _float_overlay(11),
}


def algorithm2(rates: Rates, num_roots: int = 0, roots: Sequence[int] | None = None
               ) -> tuple[tuple[int, ...], dict[int, dict[int, int | None]], dict[int, float]]:
    """Algorithms 1 and 2 as printed: w_trans = 1/s(e); q_i = 1 / w(T_i), the slowest fastest path into
    i; the top-N nodes form R (unless given); each root's tree traverses every other node's fastest path
    to it into parent links. Returns R, the trees as parent maps and the roots' quality scores."""
    graph = nx.DiGraph()
    for (a, b), s in rates.items():
        graph.add_edge(a, b, w=1.0 / s)
    into = graph.reverse(copy=True)
    nodes = sorted(graph.nodes)
    delay = {i: max(nx.single_source_dijkstra_path_length(into, i, weight="w").values()) for i in nodes}
    quality = {i: 1.0 / delay[i] for i in nodes}
    if roots is None:
        ranked = sorted(nodes, key=lambda i: (-quality[i], i))
        roots = tuple(ranked[:num_roots] if num_roots else ranked)
    trees: dict[int, dict[int, int | None]] = {}
    for root in roots:
        parent: dict[int, int | None] = {root: None}
        for node in nodes:
            if node == root:
                continue
            path = nx.dijkstra_path(graph, node, root, weight="w")
            for child, up in itertools.pairwise(path):
                assert parent.setdefault(child, up) == up, "fastest paths disagree: a tie in the reference"
        trees[root] = parent
    return tuple(roots), trees, {r: quality[r] for r in roots}


def _parents(policy: Policy) -> dict[int, dict[int, int | None]]:
    return {root: dict(tree.parent) for root, tree in policy.trees.items()}


def test_the_paper_systems_run_the_paper_design() -> None:
    """The emulator's paper systems resolve to PAPER_DESIGN for every switch, with Table I's two as the
    paper's Lite / Std / Pro stages, and our own systems to the options' defaults."""
    for name, awareness, aux in (("paper", True, True), ("paper-std", True, False), ("paper-lite", False, False)):
        system = systems.SYSTEMS[name]
        effect = systems.in_effect(system, [], environ={})
        assert {k: effect[k] for k in DESIGN_SWITCHES} == PAPER_DESIGN
        assert (effect["enable_awareness"], effect["enable_aux_path"]) == (awareness, aux)
        assert system.switches == {"enable_awareness": awareness, "enable_aux_path": aux, **PAPER_DESIGN}
    ours = systems.in_effect(systems.SYSTEMS["netstorm"], [], environ={})
    assert {k: ours[k] for k in DESIGN_SWITCHES} == {k: getattr(Config(), k) for k in DESIGN_SWITCHES}
    assert all(ours[k] != PAPER_DESIGN[k] for k in DESIGN_SWITCHES), "every switch separates the designs"
    # a flag given to the run changes the paper system too, and the record says so
    grid = systems.in_effect(systems.SYSTEMS["paper"], ["--auxiliary-queue-length", "5"], environ={})
    assert grid["auxiliary_queue_length"] == 5 and grid["tree_packing"] is False


@pytest.mark.parametrize("case", sorted(CASES))
def test_paper_trees_roots_and_quality_are_algorithm_2s(case: str) -> None:
    rates = CASES[case]
    nodes = sorted({n for pair in rates for n in pair})
    planner = Planner.from_config(PAPER)
    policy = planner.first(rates, nodes)
    roots, trees, quality = algorithm2(rates)
    assert policy.roots == roots
    assert _parents(policy) == trees
    assert {r: policy.quality[r] for r in roots} == pytest.approx(quality, rel=1e-12)
    assert not policy.offload and not policy.explore
    # Algorithm 1 fixes R on the first run: a re-plan keeps it and rebuilds each root's tree
    later = {pair: rate * (0.5 + random.Random(hash(pair)).random()) for pair, rate in rates.items()}
    replanned = planner.replan(later, nodes, policy)
    assert replanned is not None
    _, later_trees, _ = algorithm2(later, roots=roots)
    assert replanned.roots == roots and _parents(replanned) == later_trees


@pytest.mark.parametrize("roots", [0, 3])
def test_netstorm_plan_with_tree_packing_off_prints_algorithm_2s_trees(tmp_path, capsys, roots: int) -> None:
    for name, rates in (("internet2", CASES["internet2"]), ("epoch4", CASES["internet2-epoch4"])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({f"{a}->{b}": r for (a, b), r in rates.items()}))
        assert main(["plan", "--rates", str(path), "--model", "1M", "--tree-packing", "false",
                     "--roots", str(roots), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        want_roots, trees, quality = algorithm2(rates, num_roots=roots)
        assert out["roots"] == list(want_roots)
        assert out["trees"] == {str(r): {str(n): p for n, p in sorted(t.items())} for r, t in trees.items()}
        total = sum(quality.values())
        assert out["chunk_share"] == pytest.approx({str(r): q / total for r, q in quality.items()}, rel=1e-12)
    # the scenario by name, as a user types it, at the emulator's scale
    assert main(["plan", "internet2-9", "--bw-scale", "0.25", "--tree-packing", "false", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    _, trees, _ = algorithm2(CASES["internet2"])
    assert out["trees"] == {str(r): {str(n): p for n, p in sorted(t.items())} for r, t in trees.items()}
    assert out["offload"] == {} and out["tree_packing"] is False


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_roots", [0, 1, 4])
def test_paper_shares_are_quality_over_the_roots_sum(case: str, num_roots: int) -> None:
    """q_i = 1 / w(T_i) with w Theorem 1's delay of the root's own tree; shares q_i / sum over R of q."""
    rates = CASES[case]
    nodes = sorted({n for pair in rates for n in pair})
    planner = Planner.from_config(PAPER.replace(num_root_servers=num_roots))
    policy = planner.first(rates, nodes)
    q = {r: 1.0 / theorem1_delay(policy.trees[r], rates) for r in policy.roots}
    assert policy.chunk_share == pytest.approx({r: q[r] / sum(q.values()) for r in policy.roots}, rel=1e-12)
    # ... and the chunks follow them to within one chunk per root
    sizes = split_chunks([1_000_000, 250_001, 3], 6945)
    owners = allot_chunks(sizes, policy.chunk_share)
    total = sum(sizes)
    for root in policy.roots:
        held = sum(s for s, o in zip(sizes, owners, strict=True) if o == root)
        assert abs(held - policy.chunk_share[root] * total) <= 6945
    # on a re-plan the fixed roots' shares follow the new rates' quality
    later = {pair: rate * (1.5 if pair[0] % 2 else 0.6) for pair, rate in rates.items()}
    replanned = planner.replan(later, nodes, policy)
    assert replanned is not None
    q = {r: 1.0 / theorem1_delay(replanned.trees[r], later) for r in policy.roots}
    assert replanned.chunk_share == pytest.approx({r: q[r] / sum(q.values()) for r in policy.roots}, rel=1e-12)


# ---- Fig. 7: the sender's communication scheduler ---------------------------------------------------------


def fig7(in_flight: dict[tuple[int, ...], int], primary: tuple[int, ...], aux: Sequence[tuple[int, ...]],
         busy_bound: int, queue_length: int) -> tuple[int, ...]:
    """Fig. 7 as Section VI-A words it: the primary path unless its occupied queue exceeds
    PRIMARY_BUSY_BOUND; then the auxiliary paths in order of priority (transfer delay), the first with
    fewer than AUXILIARY_QUEUE_LENGTH chunks; if all are busy, the primary."""
    if in_flight[primary] <= busy_bound:
        return primary
    for path in aux:
        if in_flight[path] < queue_length:
            return path
    return primary


def _edge_with_aux(policy: Policy, least: int) -> tuple[int, int]:
    for (src, dst), paths in sorted(policy.aux_paths.items()):
        if len(paths) > least and (src, dst) in policy.tree_links():
            return src, dst
    raise AssertionError(f"no tree edge with {least} auxiliary paths")


def _path_s(path: Sequence[int], rates: Rates) -> float:
    return sum(1.0 / rates[hop] for hop in itertools.pairwise(path))


def test_paper_auxiliary_paths_are_ranked_by_transfer_delay() -> None:
    rates = CASES["internet2"]
    policy = plan(rates, packing=False)
    for (src, dst), paths in policy.aux_paths.items():
        assert paths[0] == (src, dst), "the primary is the tree edge"
        delays = [_path_s(p, rates) for p in paths[1:]]
        assert delays == sorted(delays)
        used = [hop for p in paths[1:] for hop in itertools.pairwise(p)]
        assert len(used) == len(set(used)) and (src, dst) not in used, "Algorithm 3: no shared link"


def test_paper_sender_hand_worked_sequence() -> None:
    """PRIMARY_BUSY_BOUND 2, AUXILIARY_QUEUE_LENGTH 1: three chunks on the primary, then one on each
    auxiliary path, fastest first, then the primary again; a completion frees its own path."""
    policy = plan(CASES["internet2"], packing=False)
    src, dst = _edge_with_aux(policy, 2)
    forwarding = Forwarding(src, PAPER)
    primary, aux = (src, dst), policy.aux_paths[(src, dst)][1:]
    chosen = [forwarding.choose(policy, dst)[0] for _ in range(3 + len(aux) + 2)]
    assert chosen == [primary] * 3 + list(aux) + [primary] * 2
    _, scheduler = forwarding.choose(policy, dst)
    scheduler.done(aux[0])
    assert forwarding.choose(policy, dst)[0] == aux[0]
    for _ in range(scheduler.in_flight[primary] - 2):
        scheduler.done(primary)
    assert scheduler.in_flight[primary] == 2
    assert forwarding.choose(policy, dst)[0] == primary, "at the bound, not past it: the primary"
    assert forwarding.aux_chunks == len(aux) + 1


def test_paper_sender_offloads_whatever_the_primary_delivers_and_ours_does_not() -> None:
    """aux_slowdown 0 is Fig. 7: a busy primary offloads even while it keeps its planned rate, which our
    rule leaves alone (the trees already use that capacity)."""
    policy = plan(CASES["internet2"], packing=False)
    src, dst = _edge_with_aux(policy, 1)
    planned_bps = policy.rates[(src, dst)] * 1e6 / 8

    def view(_: int) -> LinkView:
        return LinkView(backlog_bytes=10**6, rate_bps=planned_bps)

    for config, offloads in ((PAPER, True), (Config(), False)):
        forwarding = Forwarding(src, config)
        paths = [forwarding.choose(policy, dst, view, size=27780)[0] for _ in range(4)]
        assert (paths[3] != (src, dst)) is offloads


@pytest.mark.parametrize("busy_bound,queue_length", [(1, 1), (2, 1), (2, 5), (4, 3), (8, 8)])
def test_paper_sender_follows_fig7_under_random_sends_and_completions(busy_bound: int, queue_length: int) -> None:
    """Fig. 17's grid: every choice equals the rule's, in any order of sends and completions."""
    config = PAPER.replace(primary_busy_bound=busy_bound, auxiliary_queue_length=queue_length)
    policy = plan(CASES["internet2-epoch4"], packing=False)
    src, dst = _edge_with_aux(policy, 2)
    primary, aux = (src, dst), policy.aux_paths[(src, dst)][1:]
    forwarding = Forwarding(src, config)
    rng = random.Random(busy_bound * 100 + queue_length)
    model: dict[tuple[int, ...], int] = collections.Counter({primary: 0, **{p: 0 for p in aux}})
    scheduler = None
    seen: set[tuple[int, ...]] = set()
    for _ in range(2000):
        busy = [p for p, n in model.items() if n]
        if busy and rng.random() < 0.45:
            path = rng.choice(busy)
            assert scheduler is not None
            scheduler.done(path)
            model[path] -= 1
            continue
        want = fig7(model, primary, aux, busy_bound, queue_length)
        path, scheduler = forwarding.choose(policy, dst)
        assert path == want
        model[path] += 1
        assert dict(scheduler.in_flight) == dict(model)
        seen.add(path)
    assert seen == {primary, *aux}, "the walk reached every path"


# ---- the re-plan core: UPDATE_TIME and UPDATE_RATE --------------------------------------------------------


class Job:
    """The scheduler's re-plan core with the planner a config makes, its actions carried out in line."""

    def __init__(self, config: Config, rates: Rates) -> None:
        self.consistency = Consistency()
        self.planner = Planner.from_config(config)
        self.core = Replanner(config, rates, NODES, planner=self.planner, consistency=self.consistency, now=0.0)
        self.plans: list[Plan] = []
        self.published: list[Policy] = []
        self.pushed: list[control.LinkBeliefs] = []
        self.moves = 0
        self.run([self.core.first_plan(NODES)])

    def run(self, actions: Sequence[Action]) -> None:
        queue = collections.deque(actions)
        while queue:
            action = queue.popleft()
            if isinstance(action, Plan):
                self.plans.append(action)
                policy = self.planner.first(action.rates, action.nodes) if action.current is None else \
                    self.planner.replan(action.rates, action.nodes, action.current, force=action.force)
                queue.extend(self.core.planned(action, policy, alive=NODES))
            elif isinstance(action, Publish):
                self.consistency.publish(action.policy)
                self.published.append(action.policy)
            elif isinstance(action, PlanMoves):
                self.moves += 1
            elif isinstance(action, PushBeliefs):
                self.pushed.append(action.beliefs)
            else:
                assert isinstance(action, Log)

    def report(self, link: tuple[int, int], mbit_s: float, now: float) -> None:
        self.run(self.core.link_report(LinkReport(src=link[0], dst=link[1], mbit_s=mbit_s, t=now, samples=4),
                                       now))

    def tick(self, now: float) -> None:
        self.run(self.core.timer(now, alive=NODES, complete=True))


def _busiest_tree_link(policy: Policy) -> tuple[int, int]:
    loads: dict[tuple[int, int], float] = {link: 0.0 for link in policy.tree_links()}
    for root, tree in policy.trees.items():
        for child, parent in tree.edges():
            loads[(child, parent)] += policy.chunk_share[root]
    return max(loads, key=lambda link: (loads[link] / policy.rates[link], link))


def test_paper_replans_every_update_time_from_the_newest_reports() -> None:
    rates = CASES["internet2"]
    job = Job(PAPER, rates)
    first = job.published[0]
    link = _busiest_tree_link(first)
    # A collapse of the busiest tree link, reported again and again: no early re-plan (no change points).
    for k, now in enumerate((0.5, 1.0, 1.5, 2.0, 2.5)):
        job.report(link, rates[link] * (0.2 + 0.01 * k), now)
    assert job.core.next_deadline() == pytest.approx(PAPER.update_time)
    job.tick(PAPER.update_time - 0.01)
    assert len(job.plans) == 1 and len(job.published) == 1
    job.tick(PAPER.update_time)
    assert len(job.plans) == 2
    plan_rates = job.plans[1].rates
    assert plan_rates[link] == pytest.approx(rates[link] * 0.24), "the newest report alone, not a median"
    assert {k: v for k, v in plan_rates.items() if k != link} == {k: v for k, v in rates.items() if k != link}
    second = job.published[-1]
    assert second.version == 1 and second.rates[link] == pytest.approx(rates[link] * 0.24)
    assert _parents(second) == algorithm2(plan_rates, roots=first.roots)[1]
    assert not second.offload and not second.explore
    assert job.pushed == [] and job.moves == 0, "no beliefs nor moves for the iteration running"
    # The next period: a one per cent wobble is a change above UPDATE_RATE 0, so the scheduler plans again.
    job.report(link, rates[link] * 0.24 * 1.01, PAPER.update_time + 1.0)
    job.tick(2 * PAPER.update_time - 0.01)
    assert len(job.plans) == 2
    job.tick(2 * PAPER.update_time)
    assert len(job.plans) == 3 and job.published[-1].version == 2
    # No decay toward optimism: a link unmeasured for ten minutes keeps its last value.
    job.tick(600.0)
    assert job.plans[-1].rates[link] == pytest.approx(rates[link] * 0.24 * 1.01)


@pytest.mark.parametrize("update_rate", [0.1, 0.3])
def test_update_rate_is_tables_significant_change_threshold(update_rate: float) -> None:
    """Table I: UPDATE_RATE is the threshold that tells a significant change; every UPDATE_TIME the
    policy is formulated again only past it (the largest relative change of any link)."""
    rates = CASES["internet2"]
    job = Job(PAPER.replace(update_rate=update_rate), rates)
    link = _busiest_tree_link(job.published[0])
    job.report(link, rates[link] * 0.8, 1.0)  # a 20 % change
    job.tick(PAPER.update_time)
    assert len(job.plans) == 2, "a plan every UPDATE_TIME"
    assert len(job.published) == (2 if update_rate < 0.2 else 1)


def test_our_rules_stay_on_by_default() -> None:
    """The same collapse under the default options: a re-plan at once (change points off for one link,
    but the early re-plan of a shifted busiest link is ours), and moves for the running iteration."""
    rates = CASES["internet2"]
    job = Job(Config(), rates)
    job.consistency.request(0, -1)
    link = _busiest_tree_link(job.published[0])
    for now in (0.5, 1.0, 1.5):
        job.report(link, rates[link] * 0.2, now)
    assert job.core.next_deadline() < Config().update_time
    job.tick(job.core.next_deadline())
    assert len(job.published) == 2 and job.moves == 1, "our scheduler re-plans early, with moves for iteration 0"


def test_paper_mode_skips_explore_and_moves_ours_asks_for_both() -> None:
    """After a network change our policies ask for unmeasured idle links to be explored and plan moves
    for the bound iteration's trees; the paper's do neither."""
    rates = CASES["internet2"]
    for config, ours in ((PAPER, False), (Config(), True)):
        job = Job(config.replace(num_root_servers=1), rates)  # one tree leaves links idle
        job.consistency.request(0, -1)
        job.core.collector.note_change(0.1, change_gap=config.update_time)
        slow = {link: r * (0.5 if link[0] < link[1] else 1.0) for link, r in rates.items()}
        job.run([job.core.plan(slow, NODES, force=True, reason="override")])
        latest = job.published[-1]
        assert bool(latest.explore) is ours
        assert (job.moves > 0) is ours

