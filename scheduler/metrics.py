"""The scheduler's Prometheus metrics (``metrics_listen``), read from its cores at each scrape.

Served from the process's start (``netstorm.metricserve`` on the scheduler's event loop), so the
unlabelled gauges (``netstorm_policy_version`` first) have a sample before any node registers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from scheduler.service import SchedulerService

STATES = ("expected", "registered", "alive", "down")


class SchedulerCollector(Collector):
    """Every ``netstorm_`` metric of one scheduler; links are labelled ``src``/``dst`` (DC ids)."""

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service = self.service
        current = service.consistency.current_version
        yield GaugeMetricFamily("netstorm_policy_version", "The current policy version (-1 before the first plan).",
                                value=-1 if current is None else current)
        yield CounterMetricFamily("netstorm_policy_publications", "Policy versions this scheduler published.",
                                  value=service.publications)
        yield CounterMetricFamily("netstorm_replans",
                                  "Policies published after the first (re-plans on rates, members, overrides).",
                                  value=max(0, service.publications - 1))
        yield CounterMetricFamily("netstorm_replan_cycles", "Re-plan cycles the scheduler ran.", value=service.cycles)
        yield GaugeMetricFamily("netstorm_last_bound_iteration", "The newest iteration bound to a policy (-1 before).",
                                value=service.consistency.last_bound)
        members = GaugeMetricFamily("netstorm_members", "Expected members, by state.", labels=["state"])
        counts = dict.fromkeys(STATES, 0)
        for _, state, _ in service._states():
            counts[state] = counts.get(state, 0) + 1
        for state, count in counts.items():
            members.add_metric([state], count)
        yield members
        yield GaugeMetricFamily("netstorm_membership_complete", "1 once every expected node registered.",
                                value=1 if service.complete.is_set() else 0)
        log = service.iterations
        yield CounterMetricFamily("netstorm_iterations", "Distinct iterations nodes reported complete.",
                                  value=log.completed)
        yield CounterMetricFamily("netstorm_iteration_seconds",
                                  "Sum of the completed iterations' times (each its slowest reported DC's).",
                                  value=log.seconds_total)
        rows = log.rows()
        last = rows[-1] if rows else None
        yield GaugeMetricFamily("netstorm_iteration_last_seconds", "The newest reported iteration's time.",
                                value=last[2] if last else 0.0)
        yield GaugeMetricFamily("netstorm_iteration_limit_seconds",
                                "Min-cut limit M/lambda of the newest reported iteration at its policy's rates "
                                "(-1 while unknown).", value=last[3] if last else -1.0)
        cut = log.min_cut_mbit(current) if current is not None else None
        yield GaugeMetricFamily("netstorm_min_cut_mbit", "lambda, the directed min cut of the current policy's rates.",
                                value=cut if cut is not None else 0.0)
        yield GaugeMetricFamily("netstorm_model_bytes", "Bytes of the model the nodes registered (0 before).",
                                value=log.model_bytes)
        believed = GaugeMetricFamily("netstorm_link_believed_mbit", "Rate the scheduler plans with on src->dst.",
                                     labels=["src", "dst"])
        reported = GaugeMetricFamily("netstorm_link_measured_mbit", "Newest rate a node reported for src->dst.",
                                     labels=["src", "dst"])
        planned = GaugeMetricFamily("netstorm_link_planned_mbit", "Rate the current policy was planned with.",
                                    labels=["src", "dst"])
        for src, dst, belief, latest, _ in service.link_rows():
            believed.add_metric([str(src), str(dst)], belief)
            if latest >= 0:
                reported.add_metric([str(src), str(dst)], latest)
        for (src, dst), rate in sorted(service._planned_rates.get(current, {}).items() if current is not None
                                       else ()):
            planned.add_metric([str(src), str(dst)], rate)
        yield from (believed, reported, planned)
        lan = GaugeMetricFamily("netstorm_lan_plan_version", "Each DC's LAN plan version (-1 before one).",
                                labels=["dc", "mode", "planner"])
        predicted = GaugeMetricFamily("netstorm_lan_predicted_gbit", "Throughput predicted by each DC's LAN plan.",
                                      labels=["dc"])
        for node_id, mode, version, planner, gbit in service.lan_rows():
            lan.add_metric([str(node_id), mode, planner], version)
            if version >= 0:
                predicted.add_metric([str(node_id)], gbit)
        yield from (lan, predicted)
        errors = CounterMetricFamily("netstorm_errors", "Errors at the scheduler, by type.", labels=["type"])
        for kind, count in sorted(service.errors.items()):
            errors.add_metric([kind], count)
        yield errors


def renderer(service: SchedulerService) -> Callable[[], bytes]:
    """What ``netstorm.metricserve.serve_metrics`` answers a scrape with: the scheduler's exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SchedulerCollector(service))
    return lambda: generate_latest(registry)
