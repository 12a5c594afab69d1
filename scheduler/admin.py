"""One-shot admin requests to a running scheduler: its status, its policies, its history, forcing a new
policy version.

``netstorm local`` waits on ``status`` for every node to register; tests and operators use
``override_policy`` to roll out a policy planned from given rates (a policy change between iterations);
the emulator follows a run with ``history`` (bindings and published versions) and ``status`` (each
gateway's LAN aggregation mode) while it goes, since the scheduler keeps a bounded window of each.
"""

from __future__ import annotations

import asyncio

from netstorm import auth, authconn, control
from netstorm.authconn import Credentials
from netstorm.control import ControlAuthError, ControlError, ControlTimeout
from netstorm.errors import AuthError, NetStormError
from netstorm.policy import Policy
from netstorm.scenario import Rates


async def request(address: tuple[str, int], message: control.Message, *, timeout: float,  # noqa: ASYNC109 (the contract's per-call deadline)
                  credentials: Credentials | None = None) -> control.Message:
    """Send one message on a fresh connection and return the answer (Error answers raise ControlError).

    With ``credentials`` the connection first proves it is the job's admin (a scheduler with a secret
    answers nothing else); a wrong or missing secret raises ``ControlAuthError``."""
    name = f"scheduler {control.format_address(address)}"
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await authconn.open_stream(*address, credentials, plane=auth.Plane.CONTROL,
                                                        me=auth.ADMIN, timeout=timeout)
            writer.write(control.encode(message))
            await writer.drain()
            reply = await control.read_message(reader)
    except TimeoutError:
        raise ControlTimeout(f"{name}: no answer to {message.TYPE} within {timeout} s") from None
    except AuthError as exc:
        raise ControlAuthError(f"{name}: {message.TYPE}: {exc}") from None
    except (OSError, ControlError) as exc:  # a refused connection, or a garbled or cut-off answer
        raise ControlError(f"{name}: {message.TYPE} failed: {exc}") from None
    finally:
        if writer is not None:
            writer.close()
    if reply is None:
        raise ControlError(f"{name} closed the connection without answering {message.TYPE}")
    if isinstance(reply, control.Error):
        raise control.refusal(reply, f"{name}: ")
    return reply


async def status(address: tuple[str, int], *, timeout: float,  # noqa: ASYNC109
                 credentials: Credentials | None = None) -> control.Status:
    reply = await request(address, control.StatusRequest(), timeout=timeout,
                          credentials=credentials)
    if not isinstance(reply, control.Status):
        raise ControlError(f"scheduler {control.format_address(address)} answered status with {reply.TYPE}")
    return reply


async def override_policy(address: tuple[str, int], rates: Rates, *, timeout: float,  # noqa: ASYNC109
                          credentials: Credentials | None = None) -> int:
    """Plan and publish a policy from ``rates`` now; returns its version (current for unbound iterations)."""
    reply = await request(address, control.PolicyOverride(rates), timeout=timeout,
                          credentials=credentials)
    if not isinstance(reply, control.PolicyOverrideAck):
        raise ControlError(f"scheduler {control.format_address(address)} answered an override with {reply.TYPE}")
    return reply.version


async def fetch_policy(address: tuple[str, int], version: int = -1, *, timeout: float,  # noqa: ASYNC109
                       credentials: Credentials | None = None) -> Policy:
    """Policy ``version`` (-1: the current one) as the scheduler holds it."""
    reply = await request(address, control.PolicyFetch(version), timeout=timeout,
                          credentials=credentials)
    if not isinstance(reply, control.PolicyReply) or reply.policy is None:
        raise ControlError(f"scheduler {control.format_address(address)} answered a policy fetch with {reply!r}")
    try:
        return Policy.from_wire(reply.policy)
    except NetStormError as exc:
        raise ControlError(f"scheduler {control.format_address(address)} sent a malformed policy: {exc}") from None


async def history(address: tuple[str, int], since_iteration: int = 0, since_version: int = 0, *,
                  timeout: float,  # noqa: ASYNC109 (the contract's per-call deadline)
                  credentials: Credentials | None = None) -> control.History:
    """One page of the bindings from ``since_iteration`` on and of the versions published from
    ``since_version`` on."""
    reply = await request(address, control.HistoryRequest(since_iteration, since_version), timeout=timeout,
                          credentials=credentials)
    if not isinstance(reply, control.History):
        raise ControlError(f"scheduler {control.format_address(address)} answered a history request with "
                           f"{reply.TYPE}")
    return reply
