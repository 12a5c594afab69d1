"""The project's exception hierarchy: one base so callers can catch NetStorm failures as a whole.

Every class carries the ``ErrorCode`` that names it on a wire: a side that refuses a request sends the
code of what it raised, and the other side picks its own exception class by that code alone (never by
the words of the message, which are for people).
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ErrorCode(enum.StrEnum):
    """Why a request failed, as every wire carries it (a string, so frames stay readable in a dump)."""

    PROTOCOL = "protocol"
    """The request contradicts the protocol or the receiver's state (the catch-all of a refusal)."""
    MALFORMED = "malformed"
    """The message could not be decoded: bad bytes, an unknown type, version or field, a bad value."""
    UNKNOWN_TENSOR = "unknown_tensor"
    WRONG_SHAPE = "wrong_shape"
    WRONG_DTYPE = "wrong_dtype"
    LAYOUT_MISMATCH = "layout_mismatch"
    """Two nodes derived different tensor layouts."""
    ITERATION_FAILED = "iteration_failed"
    """An iteration cannot complete (invalid data from a peer, a policy that cannot hold)."""
    PEER_GONE = "peer_gone"
    """Older name of ``PEER_LOST`` (a peer died while the request needed it); still understood."""
    PEER_LOST = "peer_lost"
    """A peer DC the iteration needed was declared dead by the scheduler: that iteration is lost
    everywhere, the next one runs without it (retry)."""
    NODE_GONE = "node_gone"
    """This DC's own node is gone or unreachable: retrying through it is pointless."""
    TRAINER_LIMIT = "trainer_limit"
    """The node already serves as many trainers as it is configured for (``trainers``)."""
    MODEL_TOO_LARGE = "model_too_large"
    """An ``init`` whose model exceeds ``max_model_bytes`` or the shared memory free: refused before any
    allocation."""
    TOO_FAR_AHEAD = "too_far_ahead"
    """A push ran more than ``max_ahead`` iterations ahead of the trainer's oldest unpulled result."""
    NON_FINITE = "non_finite"
    """A pushed tensor holds NaN or Inf (``check_finite``): nothing of the push was counted."""
    TIMEOUT = "timeout"
    NOT_MEMBER = "not_member"
    """The sender is not (or not yet, or no longer) a member the request may act for."""
    NO_POLICY = "no_policy"
    """The policy asked for is not planned yet or no longer held."""
    INTERNAL = "internal"
    """The receiver hit a bug; the message carries its description."""
    AUTH = "auth"
    """The other side did not prove it belongs to the job (wrong or missing secret), or may not do this."""


class NetStormError(Exception):
    """Base of every error NetStorm raises on purpose."""

    code: ClassVar[ErrorCode] = ErrorCode.PROTOCOL
    """What this error is called on a wire."""


class ConfigError(NetStormError):
    """A configuration value is missing, malformed or out of range."""


class AuthError(NetStormError):
    """A connection's other side did not prove membership of the job and the identity it claims (wrong or
    missing secret, a replayed or forged handshake), or the handshake did not complete in time."""

    code: ClassVar[ErrorCode] = ErrorCode.AUTH


class ScenarioError(NetStormError):
    """A scenario file is malformed; the message names the file, the key or line, and the problem."""


class PolicyError(NetStormError):
    """A policy or its input (rates, roots, wire data) is malformed or cannot be planned."""


class LayoutError(NetStormError):
    """A tensor list cannot form a chunk layout, or two nodes derived different layouts."""

    code: ClassVar[ErrorCode] = ErrorCode.PROTOCOL


class FrameError(NetStormError):
    """A data-plane frame is malformed, oversized, of an unknown kind or version."""

    code: ClassVar[ErrorCode] = ErrorCode.MALFORMED


class ChunkError(NetStormError):
    """A chunk contradicts the node's state: duplicate, wrong tree, wrong policy version or size."""


class IterationFailed(NetStormError):
    """An iteration cannot complete: a peer died, a chunk was invalid, or it ran past its timeout."""

    code: ClassVar[ErrorCode] = ErrorCode.ITERATION_FAILED


class TrainerError(NetStormError):
    """A trainer's request failed; subclasses say why."""


class UnknownTensor(TrainerError, LayoutError):
    """The trainer named a tensor it did not register with init (raised by the trainer's client and by
    the node's layout alike: a LayoutError too, so the node treats it as any other layout problem)."""

    code: ClassVar[ErrorCode] = ErrorCode.UNKNOWN_TENSOR


class WrongShape(TrainerError):
    """A tensor's shape differs from the one registered."""

    code: ClassVar[ErrorCode] = ErrorCode.WRONG_SHAPE


class WrongDtype(TrainerError):
    """A tensor's dtype differs from the one registered."""

    code: ClassVar[ErrorCode] = ErrorCode.WRONG_DTYPE


class NodeGone(TrainerError):
    """This DC's own general node closed the connection or cannot be reached (not retryable through it);
    a peer DC lost is ``PeerLost``."""

    code: ClassVar[ErrorCode] = ErrorCode.NODE_GONE


class TrainerLimit(TrainerError):
    """An ``init`` beyond the trainers the node is configured for (``trainers``): refused at once, so a
    second trainer never adds its values to the DC's contribution unnoticed."""

    code: ClassVar[ErrorCode] = ErrorCode.TRAINER_LIMIT


class ModelTooLarge(TrainerError, LayoutError):
    """An ``init`` names a model larger than ``max_model_bytes`` or than the shared memory free; nothing
    was allocated for it."""

    code: ClassVar[ErrorCode] = ErrorCode.MODEL_TOO_LARGE


class LayoutMismatch(TrainerError, LayoutError):
    """A trainer's ``init`` names a model other than the job's (the layout a majority of its DCs agreed
    on, or the one its node already serves); the job goes on without this model."""

    code: ClassVar[ErrorCode] = ErrorCode.LAYOUT_MISMATCH


class TooFarAhead(TrainerError):
    """A push more than ``max_ahead`` iterations ahead of this trainer's oldest unpulled result: pull
    first. Nothing of the push was counted."""

    code: ClassVar[ErrorCode] = ErrorCode.TOO_FAR_AHEAD


class NonFinite(TrainerError):
    """A pushed tensor holds NaN or Inf (``check_finite``); the message names the DC and the tensor, and
    nothing of the push was counted."""

    code: ClassVar[ErrorCode] = ErrorCode.NON_FINITE


class TrainerAuthError(TrainerError, AuthError):
    """The node's trainer TCP endpoint requires the job secret and this client did not prove it (or the
    node did not prove it to this client)."""

    code: ClassVar[ErrorCode] = ErrorCode.AUTH


class TrainerTimeout(TrainerError):
    """The node did not answer within the timeout (the message names the iteration)."""

    code: ClassVar[ErrorCode] = ErrorCode.TIMEOUT


class TrainerProtocolError(TrainerError):
    """The trainer and the node disagree about the protocol (bad message, bad state)."""

    code: ClassVar[ErrorCode] = ErrorCode.PROTOCOL


class IterationError(TrainerError):
    """The iteration failed at the node (invalid data from a peer, a policy that cannot hold)."""

    code: ClassVar[ErrorCode] = ErrorCode.ITERATION_FAILED


class PeerLost(IterationError):
    """A peer DC died while the iteration needed it: the scheduler declared it dead, the iteration is
    lost at every DC, and the next one runs without it. Retryable (an ``IterationError`` too)."""

    code: ClassVar[ErrorCode] = ErrorCode.PEER_LOST


class DigestMismatch(NetStormError):
    """After an outer step the DCs' global parameters or outer-optimizer state are not bit-identical
    (DiLoCo's digest, compared at every sync): training would drift apart silently."""


class UnsupportedCollective(NetStormError, NotImplementedError):
    """A collective, or a reduce op of it, that the ``netstorm`` process-group backend cannot run as sums at
    the nodes (point-to-point send and recv, a subgroup that is no group of a partition of the job's ranks);
    the message names the collective and the op."""
