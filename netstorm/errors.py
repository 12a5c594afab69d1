"""The project's exception hierarchy: one base so callers can catch NetStorm failures as a whole."""

from __future__ import annotations


class NetStormError(Exception):
    """Base of every error NetStorm raises on purpose."""


class ConfigError(NetStormError):
    """A configuration value is missing, malformed or out of range."""


class ScenarioError(NetStormError):
    """A scenario file is malformed; the message names the file, the key or line, and the problem."""


class PolicyError(NetStormError):
    """A policy or its input (rates, roots, wire data) is malformed or cannot be planned."""


class LayoutError(NetStormError):
    """A tensor list cannot form a chunk layout, or two nodes derived different layouts."""


class FrameError(NetStormError):
    """A data-plane frame is malformed, oversized, of an unknown kind or version."""


class ChunkError(NetStormError):
    """A chunk contradicts the node's state: duplicate, wrong tree, wrong policy version or size."""


class IterationFailed(NetStormError):
    """An iteration cannot complete: a peer died, a chunk was invalid, or it ran past its timeout."""


class TrainerError(NetStormError):
    """A trainer's request failed; subclasses say why."""


class UnknownTensor(TrainerError):
    """The trainer named a tensor it did not register with init."""


class WrongShape(TrainerError):
    """A tensor's shape differs from the one registered."""


class WrongDtype(TrainerError):
    """A tensor's dtype differs from the one registered."""


class NodeGone(TrainerError):
    """The general node closed the connection or cannot be reached."""


class TrainerTimeout(TrainerError):
    """The node did not answer within the timeout (the message names the iteration)."""


class TrainerProtocolError(TrainerError):
    """The trainer and the node disagree about the protocol (bad message, bad state)."""


class IterationError(TrainerError):
    """The iteration failed at the node (invalid data from a peer, a policy that cannot hold)."""
