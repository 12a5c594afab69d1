"""What the LAN worker's core (netstorm/lan/sendercore.py) asks its shell to do, and how an iteration ends."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SendData:
    """DATA rows for where DATA goes: ``rows[index]`` (every row when ``index`` is None). ``first``: first
    transmissions, which the shell's loss and duplicate injection applies to."""

    rows: np.ndarray
    index: np.ndarray | None
    first: bool


@dataclass(frozen=True, slots=True)
class SendControl:
    """One control datagram (QUERY, PULL, REPORT) for the gateway, or with ``aggregator`` for where DATA
    goes (our HELLO again, for our cluster's aggregator)."""

    datagram: bytes
    aggregator: bool = False


@dataclass(frozen=True, slots=True)
class Done:
    """The iteration's result: each tensor's elements (float32) and how many workers they sum."""

    iteration: int
    result: list[np.ndarray]
    total: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The iteration cannot complete: EdgeTimeout, IterationAborted (the gateway said FAILED) or WireError."""

    error: Exception


@dataclass(frozen=True, slots=True)
class Moved:
    """DATA was refused for an old deployment epoch: say HELLO again and send the whole iteration anew."""

    epoch: int


Action = SendData | SendControl
Outcome = Done | Failed | Moved
