"""What the node core (``node/core.py``) asks its asyncio shell to do: small frozen records, no I/O.

The core answers every event with a list of these; the shell carries them out in order. Frames are
named by a ``ticket``, the core's identity for a frame it sent, so the core can later ask for a queued
frame back (``MoveFrame``) and learns when it left (the shell's link-progress event names the ticket).
Completion and failure of iterations reuse the aggregation core's records (``KeyDone``,
``IterationDone``, ``IterationFailed`` with a ``Cause``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from netstorm.frames import ChunkHeader
from netstorm.probe import LinkReport
from node.chunks import Cause, IterationDone, IterationFailed, KeyDone

__all__ = ["Action", "AskPart", "AskPolicy", "Cause", "IterationDone", "IterationFailed", "KeyDone", "MoveFrame",
           "Prefetch", "Released", "ReportLink", "ReportLost", "ReportVacancy", "SendFrame"]


@dataclasses.dataclass(frozen=True)
class SendFrame:
    """Queue ``payload`` as ``header``'s hop on the link to node ``link`` (the link stamps t_send)."""

    link: int
    header: ChunkHeader
    payload: np.ndarray
    ticket: int


@dataclasses.dataclass(frozen=True)
class MoveFrame:
    """Take frame ``ticket`` back from link ``source``'s queue and queue it on link ``target`` as ``header``
    (an auxiliary path's first hop); it keeps its ticket."""

    ticket: int
    source: int
    target: int
    header: ChunkHeader


@dataclasses.dataclass(frozen=True)
class AskPolicy:
    """Ask the control plane for the policy of ``iteration``; answer with ``policy_received`` or
    ``policy_unavailable``."""

    iteration: int


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """Let the control plane bind ``iteration`` now, to its newest policy (the previous one completed)."""

    iteration: int


@dataclasses.dataclass(frozen=True)
class ReportLink:
    """A passive measurement of a link into this node, for the scheduler."""

    report: LinkReport


@dataclasses.dataclass(frozen=True)
class Released:
    """Every tensor of ``iteration`` was collected; ``result`` (flat float32, layout order) is the sum over
    ``workers`` workers. The core has forgotten the iteration; the array stays valid."""

    iteration: int
    result: np.ndarray
    workers: int


@dataclasses.dataclass(frozen=True)
class ReportLost:
    """Tell every member (through the control plane) that this DC's part of ``iteration`` will not come:
    the core failed it here because this DC's trainer place is empty."""

    iteration: int
    reason: str


@dataclasses.dataclass(frozen=True)
class ReportVacancy:
    """Tell every member that this DC's trainer place is empty from ``iteration`` on (``filled``: a
    replacement took it, this DC's part comes again from ``iteration`` on)."""

    iteration: int
    reason: str
    filled: bool = False


@dataclasses.dataclass(frozen=True)
class AskPart:
    """Ask member ``peer``, whose trainer place is empty, for its part of ``iteration``, under way here: it
    fails the iteration everywhere unless a replacement took its place."""

    peer: int
    iteration: int


Action = (SendFrame | MoveFrame | AskPolicy | Prefetch | ReportLink | KeyDone | IterationDone | IterationFailed
          | Released | ReportLost | ReportVacancy | AskPart)
