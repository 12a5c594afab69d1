"""The LAN gateway's core (netstorm/lan/gatewaycore.py) driven by plain calls: a stand-in for the kernel's
maps, HELLOs said as a worker would, and what the core queued to send, read back from its outbox."""

from __future__ import annotations

import os

import numpy as np

from netstorm.lan.gatewaycore import GatewayCore
from netstorm.lan.header import Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import control_packet
from netstorm.lan.slots import SlotEvent, slot_dtype
from netstorm.lan.tokens import LanTokens, Sender

Address = tuple[str, int]


class KernelMaps:
    """The XDP program's maps as the gateway core reads and writes them: slot states (set by the test),
    installed tokens and the horizon (recorded), no packet."""

    def __init__(self, layout: EdgeLayout) -> None:
        self.states = np.zeros(layout.num_slots, slot_dtype(56))
        self.tokens: dict[tuple[int, int], int] = {}
        self.horizon: int | None = None
        self.expected = 0
        self.epoch = 0
        self.events_fd, self._events_w = os.pipe()
        """A ring buffer that never reports (the shell reads it when it runs)."""

    def drain_events(self) -> list[SlotEvent]:
        return []

    def require_tokens(self, agg_token: int) -> None:
        self.agg_token = agg_token

    def install_tokens(self, entries: list[tuple[int, int, int]]) -> None:
        for worker, iteration, token in entries:
            self.tokens[worker, iteration] = token

    def bound(self, horizon: int | None) -> None:
        self.horizon = horizon

    def slot_states(self, indices: np.ndarray) -> np.ndarray:
        return self.states[np.asarray(indices, np.int64)]

    def redeploy(self, *, expected: int, epoch: int) -> None:
        self.expected, self.epoch = expected, epoch

    def stats(self) -> dict[str, int]:
        return {}


def hello(core: GatewayCore, worker: int, address: Address, *, secret: bytes | None, now: float = 0.0,
          nonce: int = 7) -> None:
    """``worker`` says HELLO from ``address``, with its token when the job has a secret."""
    tokens = LanTokens(secret, core.job)
    core.datagram(control_packet(Kind.HELLO, job=core.job, worker=worker, iteration=nonce,
                                 token=tokens.of(Sender.WORKER, worker, nonce, keep=False)), address, now)


def sent(core: GatewayCore, now: float = 0.0) -> list[tuple[bytes, Address]]:
    """Every datagram the core queued, in the order its writer would send them (one per datagram)."""
    out = []
    while (batch := core.outbox.next(now)) is not None:
        data = bytes(batch.data)
        out += [(data[i * batch.size: (i + 1) * batch.size], batch.address) for i in range(batch.count)]
        core.outbox.done(batch, now)
    return out
