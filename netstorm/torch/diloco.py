"""DiLoCo and Streaming DiLoCo for a PyTorch model: inner steps in the DC, outer syncs over NetStorm.

    kv = netstorm.connect()
    inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    dl = DiLoCo(model, inner, outer, kv, sync_every=100, fragments=4, fragment_delay=5,
                outer_compression="int4", error_feedback=True)
    for batch in data:
        loss(model, batch).backward()
        dl.step()                    # the inner step, then this DC's part of the schedule
        inner.zero_grad()

``model`` may be plain, DDP inside the DC, or FSDP; the outer optimizer must be SGD (or ``OuterSGD``) so
every DC's state stays bit-identical (docs/ARCHITECTURE.md, *PyTorch: DiLoCo*).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # the torch extra is optional; say which one to install
    raise ImportError(f"netstorm.torch needs PyTorch (pip install 'netstorm[torch]'): {exc}") from exc

from netstorm.diloco.codec import Method
from netstorm.diloco.outer import OuterSGD
from netstorm.diloco.sync import DiLoCo as FlatDiLoCo
from netstorm.diloco.sync import SyncClient, SyncRecord
from netstorm.errors import ConfigError


def outer_of(optimizer: Any) -> OuterSGD:
    """The library's outer step for ``optimizer`` (torch.optim.SGD or OuterSGD; None: DiLoCo's default)."""
    if optimizer is None:
        return OuterSGD()
    if isinstance(optimizer, OuterSGD):
        return optimizer
    if type(optimizer) is torch.optim.SGD:
        group = optimizer.param_groups[0]
        if group.get("dampening", 0) or group.get("weight_decay", 0) or group.get("maximize", False):
            raise ConfigError("the outer SGD must have dampening, weight_decay and maximize off")
        return OuterSGD(float(group["lr"]), float(group["momentum"]), bool(group["nesterov"]))
    raise ConfigError(f"outer optimizer {type(optimizer).__name__} is not supported: every DC must hold its state "
                      f"bit for bit and hand it to a rejoining DC, which netstorm.diloco.outer does for SGD "
                      f"(Nesterov or not)")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _is_fsdp(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(model, FullyShardedDataParallel)


class DiLoCo:
    """One DC's DiLoCo for ``model``; ``step()`` replaces ``inner_optimizer.step()``."""

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, outer_optimizer: Any = None,
                 kv: SyncClient | None = None, *, sync_every: int, fragments: int = 1, fragment_delay: int = 0,
                 outer_compression: Method = "none", error_feedback: bool = False, merge_alpha: float = 0.0,
                 straggler_s: float | None = None, seed: int = 0, rejoin: bool = True) -> None:
        if kv is None:
            import netstorm
            kv = netstorm.connect()
        self.model = model
        self.inner = inner_optimizer
        self.fsdp = _is_fsdp(model)
        with self._full_params():
            named = [(n, p) for n, p in _unwrap(model).named_parameters()]
            for name, p in named:
                if p.dtype != torch.float32 or p.device.type != "cpu":
                    raise ConfigError(f"parameter {name!r} is {p.dtype} on {p.device}: DiLoCo keeps float32 CPU "
                                      f"parameters (copy a GPU model's to the CPU for the outer step)")
            values = {n: p.detach().numpy().copy() for n, p in named}
            self.sync = FlatDiLoCo(kv, values, sync_every=sync_every, fragments=fragments,
                                   fragment_delay=fragment_delay, outer=outer_of(outer_optimizer),
                                   outer_compression=outer_compression, error_feedback=error_feedback,
                                   merge_alpha=merge_alpha, straggler_s=straggler_s, seed=seed, rejoin=rejoin)
            self.params = [p for _, p in named]
            self.flat = torch.from_numpy(self.sync.local)
            if self.fsdp:
                self._write_back()
            else:  # the parameters become views of the flat buffer: the inner steps train it in place
                with torch.no_grad():
                    for (_name, p), view in zip(named, self.sync.params.values(), strict=True):
                        p.data = torch.from_numpy(view)

    @contextlib.contextmanager
    def _full_params(self) -> Iterator[None]:
        if self.fsdp:
            from torch.distributed.fsdp import FullyShardedDataParallel
            with FullyShardedDataParallel.summon_full_params(self.model, writeback=True):
                yield
        else:
            yield

    def _write_back(self) -> None:
        with torch.no_grad():
            for p, view in zip(self.params, self.sync.params.values(), strict=True):
                p.copy_(torch.from_numpy(view))

    def step(self) -> SyncRecord | None:
        """The inner optimizer's step, then this step's fragment send or merge (as the schedule says)."""
        self.inner.step()
        if not self.fsdp:
            return self.sync.step()
        with self._full_params():
            named = list(_unwrap(self.model).parameters())
            for p, view in zip(named, self.sync.params.values(), strict=True):
                np.copyto(view, p.detach().numpy())
            record = self.sync.step()
            self.params = named
            self._write_back()
        return record

    @property
    def records(self) -> list[SyncRecord]:
        return self.sync.records

    def digest(self) -> bytes:
        return self.sync.digest()

    def close(self) -> None:
        self.sync.close()
