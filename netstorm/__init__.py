"""NetStorm: geo-distributed parameter synchronization over multi-root fastest-aggregation-path trees.

Trainers use ``netstorm.connect()`` (blocking) or ``await netstorm.aconnect()`` (asyncio) to reach the
general node of their data center.
"""

from __future__ import annotations

from netstorm.aclient import AsyncClient, aconnect
from netstorm.client import Client, connect

__version__ = "0.1.0"

__all__ = ["AsyncClient", "Client", "__version__", "aconnect", "connect"]
