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
