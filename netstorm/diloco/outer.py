"""The outer optimizer: a step on the global parameters of one fragment from the mean pseudo-gradient.

Every DC runs it on the same inputs in the same float32 operations, so the global parameters and the
optimizer's state stay bit-identical (``state.digest`` checks it). The default is DiLoCo's Nesterov SGD
(lr 0.7, momentum 0.9), with torch.optim.SGD's update (dampening 0): b = mu b + g, theta -= lr (g + mu b).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from netstorm.errors import ConfigError


@dataclasses.dataclass
class OuterSGD:
    """SGD on the flat global parameters; Nesterov momentum by default, plain SGD with momentum 0."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    buffer: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1:
            raise ConfigError(f"outer lr must be > 0 and momentum in [0, 1), got {self.lr}, {self.momentum}")

    def bind(self, size: int) -> None:
        """Room for the state of ``size`` parameters (zeros: no step taken yet)."""
        self.buffer = np.zeros(size if self.momentum else 0, np.float32)

    def state_arrays(self) -> list[np.ndarray]:
        """The optimizer's state, in a fixed order: what the digest covers and a joiner receives."""
        return [self.buffer]

    def load_state(self, arrays: list[np.ndarray]) -> None:
        (buffer,) = arrays
        if buffer.shape != self.buffer.shape:
            raise ConfigError(f"outer state of {buffer.size} elements, expected {self.buffer.size}")
        self.buffer[...] = buffer

    def step(self, params: np.ndarray, grad: np.ndarray, start: int, stop: int) -> None:
        """``params[start:stop] -= update(grad)``, in place, updating that slice's state."""
        lr = np.float32(self.lr)
        if not self.momentum:
            params[start:stop] -= lr * grad
            return
        mu = np.float32(self.momentum)
        buf = self.buffer[start:stop]
        buf *= mu
        buf += grad
        update = grad + mu * buf if self.nesterov else buf
        params[start:stop] -= lr * update
