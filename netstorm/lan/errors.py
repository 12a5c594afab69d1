"""Errors of the LAN edge tier, raised on both sides of the wire (worker and gateway)."""

from __future__ import annotations

from netstorm.errors import NetStormError


class WireError(NetStormError):
    """A datagram is not a valid edge packet; the message says which field is wrong."""


class EdgeTimeout(NetStormError):
    """A slot or an iteration did not complete in time; the message names the workers that were missing."""


class IntegerOverflow(WireError):
    """An iteration of exact integer lanes (a compressed job's round) summed outside int32: the aggregator
    flagged it, and re-quantising integers would break their exactness, so the iteration fails."""


class IterationAborted(NetStormError):
    """The gateway reports that an iteration failed (its node failed it: a LAN worker or a DC missing, a
    timeout, an overflow): no result will come, and the next iteration is the one after it."""


class StaleDeployment(WireError):
    """DATA carrying another LAN deployment epoch than the aggregator's (netstorm/lan/redeploy.py): refused,
    never summed; its sender (``worker``, at ``address`` when known) is told to say HELLO again."""

    def __init__(self, message: str, *, worker: int, iteration: int, epoch: int) -> None:
        super().__init__(message)
        self.worker = worker
        self.iteration = iteration
        self.epoch = epoch


class ServicesMissing(NetStormError):
    """A deployment names aggregators whose service (``netstorm lan-aggregator``) never said HELLO to the
    gateway: it is not switched to (its members could not be told where to send) and waits for them."""
