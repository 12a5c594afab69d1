"""A bulk TCP transfer that measures a path's rate: the emulator's own check that shaping works.

``python -m netstorm.emulation.bulk serve HOST PORT`` accepts one connection and prints one JSON line:
payload bytes and seconds over the steady part of the transfer (after ``--warmup`` seconds), and the
wire rate that payload implies (Ethernet + IPv4 + TCP-with-timestamps headers per MSS-sized segment),
which is what HTB meters. ``send HOST PORT SECONDS`` streams zeros for that long.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

HEADER_BYTES = 14 + 20 + 32
"""Per segment on the wire: Ethernet, IPv4, TCP with the timestamp option."""


def serve(host: str, port: int, warmup_s: float, timeout_s: float) -> dict[str, float]:
    with socket.create_server((host, port)) as server:
        server.settimeout(timeout_s)
        print("LISTENING", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout_s)
            mss = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
            buf = bytearray(1 << 20)
            first = None
            start = None
            counted = 0
            last = 0.0
            while True:
                n = conn.recv_into(buf)
                now = time.monotonic()
                if n == 0:
                    break
                if first is None:
                    first = now
                if start is None:
                    if now - first >= warmup_s:
                        start = now
                    continue
                counted += n
                last = now
    if start is None or last <= start:
        raise SystemExit("transfer too short to measure: raise SECONDS or lower --warmup")
    seconds = last - start
    payload_mbit = counted * 8 / seconds / 1e6
    return {"bytes": counted, "seconds": seconds, "mss": mss, "payload_mbit": payload_mbit,
            "wire_mbit": payload_mbit * (mss + HEADER_BYTES) / mss}


def send(host: str, port: int, seconds: float, source: str | None) -> None:
    block = bytes(256 * 1024)
    with socket.create_connection((host, port), timeout=30, source_address=(source, 0) if source else None) as s:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            s.sendall(block)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netstorm.emulation.bulk", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    p_serve = sub.add_parser("serve")
    p_serve.add_argument("host")
    p_serve.add_argument("port", type=int)
    p_serve.add_argument("--warmup", type=float, default=0.5)
    p_serve.add_argument("--timeout", type=float, default=60.0)
    p_send = sub.add_parser("send")
    p_send.add_argument("host")
    p_send.add_argument("port", type=int)
    p_send.add_argument("seconds", type=float)
    p_send.add_argument("--source")
    args = parser.parse_args(argv)
    if args.mode == "serve":
        print(json.dumps(serve(args.host, args.port, args.warmup, args.timeout)), flush=True)
    else:
        send(args.host, args.port, args.seconds, args.source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
