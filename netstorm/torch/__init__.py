"""PyTorch integration: the ``netstorm`` process-group backend, a DDP comm hook, ``DistributedOptimizer``.

``import netstorm.torch`` registers the backend, so ``dist.init_process_group("netstorm")`` (under
torchrun, Slurm or a Kubernetes PyTorchJob) makes DDP synchronize through the DC's general node;
``compressed_hook`` sends DDP's gradient buckets through the job's compression (FediAC, top-k, fp16);
``netstorm_hook`` keeps gloo or NCCL inside a DC and uses NetStorm only across DCs; the optimizer
wrapper serves one trainer per DC without a process group. Requires the ``torch`` extra;
``import netstorm`` never imports this package (or torch).
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # the torch extra is optional; say which one to install
    raise ImportError(f"netstorm.torch needs PyTorch (pip install 'netstorm[torch]'): {exc}") from exc

from netstorm.torch.backend import (
    BACKEND,
    Boundary,
    NetStormBackendError,
    ProcessGroupNetStorm,
    compressed_hook,
    mean_hook,
    register,
    stats,
    step_boundary,
)
from netstorm.torch.hook import NetStormHookState, netstorm_hook
from netstorm.torch.optimizer import DistributedOptimizer

register()

__all__ = ["BACKEND", "Boundary", "DistributedOptimizer", "NetStormBackendError", "NetStormHookState",
           "ProcessGroupNetStorm", "compressed_hook", "mean_hook", "netstorm_hook", "register", "stats",
           "step_boundary"]
