"""A node that stops says why in the errors of what it cut short, and names the members already gone."""

from __future__ import annotations

import asyncio

import pytest

from netstorm.config import Config
from netstorm.errors import NetStormError
from netstorm.policy import Policy
from node.service import GeneralNode
from tests.dataplane import FixedControl


class SilentControl(FixedControl):
    """A control plane that never answers a policy request (the scheduler is slow or going away)."""

    async def policy_for(self, iteration: int, *, timeout: float) -> Policy:  # noqa: ASYNC109
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def no_policy(iteration: int) -> Policy:
    raise AssertionError(f"iteration {iteration} needs no policy here")


@pytest.mark.parametrize("fetch_started", [True, False])
def test_a_policy_wait_cut_short_by_a_stop_names_the_stop_and_the_dead_member(fetch_started: bool) -> None:
    async def main() -> str:
        config = Config(connect_timeout=5.0)
        node = GeneralNode(1, config)
        await node.serve_data("127.0.0.1", 0)
        # node 2's address is never dialled successfully: it is about to be declared dead anyway
        control = SilentControl(1, {1: ("127.0.0.1", 1), 2: ("127.0.0.1", 9)}, config, no_policy)
        running = asyncio.create_task(node.run(control))
        await node.wait_ready()
        waiting = asyncio.create_task(node.ensure_policy(0))
        if fetch_started:
            for _ in range(2):  # ensure_policy asks, then the fetch task awaits the control plane
                await asyncio.sleep(0)
        # else: the fetch task is created after the stop, and cancelled before its first step
        control.declare_down(2, "no heartbeat for 5.0 s")
        node.stop("SIGTERM received")
        node.stop("a later, consequential reason")  # the first reason wins
        async with asyncio.timeout(10):
            await running  # the stop cancels the fetch, started or not
        with pytest.raises(NetStormError) as caught:
            async with asyncio.timeout(10):
                await waiting
        return str(caught.value)

    message = asyncio.run(main())
    assert message.startswith("node 1 stopped (SIGTERM received) before the policy of iteration 0 arrived"), message
    assert "node 2 is gone: no heartbeat for 5.0 s" in message, message
    assert "consequential" not in message
