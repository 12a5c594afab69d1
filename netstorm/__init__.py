"""NetStorm: geo-distributed parameter synchronization over multi-root fastest-aggregation-path trees.

The trainer-facing API (``connect``) is re-exported here once the runtime provides it.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
