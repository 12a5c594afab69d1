"""NetStorm: geo-distributed parameter synchronization over multi-root fastest-aggregation-path trees.

Trainers use ``netstorm.connect()`` (blocking) or ``await netstorm.aconnect()`` (asyncio) to reach the
general node of their data center; LAN workers behind a DC gateway use ``netstorm.connect_edge()`` /
``await netstorm.aconnect_edge()`` (edge mode: the same verbs over UDP to the gateway).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from netstorm.aclient import AsyncClient, aconnect
from netstorm.client import Client, connect


def connect_edge(address: str, *, timeout: float = 300.0, secret: bytes | None = None) -> EdgeClient:
    """Edge mode: a LAN worker's client of its DC gateway, ``edge://GATEWAY:PORT?worker=I``; ``secret`` is
    the job secret when the job has one (its datagrams are then authenticated both ways)."""
    from netstorm.lan.client import connect_edge as make

    return make(address, timeout=timeout, secret=secret)


async def aconnect_edge(address: str, *, timeout: float = 300.0,  # noqa: ASYNC109
                        secret: bytes | None = None) -> AsyncEdgeClient:
    """Edge mode, asyncio."""
    from netstorm.lan.client import aconnect_edge as make

    return await make(address, timeout=timeout, secret=secret)


if TYPE_CHECKING:
    from netstorm.lan.client import AsyncEdgeClient, EdgeClient

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "__version__", "aconnect", "aconnect_edge", "connect", "connect_edge"]
