"""A node's Prometheus metrics (``metrics_listen``), read from its state at each scrape.

A custom collector, not instruments in the hot path: the node already counts what it did
(``node/nodestats.py``, its links' meters, the gateway role's LAN counters), and a scrape served on the
node's own event loop (``netstorm.metricserve``) reads those between two events. Imported only when
metrics are asked for, so a node without them never loads ``prometheus_client``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, cast

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from node.service import GeneralNode


class LanCounters(Protocol):
    """What a gateway role counts of its LAN tier (bpf.gateway.GatewayRole)."""

    mode: str
    lan_iterations: int
    lan_failures: int
    lan_bytes: int
    lan_seconds: float
    lan_last_gbit: float

    def lan_losses(self) -> dict[str, int]: ...


class NodeCollector(Collector):
    """Every ``netstorm_`` metric of one node; links are labelled ``src``/``dst`` (DC ids)."""

    def __init__(self, node: GeneralNode) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        stats = node.stats
        me = str(node.node_id)
        info = GaugeMetricFamily("netstorm_node_info", "This process is the node of the DC named by dc.",
                                 labels=["dc"])
        info.add_metric([me], 1)
        yield info
        yield CounterMetricFamily("netstorm_iterations", "Iterations this node completed.", value=stats.iterations)
        failed = CounterMetricFamily("netstorm_iteration_failures", "Iterations that failed at this node, by cause.",
                                     labels=["cause"])
        for cause in ("failed", "gone", "timeout"):
            failed.add_metric([cause], stats.failed.get(cause, 0))
        yield failed
        seconds = sum(s for _, s, _ in stats.recent)
        last = stats.recent[-1] if stats.recent else None
        yield GaugeMetricFamily("netstorm_iteration_last_seconds",
                                "Seconds the newest completed iteration took here, from its start to its result.",
                                value=last[1] if last else 0.0)
        yield GaugeMetricFamily("netstorm_iteration_recent_mean_seconds",
                                f"Mean seconds of the last {len(stats.recent)} completed iterations.",
                                value=seconds / len(stats.recent) if stats.recent else 0.0)
        yield GaugeMetricFamily("netstorm_policy_version",
                                "Policy version of the newest completed iteration (-1 before one).",
                                value=last[2] if last else -1)
        sent = CounterMetricFamily("netstorm_link_sent_bytes", "Bytes of chunk frames queued on the link src->dst.",
                                   labels=["src", "dst"])
        received = CounterMetricFamily("netstorm_link_received_bytes", "Bytes of chunk frames received over src->dst.",
                                       labels=["src", "dst"])
        rate = GaugeMetricFamily("netstorm_link_rate_mbit",
                                 "Rate the link src->dst delivered while busy, as its sender measured it (Mbit/s).",
                                 labels=["src", "dst"])
        backlog = GaugeMetricFamily("netstorm_link_backlog_bytes", "Bytes queued on the link src->dst, not yet sent.",
                                    labels=["src", "dst"])
        for peer in sorted(set(node.links) | set(stats.sent_bytes)):
            sent.add_metric([me, str(peer)], stats.sent_bytes.get(peer, 0))
            link = node.links.get(peer)
            if link is not None:
                if link.meter.rate_bps is not None:  # None before the link was busy long enough to measure
                    rate.add_metric([me, str(peer)], link.meter.rate_bps / 1e6)
                backlog.add_metric([me, str(peer)], link.backlog_bytes)
        for peer, nbytes in sorted(stats.received_bytes.items()):
            received.add_metric([str(peer), me], nbytes)
        yield from (sent, received, rate, backlog)
        members = GaugeMetricFamily("netstorm_members", "Members of the job this node knows, by state.",
                                    labels=["state"])
        down = node.down
        members.add_metric(["up"], sum(1 for m in node.members if m not in down))
        members.add_metric(["down"], len(down))
        yield members
        yield CounterMetricFamily("netstorm_trainer_waits", "Pulls whose result was not ready yet.",
                                  value=stats.trainer_waits)
        yield CounterMetricFamily("netstorm_trainer_wait_seconds", "Seconds trainers waited for results.",
                                  value=stats.trainer_wait_s)
        errors = CounterMetricFamily("netstorm_errors", "Errors at this node, by type.", labels=["type"])
        for kind, count in sorted(stats.errors.items()):
            errors.add_metric([kind], count)
        for cause, count in sorted(stats.failed.items()):
            errors.add_metric([f"iteration_{cause}"], count)
        yield errors
        yield from self._lan()

    def _lan(self) -> Iterator[Metric]:
        """The LAN tier of a gateway node (nothing for a node without LAN workers)."""
        if self.node.edge is None or not hasattr(self.node.edge, "lan_iterations"):
            return
        edge = cast(LanCounters, self.node.edge)
        mode = GaugeMetricFamily("netstorm_lan_mode", "How this gateway aggregates its LAN (1 for its mode).",
                                 labels=["mode"])
        mode.add_metric([edge.mode], 1)
        yield mode
        yield CounterMetricFamily("netstorm_lan_iterations", "Iterations whose LAN sum this gateway collected.",
                                  value=edge.lan_iterations)
        yield CounterMetricFamily("netstorm_lan_failures", "Iterations whose LAN sum failed.",
                                  value=edge.lan_failures)
        yield CounterMetricFamily("netstorm_lan_summed_bytes", "Gradient bytes the LAN summed (model x workers).",
                                  value=edge.lan_bytes)
        yield CounterMetricFamily("netstorm_lan_seconds",
                                  "Seconds of LAN phases (previous result released to last chunk summed).",
                                  value=edge.lan_seconds)
        yield GaugeMetricFamily("netstorm_lan_throughput_gbit", "The newest LAN phase's throughput (Gbit/s).",
                                value=edge.lan_last_gbit)
        losses = CounterMetricFamily("netstorm_lan_losses", "Recoveries of lost LAN datagrams, by kind.",
                                     labels=["kind"])
        for kind, count in edge.lan_losses().items():
            losses.add_metric([kind], count)
        yield losses


def renderer(node: GeneralNode) -> Callable[[], bytes]:
    """What ``netstorm.metricserve.serve_metrics`` answers a scrape with: the node's exposition."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node))
    return lambda: generate_latest(registry)
