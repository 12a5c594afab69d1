"""The registry of LAN datagram kinds: each kind's wire number, who sends and who handles it, its payload,
whose token it carries, and the gateway core's handler.

A kind is added here and nowhere else but its handler: the header's ``Kind`` (this enum), the C program's
``NS_KIND_*`` defines (``header.c_definitions``), the decoders' payload rules (``Header.decode``,
``batch.valid_headers``), the gateway core's dispatch table and token checks and the worker's forged-token
rule all follow from these entries (tests/test_lan_kinds.py checks each one does). Wire numbers never change:
a peer of the same ``VERSION`` reads them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

MAX_DEPLOY_BYTES: Final = 1024
"""Largest HELLO payload (a worker's deployment)."""
MAX_REPORT_BYTES: Final = 64
"""Largest REPORT payload (a worker's downlink report)."""


class Party(enum.Enum):
    """Who sends or handles a datagram."""

    WORKER = "worker"
    """A LAN worker (netstorm/lan/sender.py)."""
    AGGREGATOR = "aggregator"
    """A data plane that sums DATA: the XDP program or the userspace fallback, at the gateway or a cluster."""
    GATEWAY = "gateway"
    """The gateway's core (netstorm/lan/gatewaycore.py) behind its agent (bpf/agent.py)."""
    CLUSTER = "cluster"
    """A cluster aggregator's service (bpf/cluster.py), between its members and the gateway."""


class Payload(enum.Enum):
    NONE = "none"
    """The header alone."""
    LANES = "lanes"
    """``count`` lanes (values, or u32 chunk sequence numbers), padded up to the layout's lane width."""
    BYTES = "bytes"
    """An opaque payload of at most ``KindSpec.max_payload`` bytes (msgpack)."""


class Token(enum.Enum):
    """Whose keyed token the header carries when the job has a secret (netstorm/lan/tokens.py)."""

    WORKER = "worker"
    """The sender worker's, for the header's worker and iteration: checked by whoever handles it."""
    GATEWAY = "gateway"
    """The gateway's, to the worker named or to the whole group: a worker drops one without it as forged."""
    AGENT = "agent"
    """The agent's own random value, which the data plane writes and the agent alone checks."""


@dataclass(frozen=True)
class KindSpec:
    """One kind's entry (see ``Kind``)."""

    senders: frozenset[Party]
    handlers: frozenset[Party]
    payload: Payload
    token: Token
    meaning: str
    checked: bool = False
    """A worker's request the gateway answers: its worker id and token are checked (after the handler's own
    cheap filters, so a request with no answer costs no token derivation)."""
    gateway: str | None = None
    """The name of the ``GatewayCore`` method that handles it when it reaches the gateway's port; None: the
    gateway refuses it as unexpected."""
    max_payload: int = 0
    """``Payload.BYTES`` only: the payload's limit."""


def _spec(senders: set[Party], handlers: set[Party], payload: Payload, token: Token, meaning: str, *,
          checked: bool = False, gateway: str | None = None, max_payload: int = 0) -> KindSpec:
    return KindSpec(frozenset(senders), frozenset(handlers), payload, token, meaning, checked, gateway, max_payload)


_W, _A, _G, _C = Party.WORKER, Party.AGGREGATOR, Party.GATEWAY, Party.CLUSTER


class Kind(enum.IntEnum):
    """The ``kind`` byte of a LAN datagram; each member is ``(wire number, KindSpec)``."""

    spec: KindSpec

    def __new__(cls, number: int, spec: KindSpec | None = None) -> Kind:
        # (a look-up, ``Kind(6)``, never gets here: the enum's own look-up takes it, hence the default)
        if spec is None:
            raise TypeError(f"kind {number} is registered without its KindSpec")
        member = int.__new__(cls, number)
        member._value_ = number
        member.spec = spec
        return member

    DATA = 1, _spec({_W, _C}, {_A}, Payload.LANES, Token.WORKER, gateway="_on_data", meaning=(
        "worker -> aggregator: fixed-point contribution (a cluster's service forwards its aggregate as DATA)"))
    AGG = 2, _spec({_A}, {_G}, Payload.LANES, Token.AGENT, gateway="_on_agg_datagram", meaning=(
        "gateway data plane -> gateway agent: the completed fixed-point sum of a slot"))
    NACK = 3, _spec({_G, _C}, {_W, _C}, Payload.LANES, Token.GATEWAY, meaning=(
        "agent -> worker: resend the chunks its u32 lanes list (sequence numbers, one datagram per worker for "
        "every chunk the agent found it missing from in one wake-up); with RESCALE and no lanes, re-quantise "
        "(iteration, tensor, chunk) at ``scale`` first and resend it"))
    RESULT = 4, _spec({_G, _A}, {_W, _C}, Payload.LANES, Token.GATEWAY, meaning=(
        "agent -> worker: the result of the WAN step for one chunk (float32 lanes, or a compressed round's "
        "exact integers or bitmap, named by ``precision``)"))
    PULL = 5, _spec({_W}, {_G}, Payload.NONE, Token.WORKER, checked=True, gateway="on_pull", meaning=(
        "worker -> agent: resend the RESULT of (iteration, tensor, chunk)"))
    HELLO = 6, _spec({_W, _C, _G}, {_G, _W, _C}, Payload.BYTES, Token.WORKER, checked=True, gateway="on_hello",
                     max_payload=MAX_DEPLOY_BYTES, meaning=(
        "worker -> agent: announces the worker's address; the agent answers with a HELLO whose payload is the "
        "worker's deployment (netstorm/lan/deploy.py: pool, lane width, where to send DATA, its cluster)"))
    ACK = 7, _spec({_G}, {_W, _C}, Payload.LANES, Token.GATEWAY, meaning=(
        "agent -> every worker (one multicast datagram): these chunks' slots completed, send what reuses them"))
    QUERY = 8, _spec({_W}, {_G}, Payload.LANES, Token.WORKER, checked=True, gateway="on_query", meaning=(
        "worker -> agent: which of these chunks (u32 sequence numbers) completed? Answered by a unicast ACK"))
    REPORT = 9, _spec({_W}, {_G}, Payload.BYTES, Token.WORKER, checked=True, gateway="on_report",
                      max_payload=MAX_REPORT_BYTES, meaning=(
        "worker -> agent: how its result burst of ``iteration`` arrived (netstorm/lan/downlink.py: bytes and "
        "span, msgpack in the payload), so the gateway measures its downlink; never answered"))
    FAILED = 10, _spec({_G}, {_W}, Payload.NONE, Token.GATEWAY, meaning=(
        "agent -> every worker (one multicast datagram; unicast in answer to a PULL or QUERY): the node failed "
        "``iteration``, no result will come; the workers end it with a typed error and go on with the next"))
    MOVED = 11, _spec({_G, _C}, {_W, _C}, Payload.NONE, Token.GATEWAY, meaning=(
        "agent or cluster aggregator -> a worker or aggregator service whose DATA (of ``iteration``) carried "
        "another deployment ``epoch`` than the current one (this header's ``epoch``), or agent -> every "
        "aggregator service when the deployment changes: say HELLO again for the current deployment, then "
        "resend the iteration to where it says; no payload (netstorm/lan/redeploy.py)"))


LOADER_KINDS: Final = {"TIMER_INIT": 0x7F}
"""Kind numbers the XDP program's loader alone uses, never on the wire (bpf/xdp.py: TIMER_INIT initialises
the timer of the slot its frame names), reserved here so that no registered kind takes them."""
if set(LOADER_KINDS.values()) & {int(k) for k in Kind}:
    raise RuntimeError(f"a LAN kind takes a loader's reserved number {LOADER_KINDS}")


def kinds_where(*, payload: Payload | None = None, token: Token | None = None, checked: bool | None = None,
                handler: Party | None = None) -> frozenset[Kind]:
    """The registered kinds whose entry matches every criterion given."""
    return frozenset(k for k in Kind if (payload is None or k.spec.payload is payload)
                     and (token is None or k.spec.token is token)
                     and (checked is None or k.spec.checked is checked)
                     and (handler is None or handler in k.spec.handlers))


LANED_KINDS: Final = kinds_where(payload=Payload.LANES)
"""Kinds whose payload is lanes (ACK, QUERY and NACK: u32 sequence numbers)."""
GATEWAY_TOKENED: Final = kinds_where(token=Token.GATEWAY)
"""Kinds a worker takes only with the gateway's token (the others are dropped and counted as forged)."""
CHECKED_KINDS: Final = kinds_where(checked=True)
"""Workers' requests whose worker id and token the gateway checks."""
MAX_PAYLOAD: Final = {k: k.spec.max_payload for k in Kind if k.spec.payload is Payload.BYTES}
"""The payload limit of every kind whose payload is bytes."""
NAMES: Final = tuple(k.name for k in Kind)
"""The kinds' names in wire order (the header's field list and error messages)."""
