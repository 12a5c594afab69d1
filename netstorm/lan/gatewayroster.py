"""Who the LAN gateway serves and under which deployment: each worker's and cluster aggregator service's
address (bound by its authenticated HELLO), what its HELLO is answered with, and the MOVED notices that send
a worker or a service behind a changed deployment back for its part (netstorm/lan/redeploy.py).

Sans-I/O: HELLOs and the shell's clock in; every datagram it sends goes into the gateway's outbox, stamped
with the receiver's token and the current epoch (``stamp``)."""

from __future__ import annotations

import logging
from collections import deque

from netstorm.lan.deploy import Deployment, LanTopology
from netstorm.lan.errors import ServicesMissing, StaleDeployment, WireError
from netstorm.lan.header import MAX_WORKERS, OFFSETS, TOKEN_AT, Flag, Header, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.outbox import Outbox
from netstorm.lan.packets import control_packet
from netstorm.lan.redeploy import Redeployment, Switch
from netstorm.lan.tokens import LanTokens, Sender

log = logging.getLogger(__name__)
Address = tuple[str, int]
HELLO_NONCES = 16
"""HELLO nonces remembered per worker: a replayed HELLO from another address is refused."""
_ITERATION_AT = OFFSETS["iteration"]
_EPOCH_AT = OFFSETS["epoch"]


class GatewayRoster:
    """The LAN's members as the gateway knows them, and the deployment they are told."""

    def __init__(self, layout: EdgeLayout, *, workers: int, job: int, port: int, group: Address | None,
                 topology: LanTopology | None, retransmit: float, query_nacks: bool, tokens: LanTokens,
                 outbox: Outbox) -> None:
        self.layout = layout
        self.workers = workers
        self.job = job
        self.port = port
        """The gateway's UDP port: where a cluster's members send their DATA on its aggregator's host."""
        self.group = group
        self.topology = topology if topology is not None else LanTopology(workers)
        if self.topology.workers != workers:
            raise ValueError(f"the LAN topology has {self.topology.workers} workers, the agent {workers}")
        self.retransmit = retransmit
        self.query_nacks = query_nacks
        self.tokens = tokens
        self.outbox = outbox
        self.expected = self.topology.gateway_mask()
        self.deployments = Redeployment(self.topology, hold=max(2 * retransmit, 0.01))
        """The deployment's epoch and its changes at iteration boundaries (netstorm/lan/redeploy.py)."""
        self.pace_gbit: dict[int, float] = {}
        """Per worker, the Gbit/s its DATA is paced to (its HELLO answer says; the DC's plan, with
        ``dc_pace_rates``); a worker not listed is unpaced."""
        self.gia_threshold = 0
        """A FediAC job's threshold the WAN roots apply (told to every worker in its deployment)."""
        self.kernel_results = False
        """The program returns results itself (told to every worker in its deployment)."""
        self.addresses: dict[int, Address] = {}
        self.aggregators: dict[int, Address] = {}
        """Cluster aggregator services that said HELLO: where their members send DATA."""
        self.hello_epoch: dict[int, int] = {}
        """Worker -> the epoch of its latest answered HELLO (the deployment it was told)."""
        self._nonces: dict[int, deque[int]] = {}
        self.moved_sent = 0
        """MOVED sent: to aggregator services at a switch, and to senders behind (``stale_told``)."""
        self.stale_told = 0
        """MOVED to a sender whose DATA carried an old epoch, or who was to be NACKed before it asked for the
        current deployment."""
        self.forged = 0
        """Datagrams dropped for a wrong token or a replayed nonce (HELLO, PULL, QUERY, REPORT, AGG)."""

    @property
    def epoch(self) -> int:
        """The current deployment epoch (what DATA must carry, and what results announce)."""
        return self.deployments.epoch

    def stamp(self, datagram: bytes, worker: int) -> bytes:
        """``datagram`` with ``worker``'s gateway token for the iteration it names and the current deployment
        epoch (a NACK's epoch tells a worker still sending under another one to ask for its part)."""
        datagram = datagram[:_EPOCH_AT] + self.epoch.to_bytes(2, "little") + datagram[_EPOCH_AT + 2:]
        if not self.tokens.enabled:
            return datagram
        iteration = int.from_bytes(datagram[_ITERATION_AT: _ITERATION_AT + 4], "little")
        token = self.tokens.gateway(worker, iteration).to_bytes(8, "little")
        return datagram[:TOKEN_AT] + token + datagram[TOKEN_AT + 8:]

    def control(self, datagram: bytes, address: Address) -> bool:
        """Queue a control datagram; False when the queue is full (the protocol repeats it: a NACK timer fires
        again, a worker asks again)."""
        return self.outbox.control(datagram, address)

    def moved(self, worker: int, iteration: int, address: Address) -> None:
        """Tell ``worker`` (a worker, or an aggregator service) at ``address`` to say HELLO again."""
        notice = control_packet(Kind.MOVED, job=self.job, worker=worker, iteration=iteration, epoch=self.epoch,
                                token=self.tokens.gateway(worker, iteration))
        self.moved_sent += 1
        self.control(notice, address)

    def on_stale(self, exc: StaleDeployment, address: Address, now: float) -> None:
        """DATA of another epoch reached the gateway: its sender is told (see netstorm/lan/redeploy.py)."""
        if exc.worker < self.workers and self.deployments.on_stale(exc.worker, exc.iteration, exc.epoch, now):
            self.stale_told += 1
            self.moved(exc.worker, exc.iteration, address)

    def behind(self, worker: int, iteration: int, now: float) -> bool:
        """Whether ``worker``, about to be NACKed for ``iteration``, never asked for the current deployment:
        it is sent MOVED instead (at most once per hold), since its DATA goes where the old one said (to an
        aggregator that refuses it, perhaps without its tokens to answer)."""
        told = self.hello_epoch.get(worker, self.epoch)
        if told == self.epoch:
            return False
        address = self.addresses.get(worker)
        if address is not None and self.deployments.on_stale(worker, iteration, told, now):
            self.stale_told += 1
            self.moved(worker, iteration, address)
        return True

    def service_behind(self, head: int, iteration: int, now: float) -> bool:
        """Whether cluster ``head``'s service has not said HELLO under the current epoch (it missed the
        switch: its aggregator still sums the old cluster); it is sent MOVED instead, at most once per hold."""
        told = self.deployments.services.get(head, self.epoch)
        if told == self.epoch:
            return False
        address = self.aggregators.get(head)
        # keyed apart from the worker's own trainer (ids past MAX_WORKERS)
        if address is not None and self.deployments.on_stale(MAX_WORKERS + head, iteration, told, now):
            self.stale_told += 1
            self.moved(head, iteration, address)
        return True

    def services_missing(self, topology: LanTopology) -> list[int]:
        """The aggregators ``topology`` names whose service never said HELLO here (its members could not be
        told where to send: such a deployment waits)."""
        return sorted(h for h in topology.clusters if h not in self.aggregators)

    def switch(self, topology: LanTopology, iteration: int) -> Switch | None:
        """Run ``topology`` from iteration ``iteration + 1`` on, under the next epoch (None: it is the running
        one); ServicesMissing, with nothing changed, when it names an aggregator whose service never said
        HELLO. Every aggregator service that did is sent MOVED, so it asks for its part before its members
        send."""
        if topology.workers != self.workers:
            raise ValueError(f"a topology of {topology.workers} workers for a gateway of {self.workers}")
        if not self.deployments.propose(topology):
            return None
        absent = self.services_missing(topology)
        if absent:
            self.deployments.propose(self.topology)   # nothing pending here: the caller keeps the plan
            raise ServicesMissing(f"edge gateway: the aggregator services of workers {absent} never said HELLO; "
                                  f"a deployment naming them waits for them")
        switch = self.deployments.released(iteration)
        if switch is None:
            return None
        self.topology = topology
        self.expected = topology.gateway_mask()
        for head, address in self.aggregators.items():
            self.moved(head, switch.since, address)
        log.info("edge gateway: deployment epoch %d from iteration %d: clusters %s (was %s)", switch.epoch,
                 switch.since, dict(topology.clusters), dict(switch.previous.clusters))
        return switch

    def deployment(self, worker: int, *, aggregator: bool = False,
                   first_iteration: int | None = None) -> Deployment | None:
        """What ``worker`` is told in the answer to its HELLO (None: not yet known, its aggregator's service
        has not said HELLO under the current epoch; the worker asks again). An aggregator service whose
        worker aggregates no cluster in this deployment is told to stand by."""
        head = self.topology.aggregator_of(worker)
        send_to: tuple[str, int] | None = None
        if head is not None and not aggregator:
            found = self.aggregators.get(head)
            if found is None or not self.deployments.member_ready(worker):
                return None
            send_to = (found[0], self.port)
        members = self.topology.clusters.get(worker, ()) if aggregator else ()
        return Deployment(pool=self.layout.num_slots, lanes=self.layout.lanes, scale=self.layout.scales[0],
                          send_to=send_to, group=self.group, members=tuple(members), retransmit=self.retransmit,
                          query_nacks=self.query_nacks, kernel_results=self.kernel_results,
                          first_iteration=first_iteration, gia_threshold=self.gia_threshold, epoch=self.epoch,
                          standby=aggregator and worker not in self.topology.clusters,
                          pace_gbit=None if aggregator else self.pace_gbit.get(worker))

    def on_hello(self, head: Header, address: Address, *, first_iteration: int | None) -> bool:
        """Bind the worker to the address its (authenticated) HELLO came from, so a restarted worker is
        found again; ``iteration`` carries the worker's nonce, and with a secret a nonce already seen from
        another address is a replay and refused. A HELLO flagged AGGREGATOR comes from a cluster
        aggregator's service: its address becomes where the cluster's members send DATA. The answer carries
        the worker's deployment; a member whose aggregator has not said HELLO yet gets none (it asks again).
        True when a worker (not a service) was answered."""
        seen = self._nonces.setdefault(head.worker, deque(maxlen=HELLO_NONCES))
        bound = self.aggregators if head.flags & Flag.AGGREGATOR else self.addresses
        if self.tokens.enabled and head.iteration in seen and bound.get(head.worker) != address:
            self.forged += 1
            raise WireError(f"HELLO as worker {head.worker} from {address} replays an earlier nonce")
        if head.iteration not in seen:
            seen.append(head.iteration)
        aggregator = bool(head.flags & Flag.AGGREGATOR)
        deployment = self.deployment(head.worker, aggregator=aggregator, first_iteration=first_iteration)
        if deployment is None:
            return False
        if aggregator:
            self.deployments.on_service_hello(head.worker)
        bound[head.worker] = address
        if not aggregator:
            self.hello_epoch[head.worker] = self.epoch
        # the answer tells the worker our layout (tensors, chunks) and scale, so it can check its own
        reply = control_packet(Kind.HELLO, job=self.job, worker=head.worker, iteration=head.iteration,
                               tensor=len(self.layout.sizes), chunk=self.workers, slot=self.layout.num_chunks,
                               scale=self.layout.scales[0], flags=head.flags & Flag.AGGREGATOR, epoch=self.epoch,
                               token=self.tokens.of(Sender.GATEWAY, head.worker, head.iteration, keep=False))
        self.control(reply + deployment.encode(), address)
        return not aggregator

    def nonces(self, worker: int) -> list[int]:
        """The HELLO nonces remembered for ``worker`` (newest last)."""
        return list(self._nonces.get(worker, ()))
