"""Runtime options: the paper's Table I and II knobs plus the runtime's own timeouts.

One frozen ``Config`` is resolved from defaults < config file (TOML) < environment (``NETSTORM_<NAME>``)
< command-line flags, so every option is settable in all three places with the same name.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import itertools
import math
import os
import re
import tomllib
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from netstorm.auth import load_secret
from netstorm.compression.options import METHODS, CompressionOptions
from netstorm.dcplanners import PLANNERS
from netstorm.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Config:
    """All tunables. Sizes are in elements unless the name says bytes."""

    # Paper, Table II.
    num_root_servers: int = 0
    """Roots of the multi-root FAPT; 0 means one per node (the paper's default)."""
    chunk_size: int = 1_000_000
    """Largest chunk in elements; smaller tensors travel whole."""
    primary_busy_bound: int = 2
    """Chunks in flight on the primary path before the sender considers auxiliary paths."""
    auxiliary_queue_length: int = 1
    """Chunks an auxiliary path may have in flight."""
    probe_chunk_size: int = 2_000_000
    """Smallest chunk, in bytes, whose one-way delay counts as a throughput sample."""
    probe_chunk_num: int = 4
    """Samples per throughput report."""
    probe_window: float = 0.25
    """Shortest time in seconds a throughput report's samples span; a window of PROBE_CHUNK_NUM samples
    grows until it does, so millisecond stamp jitter stays small against it (it changes nothing for
    chunks of megabytes)."""
    update_time: float = 5.0
    """Seconds between the scheduler's re-plans."""
    # Paper, Table I.
    enable_awareness: bool = True
    """Re-plan from measured rates; false keeps the first policy for the whole run."""
    enable_aux_path: bool = True
    """Offload chunks onto auxiliary paths when the primary path is busy or lags its plan, and plan the
    share of each tree link's chunks they carry where the trees alone leave a link the bottleneck."""
    aux_slowdown: float = 0.3
    """Auxiliary paths carry a tree edge's chunks only while that link sends more than this fraction
    below the rate its policy was planned with (a stale plan); 0 offloads whenever the primary is busy,
    the paper's rule."""
    aux_reroute: float = 0.5
    """A chunk already queued on a tree edge moves to an auxiliary path through an idle link (when that
    delivers it sooner) while the edge sends below this fraction of its planned rate; 0 never moves
    queued chunks. Only with auxiliary paths on and ``aux_slowdown`` above 0."""
    update_rate: float = 0.2
    """Relative rate change (largest over the links) that triggers a new policy; 0 refreshes on every
    update. Reports carry a few % of noise, and trees re-planned onto noise run slower than the old ones."""
    replan_gain: float = 0.1
    """A re-plan (on a rate change, not a membership change) replaces the current policy only when, at the
    rates it was made from, the fluid model predicts it at least this fraction faster; 0 takes every
    re-plan."""
    react_change: float = 0.3
    """Relative change of one link's reported rate (its belief and last two reports), against the rate
    the current policy was planned with, that re-plans at once instead of at the next UPDATE_TIME, when
    it also makes the policy's busiest link that much slower; the same threshold on three or more links
    at once marks a network change, after which older reports stop counting; 0 waits for UPDATE_TIME."""
    react_interval: float = 1.0
    """Shortest time in seconds between two re-plans started by rate changes (a burst of reports
    after one change re-plans once)."""
    stale_after: float = 30.0
    """Seconds a link's measured rate is believed as it is; after that, unless measured again, it decays
    toward the fastest rate believed for any link, so a link the trees dropped is tried again instead of
    being written off for good (the avalanche effect)."""
    stale_half_life: float = 60.0
    """Half-life in seconds of that decay."""
    tree_packing: bool = True
    """FAPT trees and chunk shares from the LP tree packing; false keeps the paper's Algorithm 2 (its
    shortest-path trees and chunk shares q_i / sum q)."""
    plan_fallback: bool = True
    """A multi-root FAPT plan predicted slower than one of its roots alone (or STAR at one of them) gives
    every chunk to that root and says so; false keeps Algorithm 2's shares whatever the prediction, as
    the paper."""
    planned_offload: bool = True
    """With auxiliary paths on, plan the fraction of each bottleneck tree link's chunks that its detours
    carry (with the shares, for packed trees), and re-plan those moves for the iteration running when a
    new policy is published; false leaves auxiliary paths to the sender's busy rule alone, as the paper."""
    explore_links: bool = True
    """With awareness and auxiliary paths on, policies published after a network change ask senders to
    route a few chunks through links no tree uses and nobody has measured since; false measures only
    what the trees and the busy rule's detours carry, as the paper."""
    stale_decay: bool = True
    """A link not measured for ``stale_after`` seconds is believed to recover toward the fastest
    believed rate (half-life ``stale_half_life``); false keeps its last value, as the paper."""
    belief_reports: int = 3
    """Reports per link whose median the scheduler believes (the scenario's rate counts as the first
    while it is fresh), so one skewed report cannot re-plan the job; 1 believes the newest report
    alone, the paper's rule."""
    # Runtime.
    iteration_timeout: float = 300.0
    """Seconds an iteration may take before every waiter fails with an error naming the iteration."""
    connect_timeout: float = 20.0
    """Seconds to establish a TCP connection or a registration."""
    heartbeat_interval: float = 1.0
    """Seconds between node heartbeats to the scheduler."""
    heartbeat_timeout: float = 5.0
    """Seconds of silence after which the scheduler declares a node dead."""
    clock_sync_interval: float = 10.0
    """Seconds between SNTP re-estimations of a node's clock offset."""
    max_frame_bytes: int = 64 * 1024 * 1024
    """Largest frame a peer may send; larger ones are rejected and the connection closed."""
    trainers: int = 1
    """Trainers (ranks) whose gradients make up this DC's contribution: each counts, the DC contributes
    their sum and its worker count says so (a DC with several GPUs runs one rank per GPU); an ``init``
    beyond them is refused at once."""
    max_ahead: int = 1
    """Iterations a trainer's push may run ahead of its oldest unpulled result (an error beyond it), and
    of the slowest rank's at the node (the push waits); bounds the results a node holds."""
    max_model_bytes: int = 16 * 1024**3
    """Largest model (float32 bytes of every registered tensor) a trainer's ``init`` may name: refused
    (``ModelTooLarge``) before anything is allocated for it, by the trainer (which also refuses a model
    larger than the shared memory free) and by its node."""
    check_finite: bool = False
    """Reject a push holding NaN or Inf, naming the DC and the tensor; nothing of it is counted."""
    hello_timeout: float = 10.0
    """Seconds a new data-plane connection may take to say which member it is; then it is closed."""
    frame_timeout: float = 60.0
    """Seconds a data-plane connection may stall in the middle of a frame; then it is closed."""
    idle_timeout: float = 60.0
    """Seconds a connection past its handshake may stay silent before it is closed: a data-plane
    connection after its Hello (senders keep an idle link open with a keepalive every third of this), a
    node's control connection after registration (nodes heartbeat every ``heartbeat_interval``) and an
    admin tool's between requests."""
    trainer_idle_timeout: float = 3600.0
    """Seconds a trainer connection (Unix socket or TCP) may stay silent between requests, from its
    first byte on; then it is closed and its place at the node freed. A trainer computes between
    requests: this bounds the longest step, not the wait for a reply."""
    max_connections_per_source: int = 64
    """Data-plane connections one source address may hold open at a node; more are closed at once."""
    # Emulation.
    lan_bw_scale: float = 1.0
    """Multiply every LAN rate a scenario gives (its workers' uplinks and downlinks, the gateway's port)
    when the emulator shapes the LAN; scenarios speak of 10-100 Gbit/s ports, and a veth bridge on one
    host moves a few Gbit/s in all, so rates above that are caps that never bind unless scaled down."""
    lan_uplink_shaping: str = "veth"
    """Where the emulator shapes a LAN worker's uplink: "veth", the egress of the worker's own interface
    (no extra hop; frames an XDP program there transmits, such as a two-level aggregator's forwarded
    partial sums, skip it), or "ifb", its bridge port's ingress redirected through an ifb device (every
    frame the worker emits, one more device hop each)."""
    # Trust.
    secret_file: str = ""
    """File whose bytes (at least 32; `netstorm secret FILE` writes one) are the job secret: every TCP
    connection (node to node, node to scheduler, admin, trainer TCP) then proves membership and the
    identity it claims. Empty: no authentication, for loopback and emulation only."""
    wan_tls: bool = False
    """Encrypt node-to-node and node-to-scheduler connections with TLS, pinning the job certificate
    SECRET_FILE.crt (and key SECRET_FILE.key) that `netstorm secret FILE --tls` writes; needs
    secret_file, and the same setting on every process of the job."""
    member_file: str = ""
    """This process's own member credential (`netstorm secret FILE --issue node:3 --authority AUTH`
    writes one): every TCP connection then proves this member's identity with its own key instead of
    the shared job secret, and checks the other side's certificate against the job's authority. The
    scheduler, every node and every admin tool each hold their own; ``secret_file`` then only keys the
    LAN tier's datagrams."""
    revoked_file: str = ""
    """The job's revocation list (`netstorm secret FILE --revoke MEMBER`): serials of member
    certificates refused from then on, read again whenever it changes; a revoked node's scheduler
    connection is closed at its next heartbeat. Empty: nothing revoked."""
    # Recovery.
    state_dir: str = ""
    """Directory where the scheduler keeps membership, policy versions and iteration bindings (an sqlite
    file, created with the directory if missing), so a scheduler restarted with the same command line
    resumes the job; empty keeps them in memory only."""
    scheduler_grace: float = 60.0
    """Seconds a node rides out the loss of the scheduler: it keeps running iterations already bound,
    reconnects with backoff and re-attaches; only after this long does it give up."""
    allow_joiners: bool = False
    """The scheduler admits DCs whose ids the job did not expect at its start (a restarted expected DC is
    always readmitted)."""
    layout_hash: str = ""
    """The job's model layout, as `netstorm layout-hash` prints it for the job's model (16 hex digits):
    the scheduler decides every trainer's layout check against it at once, so a wrong init is refused
    (LayoutMismatch) even first and with two DCs; empty: the layout a majority of the job's DCs registers."""
    # Operations.
    metrics_listen: str = ""
    """HOST:PORT where this process serves Prometheus metrics at /metrics (names prefixed netstorm_);
    empty: none. Under `netstorm local` it is the scheduler's address and node i (in the job's order)
    serves on PORT + 1 + i."""
    log_format: str = "text"
    """Log lines as "text" (one human-readable line each) or "json" (one JSON object per line: time,
    level, logger, message, and the process's role and DC)."""
    # PyTorch integration (the ``netstorm`` process-group backend and the DDP comm hook).
    torch_round: int = 262_144
    """Float32 elements of one node iteration of the torch backend (its one registered tensor): a collective
    of N elements takes ceil(N / TORCH_ROUND) iterations, the last one padded with zeros. The default is
    DDP's first bucket (1 MiB); DDP with ``bucket_cap_mb`` of TORCH_ROUND * 4 bytes sends each bucket as
    exactly one iteration. Every rank of the job must use the same value (the layout hash checks it)."""
    torch_socket: str = ""
    """Where a rank finds its DC's node, as a template with {rank}, {local_rank} and {group_rank} (torchrun's
    variables), {dc_index} (RANK // ranks per DC) and {dc} (dc_index + 1); empty: NETSTORM_SOCKET, as
    ``netstorm.connect()`` does."""
    on_dc_loss: str = "error"
    """What the torch backend's collectives do when a DC is lost: error (a typed error, the process group
    is broken) or continue (each collective is the survivors' sum or mean, one in flight runs again
    without the lost DC; DDP then needs ``netstorm.torch.mean_hook`` to average over the survivors)."""
    torch_ranks_per_dc: int = 0
    """With one torchrun across several DCs: the ranks of each DC, consecutive in rank order, which the
    torch_socket fields {dc} and {dc_index} divide RANK by; 0: torchrun's LOCAL_WORLD_SIZE (one host per
    DC). One torchrun per DC needs neither: each sets NETSTORM_SOCKET to its DC's node."""
    # Compression.
    compression: str = "none"
    """Gradient compression: none, fediac (consensus sparsification: vote on indices, then send b-bit
    integers at the agreed ones; two rounds per iteration), topk (each DC's top-k with error feedback, summed
    at the union of indices; two rounds), fp16 (nodes send float chunks as float16)."""
    fediac_k: float = 0.05
    """Indices each contributor votes per iteration (fediac, topk): a share of the model's elements below 1,
    else a count; the paper's 5 %."""
    fediac_bits: int = 0
    """Bits b of a quantized FediAC value (2-24); 0 derives b from a dense first iteration as the paper's
    Corollary 1 does."""
    fediac_votes: int = 0
    """FediAC's threshold a: an index is sent when at least this many contributors voted it; 0 takes
    ceil(0.15 x contributors), the paper's a = 3 at 20 contributors."""
    fediac_gia_reuse: int = 1
    """Iterations one FediAC GIA serves (ours, not the paper's): above 1, the iterations after a vote skip
    the vote round and send values at the kept GIA, scaled by the previous round's max; 1 votes every
    iteration, as the paper does."""
    # DC planning.
    dc_planner: str = "flat"
    """How the scheduler plans the tier inside each DC whose LAN it knows: flat (every worker to the
    gateway), aleph (M-WCHA worker clusters), pahina (precision-aware assignment), eina
    (throughput-maximizing trees)."""
    dc_plan_time_limit: float = 60.0
    """Seconds EINA's MILP may take on one DC; past it the solver-free heuristic answers."""
    eina_integer_rates: bool = False
    """EINA's IQCP variant: integer rates (Gbit/s), faster to solve for a little less throughput."""
    eina_depth: int = 3
    """EINA's d*: aggregators a flow may traverse, the gateway's included (3 = two levels below the
    gateway, what the LAN data plane runs)."""
    eina_rack_uplinks: bool = True
    """EINA sees each rack's uplink as a link its aggregators share (a deviation: the paper's fabric is
    non-blocking); false: the paper's model, which plans flat on racked DCs whose workers are the only
    aggregators, since it cannot see the uplinks their flows cross."""
    dc_pace_rates: bool = True
    """A LAN worker paces its DATA to its rate in the DC's plan (PAHInA's sender-side rate allocation),
    told in its HELLO answer; false: it sends as fast as its socket takes. On because paced plans never
    measured slower and were up to 2x faster where members oversubscribe a port (README, "Pacing to the
    plan's rates")."""
    pahina_inflation: bool = True
    """PAHInA ranks candidate aggregators also by how much a worker's precision would up-cast their
    aggregate (false: by path cost alone, the paper's Algorithm 1)."""
    dc_replan_change: float = 0.2
    """Relative change of one LAN worker's reported rate, against the rate the DC's plan was made from,
    that re-plans the DC; 0 re-plans on every report. A gateway reports its measured rates when one moved
    this much against its last report; an uplink sample bounded by the gateway's own pacing (a paced worker,
    an aggregator's slowest member) counts only when it is this much below that bound."""
    dc_replan_hold: float = 10.0
    """Least seconds between two plans of one DC made from measured rates (a described LAN that changed
    shape is planned at once), and between two measured reports of a gateway: a LAN whose measurements
    wander is not re-planned at every iteration."""
    # LAN tier.
    edge_pool_slots: int = 1024
    """Aggregation slots a LAN gateway (and each LAN aggregator) reuses across chunks and iterations, as
    SwitchML does: a worker keeps at most this many chunks in flight, and the slot map takes
    pool * (64 + 4 * lanes) bytes whatever the model (at most 56 MB). 0: one slot per chunk of the model."""
    edge_mtu: int = 1500
    """IPv4 MTU of the LAN; the lanes per datagram follow from it (357 at 1500). XDP native mode on veth
    takes at most 3504 without multi-buffer programs, and the program's per-lane loops must fit the
    verifier's instruction budget (results/lan-dataplane-verifier-lanes.json says up to which MTU)."""
    edge_clusters: str = ""
    """Two-level LAN aggregation: "A:M,M;B:M" makes LAN worker A aggregate workers M... (and itself) with
    the XDP program on its own host and forward the partial sum to the gateway; empty: one level."""
    edge_retransmit: float = 0.005
    """Seconds a LAN worker waits past a gap in the ACKs (a later chunk acknowledged, this one not) before
    it resends the missing chunks; the wait grows to the measured ACK round trip when that is longer."""
    edge_query_nacks: bool = True
    """A LAN worker that finds a gap first only asks the gateway (QUERY), which NACKs exactly the workers
    missing from the chunk's slot (and does so unasked for a chunk still open well below the highest
    completed one); a chunk still late a timeout later is asked about again. False: every
    worker resends its copy of a late chunk at once (one loss costs a resend per worker, but no round trip
    to ask)."""
    edge_overlap: bool = False
    """A gateway hands its node each WAN chunk of a tensor as soon as the LAN summed the chunks under it, so
    the chunk's WAN step starts while the LAN sums the rest; False: the node's WAN step of a tensor starts
    once the LAN summed the whole iteration (the default: on this 2-core host the overlap made the XDP
    path's LAN sum 2-3x slower and the iteration longer, and did not shorten the TCP path's; README, end to
    end)."""
    edge_group: str = "239.77.0.1:9701"
    """Multicast group ADDRESS:PORT the gateway sends ACKs and results to, one datagram replicated by the
    LAN for every worker; empty: one unicast copy per worker."""
    edge_plan_wait: float = 10.0
    """Seconds a gateway that announced its LAN (``--edge-scenario``) waits at start for the scheduler's
    first plan of its tier (``dc_planner``) before starting with ``edge_clusters``; 0: no wait."""

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied and validated."""
        return resolve(base=self, overrides=changes)

    def secret(self) -> bytes | None:
        """The job secret (the bytes of ``secret_file``), or None without one; ConfigError if unusable."""
        return load_secret(self.secret_file) if self.secret_file else None

    def validate(self) -> None:
        """Reject values no run could use, naming the option first (``resolve`` prefixes where it came from)."""
        for name, field in FIELDS.items():
            value = getattr(self, name)
            if type(field.default) is float and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
            if type(field.default) is int and not -MAX_INT <= value <= MAX_INT:
                raise ConfigError(f"{name} must fit in 64 bits (the job's wire), got {value!r}")
        self.secret()
        if self.idle_timeout <= self.heartbeat_interval:
            raise ConfigError(f"idle_timeout ({self.idle_timeout:g} s) must exceed heartbeat_interval "
                              f"({self.heartbeat_interval:g} s): a registered node is silent between heartbeats")
        if self.layout_hash and not re.fullmatch(r"[0-9a-f]{16}", self.layout_hash):
            raise ConfigError(f"layout_hash must be 16 lowercase hex digits, as netstorm layout-hash prints them "
                              f"(or empty), got {self.layout_hash!r}")
        if self.wan_tls and not self.secret_file:
            raise ConfigError("wan_tls needs secret_file: its certificate and key sit beside the secret")
        positive_ints = ("chunk_size", "primary_busy_bound", "auxiliary_queue_length",
                         "probe_chunk_size", "probe_chunk_num", "max_frame_bytes", "trainers", "max_model_bytes",
                         "max_connections_per_source", "belief_reports", "torch_round")
        for name in positive_ints:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.edge_pool_slots < 0:
            raise ConfigError(f"edge_pool_slots must be >= 0 (0: one per chunk), got {self.edge_pool_slots}")
        if not 576 <= self.edge_mtu <= 9000:
            raise ConfigError(f"edge_mtu must be in 576..9000 bytes, got {self.edge_mtu}")
        if self.edge_plan_wait < 0:
            raise ConfigError(f"edge_plan_wait must be >= 0 seconds, got {self.edge_plan_wait!r}")
        if self.edge_retransmit <= 0:
            raise ConfigError(f"edge_retransmit must be positive seconds, got {self.edge_retransmit!r}")
        if self.on_dc_loss not in ("error", "continue"):
            raise ConfigError(f"on_dc_loss must be error or continue, got {self.on_dc_loss!r}")
        if self.torch_ranks_per_dc < 0:
            raise ConfigError(f"torch_ranks_per_dc must be >= 0 (0: LOCAL_WORLD_SIZE), got {self.torch_ranks_per_dc}")
        if self.max_ahead < 0:
            raise ConfigError(f"max_ahead must be >= 0, got {self.max_ahead!r}")
        if self.num_root_servers < 0:
            raise ConfigError(f"num_root_servers must be >= 0 (0 = all nodes), got {self.num_root_servers}")
        for name in ("update_time", "iteration_timeout", "connect_timeout", "heartbeat_interval",
                     "heartbeat_timeout", "clock_sync_interval", "hello_timeout", "frame_timeout",
                     "scheduler_grace", "idle_timeout", "trainer_idle_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive seconds, got {getattr(self, name)!r}")
        for name in ("update_rate", "react_change", "react_interval", "probe_window", "stale_after"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.lan_bw_scale > 0:
            raise ConfigError(f"lan_bw_scale must be positive, got {self.lan_bw_scale!r}")
        if self.lan_uplink_shaping not in ("veth", "ifb"):
            raise ConfigError(f"lan_uplink_shaping must be veth or ifb, got {self.lan_uplink_shaping!r}")
        if not 0 <= self.replan_gain < 1:
            raise ConfigError(f"replan_gain must be in [0, 1), got {self.replan_gain!r}")
        if self.stale_half_life <= 0:
            raise ConfigError(f"stale_half_life must be positive seconds, got {self.stale_half_life!r}")
        if not 0 <= self.aux_slowdown < 1:
            raise ConfigError(f"aux_slowdown must be in [0, 1), got {self.aux_slowdown!r}")
        if not 0 <= self.aux_reroute <= 1:
            raise ConfigError(f"aux_reroute must be in [0, 1], got {self.aux_reroute!r}")
        self._validate_compression()
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format must be text or json, got {self.log_format!r}")
        if self.metrics_listen:
            host, sep, port = self.metrics_listen.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"metrics_listen must be HOST:PORT, got {self.metrics_listen!r}")
        if self.dc_planner not in PLANNERS:
            raise ConfigError(f"dc_planner must be one of {', '.join(PLANNERS)}, got {self.dc_planner!r}")
        if self.dc_plan_time_limit <= 0:
            raise ConfigError(f"dc_plan_time_limit must be positive seconds, got {self.dc_plan_time_limit!r}")
        if self.eina_depth < 2:
            raise ConfigError(f"eina_depth must be >= 2 (the gateway and one aggregator), got {self.eina_depth!r}")
        if self.dc_replan_change < 0:
            raise ConfigError(f"dc_replan_change must be >= 0, got {self.dc_replan_change!r}")
        if self.dc_replan_hold < 0:
            raise ConfigError(f"dc_replan_hold must be >= 0 seconds, got {self.dc_replan_hold!r}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(f"heartbeat_timeout ({self.heartbeat_timeout} s) must exceed heartbeat_interval "
                              f"({self.heartbeat_interval} s), or every node is declared dead between heartbeats")


    def _validate_compression(self) -> None:
        CompressionOptions.of(self)  # raises ConfigError naming the option


MAX_INT = 2**63 - 1
"""Largest integer option: the scheduler hands the job's options to the nodes as msgpack int64."""
FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}
CHOICES: dict[str, tuple[str, ...]] = {"compression": METHODS, "dc_planner": PLANNERS}
"""Options whose values are an extension point's registered names: their flags offer exactly those."""
DESIGN_SWITCHES: tuple[str, ...] = (
    "tree_packing", "plan_fallback", "planned_offload", "aux_slowdown", "aux_reroute", "explore_links", "stale_decay",
    "belief_reports", "react_change", "replan_gain", "update_rate",
)
"""The options whose values separate this project's design (their defaults) from the published one."""
PAPER_DESIGN: dict[str, Any] = {
    "tree_packing": False,     # Algorithm 2's shortest-path trees, chunk shares q_i / sum q
    "plan_fallback": False,    # those shares even where one root alone is predicted faster
    "planned_offload": False,  # auxiliary paths only by the Fig. 7 rule
    "aux_slowdown": 0.0,       # Fig. 7: auxiliary past PRIMARY_BUSY_BOUND, whatever the plan says
    "aux_reroute": 0.0,        # a queued chunk keeps its path
    "explore_links": False,
    "stale_decay": False,
    "belief_reports": 1,       # Algorithm 2: each link's latest throughput measurement
    "react_change": 0.0,       # re-plans only every UPDATE_TIME
    "replan_gain": 0.0,
    "update_rate": 0.0,        # the paper's implementation refreshes every UPDATE_TIME regardless
}
"""The published NetStorm's value of every design switch (``Config().replace(**PAPER_DESIGN)``)."""
LOCAL: frozenset[str] = frozenset({"secret_file", "member_file", "revoked_file", "wan_tls", "torch_round",
                                   "torch_socket", "torch_ranks_per_dc", "on_dc_loss", "metrics_listen",
                                   "log_format"})
"""Options each process sets for itself: the scheduler does not hand them to the nodes with the job's
configuration (a path on its own host means nothing on theirs)."""


def _field_docs() -> dict[str, str]:
    """The attribute docstrings under each field, so ``--help`` and the README say the same thing."""
    tree = ast.parse(inspect.getsource(Config))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _field_sections() -> dict[str, str]:
    """Field -> the concern it belongs to: the ``# Section.`` comment above it in ``Config``."""
    sections: dict[str, str] = {}
    current = "Other"
    for line in inspect.getsource(Config).splitlines():
        stripped = line.strip()
        if line.startswith("    # ") and not line.startswith("     "):
            current = stripped[2:].split(" (")[0].rstrip(".")
        elif line.startswith("    ") and not line.startswith("     ") and ":" in stripped:
            name = stripped.split(":", 1)[0]
            if name in FIELDS:
                sections.setdefault(name, current)
    return sections


DOCS = _field_docs()
SECTIONS = _field_sections()
"""Option -> its concern ("Paper, Table II", "Runtime", "Trust", "Operations", "LAN tier", ...)."""
ENV_PREFIX = "NETSTORM_"
NOT_OPTIONS: frozenset[str] = frozenset({"SOCKET", "CLOCK_SKEW", "LOCAL_RUN_DIR", "EMU_REGISTRY"})
"""``NETSTORM_`` variables that are not options (so no "did you mean" is offered for them)."""


def closest(name: str, known: Collection[str]) -> str | None:
    """The one of ``known`` a mistyped ``name`` most likely meant (None when none is close)."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return close[0] if close else None


def suggest(name: str, known: Collection[str]) -> str:
    """ "; did you mean 'X'?" for the closest of ``known`` to a mistyped ``name``, or ""."""
    match = closest(name, known)
    return f"; did you mean {match!r}?" if match else ""


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` to the field's type, with an error naming option and source."""
    default = FIELDS[name].default
    kind = type(default)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is int:
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError(value)
                return int(value)
            if isinstance(value, str):
                number = float(value)
                if not number.is_integer():
                    raise ValueError(value)
                return int(number)
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            number = float(value)
            if not math.isfinite(number):  # NaN passes every range check, so refuse it here
                raise ValueError(value)
            return number
        if kind is str:
            if not isinstance(value, str):
                raise ValueError(value)
            return value
    except (TypeError, ValueError):
        finite = " (a finite number)" if kind is float else ""
        raise ConfigError(f"{source}: {name} expects {kind.__name__}{finite}, got {value!r}") from None
    return value


def _normalise(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def load_file(path: str | Path) -> dict[str, Any]:
    """Options from a TOML file: top-level keys or a ``[netstorm]`` table, names in any case."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    table = data.get("netstorm", data)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [netstorm] must be a table")
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = _normalise(key)
        if name not in FIELDS:
            raise ConfigError(f"{path}: unknown option {key!r}{suggest(name, FIELDS)} (every option: "
                              "netstorm scheduler --help)")
        out[name] = _coerce(name, value, str(path))
    return out


def load_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Options from ``NETSTORM_<NAME>`` variables. Other ``NETSTORM_`` names are left alone: some are not
    options (``NETSTORM_SOCKET``, ``NETSTORM_CLOCK_SKEW``, ``NETSTORM_LOCAL_RUN_DIR``, ...)."""
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = _normalise(key[len(ENV_PREFIX):])
        if name in FIELDS:
            out[name] = _coerce(name, value, f"environment {key}")
        elif key[len(ENV_PREFIX):] not in NOT_OPTIONS:
            match = closest(name, FIELDS)
            if match:  # another tool's variable is left alone; one a letter away from an option is not
                warnings.warn(f"environment {key} is not an option; did you mean {ENV_PREFIX}{match.upper()}?",
                              stacklevel=2)
    return out


def resolve(
    *,
    base: Config | None = None,
    file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Defaults < file < environment < overrides (e.g. CLI flags), validated."""
    values: dict[str, Any] = dataclasses.asdict(base or Config())
    sources: dict[str, str] = {}
    if file is not None:
        from_file = load_file(file)
        values.update(from_file)
        sources.update(dict.fromkeys(from_file, str(file)))
    if environ is not None:
        from_env = load_env(environ)
        values.update(from_env)
        sources.update({name: f"environment {ENV_PREFIX}{name.upper()}" for name in from_env})
    for key, value in (overrides or {}).items():
        name = _normalise(key)
        if name not in FIELDS:
            raise ConfigError(f"unknown option {key!r}")
        if value is not None:
            values[name] = _coerce(name, value, "command line")
            sources[name] = "command line"
    config = Config(**values)
    try:
        config.validate()
    except ConfigError as exc:
        named = dict.fromkeys(sources[word] for word in re.findall(r"[a-z_]+", str(exc)) if word in sources)
        if not named:
            raise
        raise ConfigError(f"{', '.join(named)}: {exc}") from None
    return config


def first_sentence(text: str) -> str:
    """The first sentence of an option's docstring (``--help`` is a summary; the docstring says the rest)."""
    depth = 0
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if char in ".;:" and depth == 0 and text[i + 1:i + 2] == " " and i >= 20:
            return text[:i]
    return text.rstrip(".")


JOB_SECTIONS: tuple[str, ...] = ("Paper, Table II", "Paper, Table I", "Runtime", "Trust", "Recovery", "Operations",
                                  "Compression", "DC planning", "LAN tier")
"""The concerns of a job's options (what the scheduler hands its nodes, and ``local`` its children)."""


def add_arguments(parser: argparse.ArgumentParser, sections: Sequence[str] | None = None,
                  names: Sequence[str] = (), listed: Sequence[str] = ()) -> None:
    """Add ``--config FILE`` and one ``--<option>`` flag per field to ``parser``. The help shows the options
    of ``sections`` (every one when None) and ``names``, one group per concern, with their defaults; the
    others are still accepted (a supervisor hands every child the same flags) but not shown. An extension
    point's flag offers its registered names; one in ``listed`` takes a comma-separated list of them (each
    ``name`` or ``name:settings``), as the emulator's one row per entry does."""
    shown = {n for n in FIELDS if sections is None or SECTIONS.get(n) in sections} | set(names)
    parser.add_argument("--config", metavar="FILE", help="TOML file with options (top level or [netstorm]); "
                        "every option is also NETSTORM_<NAME>")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, field in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        kind = type(field.default)
        default = str(field.default).lower() if kind is bool else repr(field.default) if kind is str else field.default
        if name in shown:
            section = SECTIONS.get(name, "Other")
            if section not in groups:
                groups[section] = parser.add_argument_group(f"{section} options")
            target: argparse._ActionsContainer = groups[section]
            doc = first_sentence(DOCS.get(name, "")).replace("%", "%%")  # argparse formats help with %
            help_text = f"{doc} (default {default})"
        else:
            target, help_text = parser, argparse.SUPPRESS
        if name in listed:
            target.add_argument(flag, dest=f"opt_{name}", type=_registered_list(name), metavar="LIST",
                                default=None, help=help_text)
        elif name in CHOICES:  # an extension point's registered names: the flag offers exactly those
            target.add_argument(flag, dest=f"opt_{name}", choices=CHOICES[name], default=None, help=help_text)
        else:
            target.add_argument(flag, dest=f"opt_{name}", metavar="BOOL" if kind is bool else kind.__name__.upper(),
                                default=None, help=help_text)


def _registered_list(name: str) -> Callable[[str], str]:
    """An argparse type: a comma-separated list whose every entry names one of ``CHOICES[name]``."""
    def check(text: str) -> str:
        unknown = [e for e in (p.strip() for p in text.split(",")) if e and e.split(":")[0] not in CHOICES[name]]
        if unknown or not text.strip():
            raise argparse.ArgumentTypeError(f"unknown {name} {', '.join(unknown) or repr(text)} "
                                             f"(choose from {', '.join(CHOICES[name])})")
        return text
    return check


def from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Config:
    """The Config a command line asks for, with the config file and environment beneath it."""
    overrides = {name: getattr(args, f"opt_{name}", None) for name in FIELDS}
    return resolve(
        file=getattr(args, "config", None),
        environ=os.environ if environ is None else environ,
        overrides=overrides,
    )
