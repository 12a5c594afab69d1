"""``netstorm bench policy``: one Algorithm 2 + Algorithm 3 run on random overlays, against baselines.

The scheduler re-plans every UPDATE_TIME seconds while training runs, so a plan must be cheap: the
target is 50 ms at 100 nodes of average degree 6. Two references are measured in the same run on the
same graphs: networkx's all-pairs Dijkstra (only Algorithm 1's path lengths, pure Python), and
Algorithm 3 done the plain way (one networkx Dijkstra per path, edges removed in between).

The target applies to the paper's planner (``plan(..., packing=False)``). The default ``fapt`` plan
also solves the LP tree packing (``netstorm.planning.packing``) and runs Algorithm 3 on the packed trees; it is
timed separately in the "packed" columns.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable

from netstorm.planning.plan import plan
from netstorm.scenario import Rates

HELP = "time Algorithm 2 + 3 on random overlays of 50/100/200 nodes against networkx baselines"
TARGET_S = 0.050
TARGET_NODES = 100


def random_overlay(n: int, degree: float, seed: int, low: int = 20, high: int = 155) -> Rates:
    """A connected random overlay: a random spanning tree plus random extra links; each direction gets
    its own uniform integer rate in [low, high] Mbit/s."""
    rng = random.Random(seed)
    order = list(range(n))
    rng.shuffle(order)
    links: set[tuple[int, int]] = set()
    for i in range(1, n):
        a, b = order[i], order[rng.randrange(i)]
        links.add((min(a, b), max(a, b)))
    wanted = min(round(n * degree / 2), n * (n - 1) // 2)
    while len(links) < wanted:
        a, b = rng.sample(range(n), 2)
        links.add((min(a, b), max(a, b)))
    rates: Rates = {}
    for a, b in sorted(links):
        rates[(a, b)] = float(rng.randint(low, high))
        rates[(b, a)] = float(rng.randint(low, high))
    return rates


def _timed(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """Best and median wall time and best CPU time (this process) of ``repeats`` calls.

    The best run is the least disturbed one (timeit's convention); on a shared machine the median
    shows how much other work slowed the rest, and the CPU time what the call itself costs.
    """
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(times), statistics.median(times), min(cpu)


def _networkx_apsp(rates: Rates) -> None:
    import networkx as nx  # only the benchmark needs it; the overlay generator is imported by tests

    graph = nx.DiGraph()
    for (a, b), s in rates.items():
        graph.add_edge(a, b, w=1.0 / s)
    dict(nx.all_pairs_dijkstra_path_length(graph, weight="w"))


def _networkx_alg3(rates: Rates, pairs: list[tuple[int, int]]) -> int:
    """The policy's paths the plain way: per tree edge, the edge itself, then Algorithm 3 in the graph
    without it, one networkx Dijkstra per path. Returns the number of paths."""
    import networkx as nx

    base = nx.DiGraph()
    for (a, b), s in rates.items():
        base.add_edge(a, b, w=1.0 / s)
    count = 0
    for src, dst in pairs:
        graph = base.copy()
        count += 1
        if graph.has_edge(src, dst):
            graph.remove_edge(src, dst)
        while True:
            try:
                path = nx.dijkstra_path(graph, src, dst, weight="w")
            except nx.NetworkXNoPath:
                break
            count += 1
            graph.remove_edges_from(itertools.pairwise(path))
    return count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 200], metavar="N", help="overlay sizes")
    parser.add_argument("--degree", type=float, default=6.0, help="average node degree (default 6)")
    parser.add_argument("--repeats", type=int, default=9, help="runs per measurement (best and median printed)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--plain-max", type=int, default=100, metavar="N",
                        help="run the slow networkx Algorithm 3 reference only up to N nodes (default 100)")


def run(args: argparse.Namespace) -> int:
    print(f"policy planning: Algorithm 2 (all nodes as roots) + Algorithm 3 (every directed tree edge), "
          f"average degree {args.degree:g}, best and median of {args.repeats}, seed {args.seed}")
    print(f"{'nodes':>5} {'links':>6} {'pairs':>6} {'paths':>6} {'plan ms':>8} {'(median)':>9} {'(cpu)':>7} "
          f"{'vs target':>9} {'nx-apsp ms':>10} {'(median)':>9} {'(cpu)':>7} {'plan/apsp':>9} {'nx-alg3 ms':>10} "
          f"{'nx-alg3/plan':>12} {'packed ms':>9} {'(cpu)':>7} {'packed/plan':>11}")
    start = time.perf_counter()
    plan(random_overlay(10, 3, args.seed))  # imports, loads the compiled search and the LP solver
    first = time.perf_counter() - start
    for n in args.sizes:
        rates = random_overlay(n, args.degree, args.seed)
        policy = plan(rates, packing=False)
        pairs = sorted(policy.aux_paths)
        paths = sum(len(p) for p in policy.aux_paths.values())
        plan_best, plan_median, plan_cpu = _timed(
            lambda rates=rates: plan(rates, packing=False), args.repeats)  # type: ignore[misc]
        packed_best, _, packed_cpu = _timed(lambda rates=rates: plan(rates), args.repeats)  # type: ignore[misc]
        apsp_best, apsp_median, apsp_cpu = _timed(
            lambda rates=rates: _networkx_apsp(rates), args.repeats)  # type: ignore[misc]
        plain = "" if n <= args.plain_max else "-"
        if not plain:
            start = time.perf_counter()
            nx_paths = _networkx_alg3(rates, pairs)
            t_alg3 = time.perf_counter() - start
            if nx_paths != paths:
                print(f"warning: networkx found {nx_paths} paths, the planner {paths}")
            plain = f"{t_alg3 * 1e3:>10.1f} {t_alg3 / plan_best:>12.1f}"
        target = f"{plan_best / TARGET_S:8.2f}x" if n == TARGET_NODES else f"{'':9}"
        print(f"{n:>5} {len(rates):>6} {len(pairs):>6} {paths:>6} {plan_best * 1e3:>8.1f} {plan_median * 1e3:>9.1f} "
              f"{plan_cpu * 1e3:>7.1f} {target} {apsp_best * 1e3:>10.1f} {apsp_median * 1e3:>9.1f} "
              f"{apsp_cpu * 1e3:>7.1f} {plan_best / apsp_best:>9.2f} {plain:>23} {packed_best * 1e3:>9.1f} "
              f"{packed_cpu * 1e3:>7.1f} {packed_best / plan_best:>11.2f}")
    print(f"target: plan <= {TARGET_S * 1e3:.0f} ms at {TARGET_NODES} nodes ('vs target' = best plan / target); "
          f"plan/apsp < 1 means the whole plan beats networkx computing Algorithm 1's distances alone; "
          f"'packed' = the default fapt plan (LP tree packing, then Algorithm 3 on the packed trees)")
    print(f"first plan in this process (imports, loading or compiling Algorithm 3's search): {first * 1e3:.0f} ms")
    return 0
