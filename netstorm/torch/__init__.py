"""PyTorch integration: ``DistributedOptimizer`` sums gradients across DCs through the local node.

Requires the ``torch`` extra; ``import netstorm`` never imports this package (or torch).
"""

from __future__ import annotations

from netstorm.torch.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
