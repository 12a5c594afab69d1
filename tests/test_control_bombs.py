"""Hostile control frames at real sizes: a 32 MiB msgpack array of empty arrays (and the same kind of
bomb nested inside fields) sent to a running scheduler, by an outsider and by an authenticated admin.

Each one gets a clear refusal on the sender's side, the scheduler's peak memory stays bounded (its
process high-water mark is reset before and read after), and its loop keeps serving: the registered
nodes stay alive and a policy request after the bombs is answered. Decoded untyped, the 32 MiB bomb is
33 million lists (gigabytes and tens of seconds of a blocked loop)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import socket
import struct
import time
import tracemalloc
from pathlib import Path

import msgpack
import pytest
import uvloop

from netstorm import auth, authconn, control
from netstorm.control import ControlError
from netstorm.errors import ErrorCode
from scheduler import admin
from tests.test_auth_planes import ADMIN, register
from tests.test_auth_planes import scheduler as secret_scheduler
from tests.test_scheduler_service import FAST, T, addr

MIB = 1024 * 1024
BOMB_ITEMS = 32 * MIB - 5


def array_bomb(items: int) -> bytes:
    """A msgpack array32 of ``items`` empty arrays: one byte each on the wire, ~60 bytes each decoded."""
    return b"\xdd" + struct.pack(">I", items) + b"\x90" * items


def in_field(prefix: dict[str, object], name: str, value: bytes) -> bytes:
    head = msgpack.packb(prefix)
    assert 0x80 <= head[0] <= 0x8E
    return bytes([head[0] + 1]) + head[1:] + msgpack.packb(name) + value


def frame(body: bytes) -> bytes:
    return control.LENGTH.pack(len(body)) + body


def _memory() -> tuple[int, int]:
    """(resident, high-water mark) of this process in bytes, from /proc."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set


def raw_exchange(where: tuple[str, int], data: bytes) -> tuple[bytes, float]:
    """Send ``data`` (without a handshake), then read until the scheduler closes: (reply, seconds)."""
    start = time.perf_counter()
    with socket.create_connection(where, timeout=T) as sock:
        with contextlib.suppress(OSError):  # the scheduler may refuse before it has read everything
            sock.sendall(data)
        chunks = []
        with contextlib.suppress(ConnectionResetError):
            while part := sock.recv(65536):
                chunks.append(part)
    return b"".join(chunks), time.perf_counter() - start


def reply_of(data: bytes) -> control.Message:
    (length,) = control.LENGTH.unpack_from(data)
    return control.decode(data[control.LENGTH.size:control.LENGTH.size + length])


BOMBS = {
    "32 MiB array of empty arrays": (array_bomb(BOMB_ITEMS), "exceeds the limit"),
    "7 MiB array of empty arrays": (array_bomb(7 * MIB), "is not a map"),
    "7 MiB of empty arrays in an unknown field": (
        in_field({"v": 1, "type": "heartbeat", "node_id": 1, "t": 0.0}, "junk", array_bomb(7 * MIB)),
        "unknown field"),
    "7 MiB of empty arrays as an override's rates": (
        in_field({"v": 1, "type": "policy_override"}, "rates", array_bomb(7 * MIB)), "length <= 1048576"),
    "a million empty arrays as an override's rates": (
        in_field({"v": 1, "type": "policy_override"}, "rates", array_bomb(1 << 20)), "rates[0]"),
    "7 MiB of empty arrays as the version": (
        in_field({"type": "heartbeat", "node_id": 1, "t": 0.0}, "v", array_bomb(7 * MIB)), "version '<a"),
    "7 MiB of empty arrays in a policy reply (a kind the scheduler never reads)": (
        in_field({"v": 1, "type": "policy_reply", "iteration": 0, "version": 0}, "policy",
                 b"\x81\xa1x" + array_bomb(7 * MIB)), "does not accept policy_reply"),
}


SCHEDULER = dataclasses.replace(FAST, heartbeat_timeout=5.0)
"""Nodes are declared dead after 5 s of silence (the default): the bombs must not stall the loop that
long; the untyped decode stalled it for tens of seconds. (A shorter bound fails on a loaded host.)"""


def test_control_bombs_are_refused_with_bounded_memory_and_the_job_goes_on() -> None:
    async def main() -> None:
        async with secret_scheduler(config=SCHEDULER) as service:
            clients = await asyncio.gather(*(register(service, n) for n in (1, 2, 3, 4)))
            lag = 0.0
            stop = asyncio.Event()

            async def ticker() -> None:  # the longest the loop went without running a 10 ms timer
                nonlocal lag
                while not stop.is_set():
                    before = time.perf_counter()
                    await asyncio.sleep(0.01)
                    lag = max(lag, time.perf_counter() - before - 0.01)

            ticking = asyncio.create_task(ticker())
            rows = []
            try:
                for what, (body, needle) in BOMBS.items():
                    data = frame(body)
                    rss, _ = _memory()
                    _reset_peak()
                    # An outsider: the scheduler holds a secret, so its refusal is the handshake's.
                    outsider, outsider_s = await asyncio.to_thread(raw_exchange, addr(service), data)
                    refused = reply_of(outsider)
                    assert isinstance(refused, control.Error) and refused.code is ErrorCode.AUTH
                    # An authenticated admin: past the handshake, the frame meets the control reader.
                    start = time.perf_counter()
                    reader, writer = await authconn.open_stream(*addr(service), ADMIN, plane=auth.Plane.CONTROL,
                                                                me=auth.ADMIN, timeout=T)
                    try:
                        writer.write(data)
                        answer = await asyncio.wait_for(control.read_message(reader), T)
                    finally:
                        writer.close()
                    admin_s = time.perf_counter() - start
                    assert isinstance(answer, control.Error) and answer.code is ErrorCode.MALFORMED, what
                    assert needle in answer.message, (what, answer.message)
                    _, peak = _memory()
                    rows.append((what, len(data), outsider_s, admin_s, (peak - rss) / MIB))
                    assert peak - rss < 3 * len(data) + 64 * MIB, f"{what}: peak grew {(peak - rss) / MIB:.0f} MiB"
                    status = await admin.request(addr(service), control.StatusRequest(), timeout=T, credentials=ADMIN)
                    assert isinstance(status, control.Status) and status.alive == (1, 2, 3, 4), what
                policies = await asyncio.gather(*(c.policy_for(0, timeout=T) for c in clients))
                assert len({p.version for p in policies}) == 1
                assert not any(c.lost for c in clients)
            finally:
                stop.set()
                await ticking
                for client in clients:
                    await client.close()
            for what, size, outsider_s, admin_s, grew in rows:
                print(f"{what}: {size} bytes, outsider refused in {outsider_s:.3f} s, admin in {admin_s:.3f} s, "
                      f"peak RSS +{grew:.0f} MiB")
            print(f"longest loop stall {lag * 1000:.1f} ms")
            assert lag < service.config.heartbeat_timeout
    uvloop.run(main())


@pytest.mark.parametrize("inbound", [control.ANY, control.TO_SCHEDULER], ids=["any", "to_scheduler"])
@pytest.mark.parametrize("body", [array_bomb(7 * MIB), BOMBS["7 MiB of empty arrays as the version"][0],
                                  BOMBS["a million empty arrays as an override's rates"][0]],
                         ids=["top level", "version", "rates"])
def test_a_refused_frame_is_never_decoded_untyped(inbound: control.Inbound, body: bytes) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(ControlError):
            control.decode(body, inbound)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 * MIB, f"refusing {len(body)} bytes allocated {peak} bytes"


def test_the_scheduler_reads_no_frame_beyond_its_largest_kind() -> None:
    assert control.TO_SCHEDULER.max_frame == control.PolicyOverride.MAX_BYTES < 32 * MIB
    assert control.ANY.max_frame == control.MAX_CONTROL_FRAME
    beat = control.Heartbeat(node_id=1, t=0.0)
    assert control.decode(control.encode(beat)[4:], control.TO_SCHEDULER) == beat
    with pytest.raises(ControlError, match="the scheduler does not accept member_down"):
        control.decode(control.encode(control.MemberDown(1, "x"))[4:], control.TO_SCHEDULER)


def test_no_wire_decodes_untrusted_bytes_untyped() -> None:
    """Every decode of received bytes names its type; the two untyped ones are a 64-byte envelope value
    (``schema._scalar``) and the scheduler's own state file."""
    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"msgspec\.(msgpack|json)\.decode\(|msgpack\.unpackb\(|msgspec\.msgpack\.Decoder\(\)")
    found = sorted(f"{path.relative_to(root)}" for package in ("netstorm", "node", "scheduler", "bpf")
                   for path in (root / package).rglob("*.py")
                   for line in path.read_text().splitlines() if pattern.search(line) and "type=" not in line)
    assert found == ["netstorm/schema.py", "scheduler/persistence.py"]
