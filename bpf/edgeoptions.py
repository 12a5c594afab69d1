"""What ``netstorm node --edge-*`` configures of a gateway's LAN tier: where the LAN workers send, on which
path, and how the gateway aggregates and plans them (read by ``bpf/gateway.py`` and ``bpf/agentstart.py``).

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

from dataclasses import dataclass, field

from netstorm.errors import ConfigError
from netstorm.lan.deploy import LanTopology
from netstorm.lan.header import lanes_for_mtu
from netstorm.lan.layout import DEFAULT_POOL
from netstorm.lan_scenario import LanSpec

DEFAULT_SCALE = 16
DEFAULT_PORT = 9700
EDGE_MODES = ("auto", "xdp", "userspace", "tcp")
"""``--edge-mode``: XDP, the userspace fallback, the TCP path, or auto (netstorm/lan/pathpick.py)."""


@dataclass(frozen=True)
class EdgeOptions:
    """``netstorm node --edge-*``: where the LAN workers send and how to aggregate them."""

    workers: int
    """LAN workers (the DC then contributes ``1 + workers`` workers' gradients, its own trainer's too)."""
    listen: tuple[str, int]
    interface: str | None = None
    mode: str = "auto"
    scale: int = DEFAULT_SCALE
    slot_timeout: float = 0.2
    job: int = 1
    secret: bytes | None = field(default=None, repr=False)
    """The job secret: LAN datagrams carry tokens derived from it and are checked (None: unauthenticated)."""
    pool_slots: int = DEFAULT_POOL
    """Slots reused across chunks and iterations (``edge_pool_slots``; 0: one per chunk of the model)."""
    mtu: int = 1500
    """The LAN's IPv4 MTU (``edge_mtu``): lanes per datagram follow from it."""
    topology: LanTopology | None = None
    """Who aggregates whom (``edge_clusters``; None: one level, every worker sends to the gateway)."""
    group: tuple[str, int] | None = None
    """Multicast group for ACKs and results (``edge_group``; None: unicast)."""
    retransmit: float = 0.005
    """Seconds a worker waits for an ACK before resending (``edge_retransmit``)."""
    query_nacks: bool = True
    """Workers ask before resending; QUERYs are answered with NACKs of the missing (``edge_query_nacks``)."""
    lan: LanSpec | None = None
    """The LAN's description (``--edge-scenario``): announced to the scheduler, which plans the tier."""
    plan_wait: float = 0.0
    """Seconds the LAN tier waits at start for the scheduler's first plan (``edge_plan_wait``; 0: it
    starts with the configured topology, and a plan that arrives later switches it at an iteration
    boundary)."""
    report_change: float = 0.2
    """A measured worker rate that moved this much (relative) against the last report is reported
    (``dc_replan_change``, the scheduler's own threshold)."""
    report_interval: float = 10.0
    """Least seconds between two measured reports (``dc_replan_hold``; 0: after any iteration)."""
    pace_rates: bool = False
    """Each worker is told to pace its DATA to its rate in the plan (``dc_pace_rates``)."""
    rate_scale: float = 1.0
    """What the plan's rates are multiplied by to be the LAN's (``lan_bw_scale``: an emulated LAN is
    shaped to its description's rates times it, and the plan is made from the description)."""

    @property
    def lanes(self) -> int:
        return lanes_for_mtu(self.mtu)

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 64:
            raise ConfigError(f"--edge-workers must be in 1..64, got {self.workers}")
        if self.mode not in EDGE_MODES:
            raise ConfigError(f"--edge-mode must be one of {', '.join(EDGE_MODES)}, got {self.mode!r}")
        if self.mode == "tcp" and self.topology is not None and self.topology.clusters:
            raise ConfigError("--edge-mode tcp is one level (every worker streams to the gateway); edge_clusters "
                              "needs xdp or userspace")
        if self.mode in ("auto", "xdp") and not self.interface:
            raise ConfigError(f"--edge-mode {self.mode} needs --edge-interface (the LAN-facing interface)")
        if self.topology is not None and self.topology.workers != self.workers:
            raise ConfigError(f"edge_clusters describes {self.topology.workers} workers, --edge-workers is "
                              f"{self.workers}")
        if self.lan is not None and len(self.lan.workers) != self.workers:
            raise ConfigError(f"the LAN description has {len(self.lan.workers)} workers, --edge-workers is "
                              f"{self.workers}")
        if self.plan_wait < 0:
            raise ConfigError(f"edge_plan_wait must be >= 0 seconds, got {self.plan_wait!r}")
