"""A cluster aggregator's protocol without I/O (two-level LAN, ALEPH): the datagrams its service socket and
the gateway's multicast group deliver, the program's slot states and the shell's clock in; datagrams to
send and map writes for the aggregation program out (netstorm/lan/clusteractions.py).

``ClusterCore`` holds every rule of the service: the members' addresses (their HELLOs), the gateway's NACKs
(held for a reorder window, then the members the slot lacks are NACKed), MOVED for DATA of another epoch,
the HELLO asked again for a changed deployment and taking its answer, the tokens installed as iterations go
by, and the horizon. The asyncio shell (bpf/cluster.py) moves the bytes, runs the program and one timer;
tests drive the core with plain calls and a fake clock.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence

import numpy as np

from netstorm.errors import LayoutError
from netstorm.lan.clusteractions import (
    TAKE,
    Action,
    Ask,
    Bound,
    Configure,
    Fail,
    InstallTokens,
    ReadSlots,
    RequireTokens,
    Send,
)
from netstorm.lan.deploy import Deployment
from netstorm.lan.errors import WireError
from netstorm.lan.header import HEADER_BYTES, KIND_AT, OFFSETS, Flag, Header, Kind
from netstorm.lan.packets import control_packet, nack_packets
from netstorm.lan.slots import TOKEN_WINDOW
from netstorm.lan.tokens import LanTokens, Sender
from netstorm.lan.window import newer

log = logging.getLogger("netstorm.edge.cluster")
Address = tuple[str, int]
_ITERATION_AT, _EPOCH_AT, _WORKER_AT, _FLAGS_AT, _TOKEN_AT = (OFFSETS[k] for k in ("iteration", "epoch", "worker",
                                                                                 "flags", "token"))
_GROUP_KINDS = frozenset({int(Kind.ACK), int(Kind.RESULT), int(Kind.FAILED)})
REHELLO_S = 0.2
"""Seconds between two HELLOs of a service asking for its part of a changed deployment."""
MOVED_HOLD = 0.05
"""Least seconds between two MOVED this service sends one member for one iteration."""
TOLD_KEEP = 256
"""(member, iteration) pairs whose last MOVED is remembered; the record is cleared when fuller."""
REORDER_MIN = 0.002
"""Least wait between the gateway's NACK for a chunk and reading the chunk's slot here (the wait is at least the
members' ``retransmit``): the gateway may ask while members' datagrams are still on their way (aggregates
reach it from two paths, and a member's GSO batches may be reordered before this host's program), and a
member NACKed for a datagram that then arrives resends a duplicate."""
AHEAD = 1
"""Iterations past the newest this service knows the gateway receives whose DATA its program still sums. It
learns of a RESULT from the multicast its members learn of it from, and may take it after them (a busy loop,
a full group socket): their DATA of the next iteration must not be refused. No member can be further ahead
(each needs every result of the iteration before), so a datagram beyond is refused and counted."""


class ClusterCore:
    """The rules of one cluster aggregator service (see the module's docstring): LAN worker ``worker``'s, for
    the gateway at ``gateway``. ``userspace``: the fallback aggregator, which checks DATA's epoch itself."""

    def __init__(self, *, worker: int, job: int, gateway: Address, tokens: LanTokens, userspace: bool,
                 nonce: Callable[[], int] = lambda: secrets.randbits(32)) -> None:
        self.worker = worker
        self.job = job
        self.gateway = gateway
        self.tokens = tokens
        self.userspace = userspace
        self.nonce = nonce
        self.deployment: Deployment | None = None
        self.members: dict[int, Address] = {}
        """Where each worker that said HELLO here sends from (its members', its own trainer's, and after a
        deployment change possibly a member's whose HELLO came before this service took its new part):
        the address of its latest HELLO here. NACKs go only to the members its slot lacks."""
        self.nacks_in = 0
        """The gateway's NACKs for a chunk this cluster's aggregate is missing from."""
        self.nacks_out = 0
        """NACKs this service sent its members (a re-emission asked of its own trainer included)."""
        self.forged = 0
        """Datagrams dropped for a wrong token or a sender other than the one the kind allows."""
        self.rejected = 0
        """Datagrams dropped as malformed (logged)."""
        self.rehellos = 0
        """HELLOs this service said again for a changed deployment."""
        self.redeployed = 0
        """Deployments taken while running (the program's configuration rewritten)."""
        self.moved_sent = 0
        """MOVED sent to members whose DATA carried another epoch."""
        self.known: int | None = None
        """The newest iteration this service knows the gateway receives (None: none yet)."""
        self.horizon: int | None = None
        """The newest iteration whose DATA the program sums (None: any), as last asked of it."""
        self._shape: tuple[int, int, bool] | None = None
        """The loaded program's (pool, lanes, kernel_results): a deployment with others cannot be taken."""
        self._installed = -1
        self._token_workers: tuple[int, ...] = ()
        """Whose tokens are installed: this worker, its members, and after a change its previous members too
        (their DATA of the old epoch then authenticates, and is answered MOVED instead of dropped)."""
        self._nonce: int | None = None
        """The nonce of the HELLO this service awaits an answer to (None: none outstanding)."""
        self._hello_at = 0.0
        self._told: dict[tuple[int, int], float] = {}
        self._asked: dict[int, Ask] = {}
        """Slot -> the gateway's NACK looked at after a reorder window (at most one per slot, so the gateway's
        NACKs cannot grow it past the pool)."""
        self._out: list[Action] = []

    @property
    def epoch(self) -> int:
        return self.deployment.epoch if self.deployment is not None else 0

    def mask(self, deployment: Deployment) -> int:
        """The contributors this service's aggregator expects: itself and its members (none on standby)."""
        return 0 if deployment.standby else (1 << self.worker) | sum(1 << m for m in deployment.members)

    def next_timer(self) -> float | None:
        """When the shell must call ``tick`` at the latest (None: nothing is due)."""
        due = [a.due for a in self._asked.values()]
        if self._nonce is not None:
            due.append(self._hello_at)
        return min(due) if due else None

    # ------------------------------------------------------------------ events
    def begin(self, deployment: Deployment) -> list[Action]:
        """The program is loaded for ``deployment`` (the answer to the shell's first HELLO): configure it."""
        self.deployment = deployment
        self._shape = (deployment.pool, deployment.lanes, deployment.kernel_results)
        self.send(Configure(self.mask(deployment), deployment.epoch))
        if self.tokens.enabled:
            self.send(RequireTokens(1))
        self._bound(force=True)
        if deployment.first_iteration is not None:
            self._seen(deployment.first_iteration)
        return self._drain()

    def redeploy(self, deployment: Deployment) -> list[Action]:
        """Take a new part while running: the members and epoch rewritten in the program in place, the members'
        tokens installed from the deployment's first iteration."""
        self._redeploy(deployment)
        return self._drain()

    def follow(self, iteration: int) -> list[Action]:
        """``iteration`` comes next (a harness that knows the iterations says so): its tokens, its horizon."""
        self._seen(iteration)
        return self._drain()

    def ask(self, now: float) -> list[Action]:
        """Say HELLO to the gateway for this service's part of the current deployment, every REHELLO_S until
        answered; a call while one is outstanding changes nothing."""
        self._ask(now)
        return self._drain()

    def group(self, data: bytes | memoryview, now: float) -> list[Action]:
        """A datagram of the gateway's multicast group: an ACK or RESULT of iteration k says the gateway receives
        k (a RESULT or FAILED: k + 1 comes next), so k's tokens stay and the next ones go in, and the horizon
        rises; a RESULT under another epoch says the next iteration runs another deployment."""
        if len(data) < HEADER_BYTES or data[KIND_AT] not in _GROUP_KINDS:
            return []
        kind = data[KIND_AT]
        iteration = int.from_bytes(data[_ITERATION_AT: _ITERATION_AT + 4], "little")
        if kind == Kind.RESULT and int.from_bytes(data[_EPOCH_AT: _EPOCH_AT + 2], "little") != self.epoch:
            self._ask(now)
        finished = kind != Kind.ACK
        if self._moves(iteration, finished):
            # only what would move the window pays for the token's check (a burst of results repeats it)
            token = int.from_bytes(data[_TOKEN_AT: _TOKEN_AT + 8], "little")
            if self.tokens.valid(Sender.GROUP, 0, iteration, token, keep=False):
                self._seen(iteration, finished=finished)
            else:
                self.forged += 1
        return self._drain()

    def data(self, worker: int, iteration: int, epoch: int, address: Address, now: float) -> Sequence[Action]:
        """A member's DATA reached the service socket: the program takes it, or (it passes up DATA of another
        epoch) its sender is told MOVED. The fallback checks the epoch itself (``stale``)."""
        if self.userspace or epoch == self.epoch:
            return TAKE
        self._stale(worker, iteration, address, now)
        return self._drain()

    def stale(self, worker: int, iteration: int, address: Address, now: float) -> list[Action]:
        """DATA of another epoch reached this aggregator: its sender is told (once per iteration and hold),
        and this service asks the gateway in case it is the one behind."""
        self._stale(worker, iteration, address, now)
        return self._drain()

    def datagram(self, data: bytes, address: Address, now: float) -> list[Action]:
        """Anything but DATA on the service socket: the gateway's answer to our HELLO or its MOVED, a member's
        HELLO (its address), or the gateway's NACK for a chunk this cluster's aggregate is missing from."""
        if len(data) < HEADER_BYTES:
            return []
        kind = data[KIND_AT]
        ours = kind in (Kind.HELLO, Kind.MOVED) and address[0] == self.gateway[0] and data[_WORKER_AT] == self.worker \
            and (kind == Kind.MOVED or data[_FLAGS_AT] & Flag.AGGREGATOR)
        if not ours and kind not in (Kind.HELLO, Kind.NACK):
            return []
        try:
            head = Header.decode(data)
            if head.job != self.job:
                return []
            if ours and head.kind == Kind.HELLO:
                self._answer(head, data)
            elif ours:
                if not self.tokens.enabled or head.token == self.tokens.gateway(self.worker, head.iteration):
                    self._ask(now)
                else:
                    self.forged += 1
            elif head.kind == Kind.HELLO:
                self._member_hello(head, address)
            else:
                # the gateway's NACK lists its chunk's sequence number, passed on to the members
                seq = int.from_bytes(data[HEADER_BYTES: HEADER_BYTES + 4], "little") if head.count else None
                self._nack(head, address, seq, now)
        except WireError as exc:
            self.rejected += 1
            log.warning("edge aggregator: rejected datagram: %s", exc)
        return self._drain()

    def tick(self, now: float) -> list[Action]:
        """The timer came (or any time after it): HELLO again, and read the slots whose reorder window passed."""
        if self._nonce is not None and now >= self._hello_at:
            self._hello(now)
        due = tuple(a for a in self._asked.values() if a.due <= now)
        for a in due:
            del self._asked[a.slot]
        if due:
            self.send(ReadSlots(due))
        return self._drain()

    def slots(self, asks: Sequence[Ask], states: np.ndarray) -> list[Action]:
        """The slot rows (``netstorm.lan.slots.SLOT_FIELDS``) a ``ReadSlots`` asked for: NACK whoever each
        slot still lacks, at the address of its HELLO."""
        for a, state in zip(asks, states, strict=True):
            for worker in self.missing(a, state):
                where = self.members.get(worker)
                if where is None:
                    continue
                token = self.tokens.gateway(worker, a.iteration) if self.tokens.enabled else 0
                nack, = nack_packets(np.array([a.seq]), job=self.job, iteration=a.iteration, token=token,
                                     epoch=self.epoch)
                self.nacks_out += 1
                self.send(Send(nack, where))
        return self._drain()

    def missing(self, a: Ask, state: np.void) -> list[int]:
        """Who should resend the chunk ``a`` names: the members its slot here lacks; every member when the
        slot holds an older key or nothing (every datagram was lost); this worker's own trainer when the slot
        completed (its duplicate re-emits the aggregate); nobody when a newer key took the slot over."""
        if self.deployment is None:
            return []
        cluster = (self.worker, *self.deployment.members)
        key = (int(state["iteration"]), int(state["tensor"]), int(state["chunk"]))
        bitmap = int(state["bitmap"])
        age = ((a.iteration - key[0] + 2**31) & 0xFFFFFFFF) - 2**31
        if key == (a.iteration & 0xFFFFFFFF, a.tensor, a.chunk) and bitmap:
            if not int(state["busy"]):
                return [self.worker]
            return [w for w in cluster if not bitmap >> w & 1]
        if not bitmap or age > 0 or (age == 0 and key[1:] < (a.tensor, a.chunk)):
            return list(cluster)
        return []

    # ------------------------------------------------------------------ rules
    def send(self, action: Action) -> None:
        self._out.append(action)

    def _drain(self) -> list[Action]:
        out, self._out = self._out, []
        return out

    def _redeploy(self, deployment: Deployment) -> None:
        if self._shape is not None and self._shape != (deployment.pool, deployment.lanes, deployment.kernel_results):
            self.send(Fail(LayoutError(
                f"edge aggregator: worker {self.worker}: a deployment of pool {deployment.pool}, {deployment.lanes} "
                f"lanes (kernel results {deployment.kernel_results}) for a program loaded for {self._shape}")))
            return
        old = self.deployment
        self.deployment = deployment
        if old is not None and (old.epoch, old.members, old.standby) == (deployment.epoch, deployment.members,
                                                                         deployment.standby):
            return
        self.send(Configure(self.mask(deployment), deployment.epoch))
        self._token_workers = tuple(sorted({self.worker, *deployment.members, *(old.members if old else ())}))
        self._installed = -1
        self._bound()
        if deployment.first_iteration is not None:
            self._seen(deployment.first_iteration)
        self.redeployed += 1
        log.info("edge aggregator: worker %d %s from deployment epoch %d", self.worker,
                 "stands by" if deployment.standby else f"aggregates {sorted(deployment.members)}", deployment.epoch)

    def _ask(self, now: float) -> None:
        if self._nonce is None:
            self._nonce = self.nonce()
            self.rehellos += 1
            self._hello(now)

    def _stale(self, worker: int, iteration: int, address: Address, now: float) -> None:
        key = (worker, iteration)
        if now - self._told.get(key, float("-inf")) >= MOVED_HOLD:
            if len(self._told) >= TOLD_KEEP:
                self._told.clear()
            self._told[key] = now
            token = self.tokens.gateway(worker, iteration) if self.tokens.enabled else 0
            self.send(Send(control_packet(Kind.MOVED, job=self.job, worker=worker, iteration=iteration,
                                          epoch=self.epoch, token=token), address))
            self.moved_sent += 1
        self._ask(now)

    def _hello(self, now: float) -> None:
        nonce = self._nonce
        assert nonce is not None
        self.send(Send(control_packet(Kind.HELLO, job=self.job, worker=self.worker, iteration=nonce,
                                      flags=Flag.AGGREGATOR,
                                      token=self.tokens.of(Sender.WORKER, self.worker, nonce, keep=False)),
                       self.gateway))
        self._hello_at = now + REHELLO_S

    def _answer(self, head: Header, data: bytes) -> None:
        """The gateway's answer to this service's HELLO: take the deployment it carries."""
        nonce = self._nonce
        if nonce is None or head.iteration != nonce or (self.tokens.enabled and not self.tokens.valid(
                Sender.GATEWAY, self.worker, nonce, head.token, keep=False)):
            return
        deployment = Deployment.decode(data[HEADER_BYTES:])   # a bad one leaves the HELLO outstanding
        self._nonce = None
        self._redeploy(deployment)

    def _member_hello(self, head: Header, address: Address) -> None:
        if self.deployment is None:
            return
        if self.tokens.enabled and not self.tokens.valid(Sender.WORKER, head.worker, head.iteration, head.token,
                                                         keep=False):
            self.forged += 1
            return
        # whoever says HELLO here, member or not yet: after a change the gateway may answer a member (once
        # this service asked) before the answer that makes it a member reaches this service
        self.members[head.worker] = (address[0], address[1])

    def _nack(self, head: Header, address: Address, seq: int | None, now: float) -> None:
        """The gateway's NACK for a chunk: looked at after a reorder window (``tick``)."""
        deployment = self.deployment
        if deployment is None or head.flags & Flag.RESCALE or seq is None:
            return      # a RESCALE goes to every worker from the gateway itself; a NACK lists its chunk
        if address[0] != self.gateway[0] or (
                self.tokens.enabled and head.token != self.tokens.gateway(self.worker, head.iteration)):
            # from anywhere but the gateway, or without its token for us: accepted, it would make us NACK
            # members whose slot is empty (every one)
            self.forged += 1
            return
        self.nacks_in += 1
        self._seen(head.iteration)      # the gateway receives it
        if head.epoch != self.epoch:
            self._ask(now)      # the gateway runs another deployment: this service missed the switch
        held = self._asked.get(head.slot)
        if held is not None and (held.iteration, held.tensor, held.chunk) == (head.iteration, head.tensor, head.chunk):
            return      # already due for a look
        due = now + max(deployment.retransmit, REORDER_MIN)
        self._asked[head.slot] = Ask(head.slot, head.iteration, head.tensor, head.chunk, seq, due)

    def _moves(self, iteration: int, finished: bool) -> bool:
        """Whether iteration ``iteration`` (``finished``: its result or failure) would install tokens or raise
        the horizon."""
        reach = iteration + 1 if finished else iteration
        fresh_tokens = self.tokens.enabled and self.deployment is not None and \
            iteration + TOKEN_WINDOW - 1 > self._installed
        return fresh_tokens or self.known is None or newer(reach, self.known)

    def _seen(self, iteration: int, *, finished: bool = False) -> None:
        """The gateway receives ``iteration`` (``finished``: it is over, the next one comes): tokens from it for
        the window after (its DATA may still be in flight), and the horizon."""
        self._install(iteration)
        reach = iteration + 1 if finished else iteration
        if self.known is None or newer(reach, self.known):
            self.known = reach
            self._bound()

    def _bound(self, *, force: bool = False) -> None:
        """The horizon AHEAD past ``known``; none where no group is heard (no iteration would ever be learnt).
        ``force``: asked even if unchanged (a program configured before keeps its last bound)."""
        deployment = self.deployment
        horizon = None if self.known is None or deployment is None or deployment.group is None else \
            (self.known + AHEAD) & 0xFFFFFFFF
        if horizon != self.horizon or force:
            self.horizon = horizon
            self.send(Bound(horizon))

    def _install(self, base: int) -> None:
        """Tokens of every member and of this worker for iterations base .. base + TOKEN_WINDOW - 1."""
        last = base + TOKEN_WINDOW - 1
        if not self.tokens.enabled or last <= self._installed or self.deployment is None:
            return
        first = max(base, self._installed + 1)
        workers = self._token_workers or (self.worker, *self.deployment.members)
        self.send(InstallTokens([(w, k, self.tokens.worker(w, k)) for k in range(first, last + 1) for w in workers]))
        self._installed = last
