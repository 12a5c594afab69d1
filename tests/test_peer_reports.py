"""Only the scheduler declares a member dead: a node's ``PeerUnreachable`` is evidence it weighs.

Over real loopback TCP in one process: a report about a peer the scheduler still hears from changes no
membership and sends no ``MemberDown``; a report that names another reporter is ignored.
"""

from __future__ import annotations

import asyncio

import pytest

from netstorm import control
from tests.test_scheduler_service import addr, close_all, connect_all, run, scheduler, until


def test_a_report_of_a_peer_the_scheduler_still_hears_declares_nobody_dead(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with scheduler() as service:
            clients = await connect_all(service)
            downs: list[int] = []
            for client in clients:
                client.on_member_down(lambda node, reason: downs.append(node))
            try:
                clients[0].report_unreachable(2, "connection to node 2 closed")
                await until(lambda: "node 1 cannot reach node 2" in caplog.text, "the report handled")
                assert "the scheduler still hears from it" in caplog.text
                # A forged report, for a node this connection is not: ignored.
                _reader, writer = await asyncio.open_connection(*addr(service))
                writer.write(control.encode(control.PeerUnreachable(3, 4, "forged")))
                await until(lambda: "report on node 4 from an unregistered connection" in caplog.text, "the forgery")
                writer.close()
                await clients[1].policy_for(0, timeout=5.0)  # a round trip: the scheduler is serving
                assert service.membership.alive == (1, 2, 3, 4) and downs == []
                await clients[1].close()  # node 2 really goes: the scheduler's own evidence
                await until(lambda: 2 in downs, "node 2 declared dead")
                assert service.membership.alive == (1, 3, 4)
            finally:
                await close_all(clients)

    with caplog.at_level("INFO", logger="scheduler.service"):
        run(main())
