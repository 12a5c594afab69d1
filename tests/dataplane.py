"""Helpers for data-plane tests: in-process general nodes on loopback under a fixed policy.

The control plane here is deliberately simple (membership known up front, one policy per iteration
chosen by the test) so these tests exercise the data plane alone; the scheduler's own client is used by
the end-to-end tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping

from netstorm.authconn import Credentials
from netstorm.config import Config
from netstorm.control import LinkBeliefs
from netstorm.policy import Policy
from netstorm.probe import LinkReport
from node.service import GeneralNode


class FixedControl:
    """Membership and policies decided by the test; records link reports."""

    def __init__(self, node_id: int, members: Mapping[int, tuple[str, int]], config: Config,
                 policies: Callable[[int], Policy], workers: Mapping[int, int] | None = None) -> None:
        self.node_id = node_id
        self.members = dict(members)
        self.workers = {n: (workers or {}).get(n, 1) for n in members}
        self.config = config
        self._policies = policies
        self.reports: list[LinkReport] = []
        self.prefetched: list[int] = []
        self.layouts: list[str] = []
        self.unreachable: list[tuple[int, str]] = []
        """Peers this node reported it cannot reach (``PeerUnreachable``), and why."""
        self._down: list[Callable[[int, str], None]] = []
        self._beliefs: list[Callable[[LinkBeliefs], None]] = []

    async def check_layout(self, layout_hash: str, *, timeout: float) -> None:  # noqa: ASYNC109
        self.layouts.append(layout_hash)

    async def policy_for(self, iteration: int, *, timeout: float) -> Policy:  # noqa: ASYNC109
        return self._policies(iteration)

    def prefetch(self, iteration: int) -> None:
        self.prefetched.append(iteration)

    def report_link(self, report: LinkReport) -> None:
        self.reports.append(report)

    def on_member_down(self, cb: Callable[[int, str], None]) -> None:
        self._down.append(cb)

    def report_unreachable(self, peer: int, reason: str) -> None:
        self.unreachable.append((peer, reason))

    def declare_down(self, peer: int, reason: str) -> None:
        """What the scheduler does when it declares ``peer`` dead: ``MemberDown`` to every node."""
        for cb in self._down:
            cb(peer, reason)

    def on_beliefs(self, cb: Callable[[LinkBeliefs], None]) -> None:
        self._beliefs.append(cb)

    def push_beliefs(self, beliefs: LinkBeliefs) -> None:
        """What the scheduler pushes when it publishes a policy version."""
        for cb in self._beliefs:
            cb(beliefs)


async def until(check: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """Poll ``check`` until it holds (the state it reads has no event to wait on), failing after
    ``within`` seconds with ``what`` named."""
    try:
        async with asyncio.timeout(within):
            while True:
                if check():
                    return
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {within:g} s") from None


@contextlib.asynccontextmanager
async def cluster(ids: list[int], config: Config, policies: Callable[[int], Policy],
                  workers: Mapping[int, int] | None = None,
                  credentials: Credentials | Mapping[int, Credentials] | None = None
                  ) -> AsyncIterator[dict[int, GeneralNode]]:
    """Nodes ``ids`` serving on loopback, each running in this scope; stopped on exit. ``workers``: how
    many workers a node's contributions sum (1 unless given), as its Register says; ``credentials``: the
    job secret every node proves on its data connections (none by default), or each node's own."""
    own = credentials if isinstance(credentials, Mapping) else dict.fromkeys(ids, credentials)
    nodes = {i: GeneralNode(i, config, credentials=own[i]) for i in ids}
    members = {i: await n.serve_data("127.0.0.1", 0) for i, n in nodes.items()}
    async with asyncio.TaskGroup() as tg:
        for i, n in nodes.items():
            tg.create_task(n.run(FixedControl(i, members, config, policies, workers)))
        for n in nodes.values():
            await n.wait_ready()
        try:
            yield nodes
        finally:
            for n in nodes.values():
                n.stop()
