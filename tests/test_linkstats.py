"""Kernel link counters: the TCP_INFO fields the node's per-iteration link log reads."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from node import linkstats


def test_parse_reads_the_chrono_fields_at_their_offsets() -> None:
    raw = bytearray(232)
    struct.pack_into("<Q", raw, 120, 123_456_789)  # bytes_acked
    struct.pack_into("<I", raw, 144, 4096)  # notsent_bytes
    struct.pack_into("<QQQ", raw, 168, 2_500_000, 250_000, 125_000)  # busy, rwnd- and sndbuf-limited (us)
    counters = linkstats.parse_tcp_info(bytes(raw))
    assert counters == linkstats.LinkCounters(123_456_789, 2.5, 0.25, 0.125, 4096)
    later = linkstats.LinkCounters(123_456_789 + 1000, 3.0, 0.25, 0.5, 0)
    assert later.minus(counters) == linkstats.LinkCounters(1000, 0.5, 0.0, 0.375, 0)
    with pytest.raises(ValueError, match="busy-time"):
        linkstats.parse_tcp_info(bytes(104))


def test_a_real_connection_counts_the_bytes_its_peer_acknowledged() -> None:
    size = 3_000_000
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        with client, peer:
            before = linkstats.read(client)
            assert before is not None

            def drain() -> None:
                got = 0
                while got < size:
                    got += len(peer.recv(1 << 20))

            reader = threading.Thread(target=drain)
            reader.start()
            client.sendall(b"\0" * size)
            reader.join(10)
            deadline = time.monotonic() + 10
            while True:
                now = linkstats.read(client)
                assert now is not None
                if now.acked_bytes - before.acked_bytes >= size or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert now.acked_bytes - before.acked_bytes == size
            assert now.busy_s >= before.busy_s
    assert linkstats.read(object()) is None


def _counters(busy_s: float, acked: int, notsent: int = 0) -> linkstats.LinkCounters:
    return linkstats.LinkCounters(acked_bytes=acked, busy_s=busy_s, notsent_bytes=notsent)


def test_the_rate_meter_counts_only_steps_the_link_was_fed() -> None:
    meter = linkstats.RateMeter(window_s=0.5, min_s=0.05)
    meter.sample(_counters(0.0, 0), waiting=True)
    assert meter.rate_bps is None
    meter.sample(_counters(0.1, 400_000), waiting=False)  # fed: 4 MB/s
    assert meter.rate_bps == pytest.approx(4e6)
    # The queue had run dry: this step includes waiting for the next chunk (a long round trip), not counted.
    meter.sample(_counters(0.3, 500_000), waiting=True)
    assert meter.rate_bps == pytest.approx(4e6)
    meter.sample(_counters(0.4, 600_000, notsent=9000), waiting=True)  # fed: 1 MB/s
    assert meter.rate_bps == pytest.approx(500_000 / 0.2)
    assert meter.unsent_bytes == 9000


def test_the_rate_meter_forgets_steps_older_than_its_window() -> None:
    meter = linkstats.RateMeter(window_s=0.5, min_s=0.05)
    busy, acked = 0.0, 0
    meter.sample(_counters(busy, acked), waiting=True)
    for _ in range(10):  # 1 s at 4 MB/s
        busy, acked = busy + 0.1, acked + 400_000
        meter.sample(_counters(busy, acked), waiting=True)
    for _ in range(5):  # the link drops to 0.5 MB/s: after 0.5 s of busy time only the new rate is left
        busy, acked = busy + 0.1, acked + 50_000
        meter.sample(_counters(busy, acked), waiting=True)
    assert meter.rate_bps == pytest.approx(500_000)


def test_the_rate_meter_ignores_a_step_without_busy_time_or_with_counters_going_back() -> None:
    meter = linkstats.RateMeter(window_s=0.5, min_s=0.05)
    meter.sample(_counters(1.0, 1_000_000), waiting=True)
    meter.sample(_counters(1.0, 1_100_000), waiting=True)  # the kernel's clock did not tick
    meter.sample(_counters(0.01, 10), waiting=True)  # a new connection starts from zero
    assert meter.rate_bps is None
    meter.sample(_counters(0.11, 200_010), waiting=True)
    assert meter.rate_bps == pytest.approx(2e6)
