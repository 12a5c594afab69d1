"""An optimizer wrapper that synchronizes gradients across DCs before every step.

For a trainer that runs without a ``torch.distributed`` process group, one process per DC against its
node (DDP users take the ``netstorm`` backend or ``netstorm_hook`` instead). The layout is the model's
named parameters, registered once, and one ``push_pull`` per step carries them all, which is what
users of Horovod's or BytePS's ``DistributedOptimizer`` already write:

    kv = netstorm.connect()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), kv)
    loss.backward(); opt.step(); opt.zero_grad()

Gradients travel as float32 whatever the parameters' dtype or device; the buffers are allocated once
and shared with torch without copies on the CPU side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

try:
    import torch
except ImportError as exc:  # the torch extra is optional; say which one to install
    raise ImportError(f"netstorm.torch needs PyTorch (pip install 'netstorm[torch]'): {exc}") from exc


class KeyValueStore(Protocol):
    """The part of ``netstorm.connect()``'s client this wrapper uses."""

    @property
    def num_workers(self) -> int: ...

    def init(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def push_pull(self, tensors: dict[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]: ...

    def push(self, name: str, value: np.ndarray) -> None: ...

    def pull(self, name: str, average: bool = False) -> np.ndarray: ...


class DistributedOptimizer:
    """Wraps ``optimizer``: ``step()`` first replaces every gradient by its sum (or mean) over the workers.

    The constructor registers the parameters with the node (``kv.init``) and copies the values every
    DC agreed on into them, so all DCs start from the same model; a DC restarted into a running job gets
    the parameters the live DCs hold (``model`` is the trainer's model provider). Parameters without a gradient in a
    step contribute zeros. ``average=True`` (the default) divides by ``kv.num_workers``, the workers
    whose gradients each sum holds (every DC's trainer and its gateway's LAN workers; ``kv`` may be a LAN
    worker's edge client too): with equal batches per worker, that is the gradient of the mean loss over
    the union of the batches. LR schedulers
    take ``wrapper.optimizer``.

    ``overlap=True`` pushes each gradient to the node as soon as backward has accumulated it (as DDP
    overlaps its buckets' all-reduce with backward), so the WAN transfer of the last layers' gradients
    runs while the first layers' are still being computed; ``step()`` then pulls the sums. It needs
    exactly one backward per step (no gradient accumulation over micro-batches): a second gradient
    for a parameter before ``step()`` is an error.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                 kv: KeyValueStore, *, average: bool = True, overlap: bool = False) -> None:
        self.optimizer = optimizer
        self.kv = kv
        self.average = average
        self.overlap = overlap
        self._pushed: set[str] = set()
        self._params: dict[str, torch.nn.Parameter] = {}
        for name, param in named_parameters:
            if not param.requires_grad:
                continue
            if name in self._params:
                raise ValueError(f"parameter name {name!r} appears twice")
            if any(param is seen for seen in self._params.values()):
                raise ValueError(f"parameter {name!r} is registered under another name too")
            self._params[name] = param
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in self._params.items() if id(p) not in optimized]
        unnamed = optimized - {id(p) for p in self._params.values()}
        if missing or unnamed:
            raise ValueError(f"named_parameters and the optimizer's parameters differ: not optimized "
                             f"{missing[:5]}, {len(unnamed)} optimized parameters without a name")
        self._buffers = {name: np.empty(tuple(p.shape), dtype=np.float32) for name, p in self._params.items()}
        self._views = {name: torch.from_numpy(buf) for name, buf in self._buffers.items()}
        with torch.no_grad():
            for name, param in self._params.items():
                self._views[name].copy_(param.detach())
            agreed = kv.init(self._buffers)
            for name, param in self._params.items():
                param.copy_(torch.from_numpy(np.asarray(agreed[name])))
        set_provider = getattr(kv, "set_model_provider", None)
        if set_provider is not None:  # a DC admitted into the running job gets these parameters
            set_provider(self.model)
        self._hooks = [param.register_post_accumulate_grad_hook(self._push_hook(name))
                       for name, param in self._params.items()] if overlap else []

    def model(self) -> dict[str, np.ndarray]:
        """The parameters now, as float32 arrays: what this DC hands a DC admitted into the job."""
        with torch.no_grad():
            return {name: param.detach().to("cpu", torch.float32).numpy().copy()
                    for name, param in self._params.items()}

    def _push_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def push(param: torch.Tensor) -> None:
            if name in self._pushed:
                raise RuntimeError(f"parameter {name!r} got a second gradient before step(): with overlap=True "
                                   f"each step takes exactly one backward pass")
            grad = param.grad
            if grad is None:  # the hook runs after accumulation, so a gradient is there
                raise RuntimeError(f"parameter {name!r}: no gradient after accumulation")
            with torch.no_grad():
                self._views[name].copy_(grad)
            self.kv.push(name, self._buffers[name])
            self._pushed.add(name)

        return push

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def synchronize(self) -> None:
        """Replace every parameter's gradient by the sum (or mean) over the workers.

        One push_pull; with ``overlap``, the pushes backward has not made yet, then one pull per parameter.
        """
        with torch.no_grad():
            for name, param in self._params.items():
                if name in self._pushed:
                    continue
                if param.grad is None:
                    self._buffers[name].fill(0.0)
                else:
                    self._views[name].copy_(param.grad)
                if self.overlap:
                    self.kv.push(name, self._buffers[name])
            if self.overlap:
                self._pushed.clear()
                result = {name: self.kv.pull(name, average=self.average) for name in self._params}
            else:
                result = self.kv.push_pull(self._buffers, average=self.average)
            for name, param in self._params.items():
                total = torch.from_numpy(np.asarray(result[name]))
                if param.grad is None:
                    param.grad = torch.empty_like(param)
                param.grad.copy_(total)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize the gradients, then take the wrapped optimizer's step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
