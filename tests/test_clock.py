"""SNTP server wire format, and skew removal against the real server on loopback."""

from __future__ import annotations

import asyncio
import socket
import time

import ntplib
import pytest

from netstorm.clock import Clock, ClockSyncError, from_ntp, serve_sntp, sntp_reply, to_ntp
from netstorm.errors import ConfigError


def test_ntp_timestamps_round_trip():
    t = 1_790_000_000.123456
    assert from_ntp(to_ntp(t)) == pytest.approx(t, abs=1e-9)
    # RFC 4330 worked value: the Unix epoch is NTP second 2208988800.
    assert to_ntp(0.0) == 2_208_988_800 << 32


def test_reply_to_an_ntplib_request():
    request = ntplib.NTPPacket(version=4, mode=3, tx_timestamp=ntplib.system_to_ntp_time(1000.25)).to_data()
    reply = sntp_reply(request, received=2000.5, clock=lambda: 2000.75)
    assert reply is not None
    stats = ntplib.NTPStats()
    stats.from_data(reply)
    assert (stats.mode, stats.version, stats.stratum) == (4, 4, 1)
    assert stats.orig_timestamp == pytest.approx(ntplib.system_to_ntp_time(1000.25), abs=1e-6)
    assert stats.recv_time == pytest.approx(2000.5, abs=1e-6)
    assert stats.tx_time == pytest.approx(2000.75, abs=1e-6)


@pytest.mark.parametrize("packet", [b"", b"\x1b" * 10,
                                    ntplib.NTPPacket(version=4, mode=4).to_data(),  # a server reply
                                    ntplib.NTPPacket(version=4, mode=5).to_data(),  # broadcast
                                    bytes([(7 << 3) | 3]) + bytes(47)])             # version 7
def test_non_client_packets_are_ignored(packet):
    assert sntp_reply(packet, 1.0, time.time) is None


async def _server(clock):
    transport = await serve_sntp("127.0.0.1", 0, clock)
    return transport, transport.get_extra_info("sockname")[1]


@pytest.mark.parametrize(("node_skew", "server_skew"), [(0.35, 0.0), (-0.6, 0.2), (0.0, -0.45)])
def test_sync_removes_skew_of_hundreds_of_ms(node_skew, server_skew):
    async def main():
        server_clock = Clock(server_skew)
        transport, port = await _server(server_clock.local)
        try:
            node = Clock(node_skew)
            assert abs(node.now() - server_clock.local()) > 0.1  # wrong before sync
            offset = await node.sync("127.0.0.1", port, timeout=5.0)
            assert offset == pytest.approx(server_skew - node_skew, abs=0.005)
            assert abs(node.now() - server_clock.local()) < 0.005
            assert node.delay is not None and 0 <= node.delay < 0.1
        finally:
            transport.close()

    asyncio.run(main())


def test_server_ignores_garbage_and_keeps_answering():
    async def main():
        transport, port = await _server(time.time)
        protocol = transport.get_protocol()
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(b"not ntp", ("127.0.0.1", port))
            node = Clock(0.3)
            await node.sync("127.0.0.1", port, timeout=5.0, samples=2)
            assert abs(node.now() - time.time()) < 0.005
            assert protocol.ignored == 1 and protocol.answered == 2
        finally:
            transport.close()

    asyncio.run(main())


def test_sync_without_a_server_fails_naming_it_and_keeps_the_old_offset():
    async def main():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))  # a bound port that never answers
            port = s.getsockname()[1]
            node = Clock(0.2)
            node.offset = -0.1
            t0 = time.monotonic()
            with pytest.raises(ClockSyncError, match=f"127.0.0.1:{port}"):
                await node.sync("127.0.0.1", port, timeout=0.4, samples=2)
            assert time.monotonic() - t0 < 2.0
            assert node.offset == -0.1

    asyncio.run(main())


def test_skew_from_environment():
    assert Clock.from_env({}).skew == 0.0
    assert Clock.from_env({"NETSTORM_CLOCK_SKEW": "-0.25"}).skew == -0.25
    for bad in ("soon", "nan"):
        with pytest.raises(ConfigError, match="NETSTORM_CLOCK_SKEW"):
            Clock.from_env({"NETSTORM_CLOCK_SKEW": bad})
