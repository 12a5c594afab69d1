"""``netstorm bench packing``: LP tree packing against the paper's Algorithm 2 on random overlays.

Two things are measured on the same graphs in the same run: what the packing costs (planning time,
with Algorithm 2 alone as the baseline, since the packing starts from its trees and quality scores) and
what it buys (the busiest link's time against the physical limit M/λ, for both). The scheduler re-plans
every UPDATE_TIME seconds, so the packing must stay well under a second at 100 nodes.
"""

from __future__ import annotations

import argparse
import statistics
import time

from netstorm.planning.limit import min_cut
from netstorm.planning.packing import PackingGraph, pack_trees
from netstorm.planning.plan import plan
from netstorm.planning.predict import predict
from netstorm.planning.rategraph import RateGraph
from netstorm.scenario import Rates

HELP = "time the LP tree packing on random overlays of 50/100/200 nodes against Algorithm 2; bulk vs M/λ"
TARGET_S = 1.0
TARGET_NODES = 100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 200], metavar="N", help="overlay sizes")
    parser.add_argument("--degree", type=float, default=6.0, help="average node degree (default 6)")
    parser.add_argument("--roots", type=int, default=0, metavar="N", help="FAPT roots, 0 = every node (default)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is printed")
    parser.add_argument("--seed", type=int, default=1)


def _median_s(rates: Rates, roots: int, packing: bool, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan(rates, num_roots=roots, aux=False, packing=packing)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    from netstorm.bench.policy import random_overlay

    print(f"tree packing vs Algorithm 2 (trees + shares, no auxiliary paths), {args.roots or 'all'} roots, "
          f"average degree {args.degree:g}, median of {args.repeats}, seed {args.seed}")
    print(f"{'nodes':>5} {'links':>6} {'rounds':>6} {'trees':>5} {'alg2 ms':>8} {'packed ms':>9} "
          f"{'packed/alg2':>11} {'vs target':>9} {'alg2 bulk/limit':>15} {'packed bulk/limit':>17} "
          f"{'LP opt/limit':>12}")
    plan(random_overlay(10, 3, args.seed))  # warm imports outside the timings
    for n in args.sizes:
        rates = random_overlay(n, args.degree, args.seed)
        graph = RateGraph.from_rates(rates)
        optimum = pack_trees(PackingGraph.from_graph(graph))
        mbit_s = 1.0 / min_cut(rates).mbit  # the limit for one Mbit of model
        t_paper = _median_s(rates, args.roots, False, args.repeats)
        t_packed = _median_s(rates, args.roots, True, args.repeats)
        bulk = {p: predict(plan(rates, num_roots=args.roots, aux=False, packing=p), rates, 1e6 / 8).bulk_s
                for p in (False, True)}
        target = f"{t_packed / TARGET_S:8.2f}x" if n == TARGET_NODES else f"{'':9}"
        print(f"{n:>5} {len(rates):>6} {optimum.rounds:>6} {len(optimum.trees):>5} {t_paper * 1e3:>8.1f} "
              f"{t_packed * 1e3:>9.1f} {t_packed / t_paper:>11.1f} {target} {bulk[False] / mbit_s:>15.3f} "
              f"{bulk[True] / mbit_s:>17.3f} {optimum.seconds_per_mbit / mbit_s:>12.3f}")
    print(f"target: packed plan <= {TARGET_S:.0f} s at {TARGET_NODES} nodes ('vs target' = time / target); "
          f"bulk/limit = busiest link's time / M/λ; LP opt = the packing over every spanning tree, before "
          f"cutting it to one tree per root")
    return 0
