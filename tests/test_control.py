"""Control messages: every type survives a wire round trip; anything unknown or malformed is refused."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from netstorm import control
from netstorm.control import (
    ControlError,
    EdgeReport,
    Error,
    Heartbeat,
    History,
    HistoryRequest,
    LayoutAck,
    LayoutCheck,
    Leave,
    LinkBeliefs,
    LinkReport,
    MemberDown,
    PeerUnreachable,
    PolicyFetch,
    PolicyOverride,
    PolicyOverrideAck,
    PolicyRecord,
    PolicyReply,
    PolicyRequest,
    Register,
    RegisterAck,
    Status,
    StatusRequest,
    decode,
    encode,
)

SAMPLES: list[control.Message] = [
    Register(node_id=3, data_host="127.0.0.1", data_port=40003),
    Register(node_id=3, data_host="127.0.0.1", data_port=40003, workers=5),
    RegisterAck(members={1: ("127.0.0.1", 4001), 2: ("10.0.0.2", 4002)}, config={"chunk_size": 7},
                scheduler_time=1234.5),
    RegisterAck(members={1: ("127.0.0.1", 4001), 2: ("10.0.0.2", 4002)}, config={}, scheduler_time=1.0,
                workers={2: 3}),
    LayoutCheck(node_id=2, layout_hash="ab12"),
    LayoutAck(),
    Heartbeat(node_id=1, t=99.25),
    Leave(node_id=2, reason="stopped"),
    MemberDown(node_id=4, reason="no heartbeat for 5.0 s"),
    control.IterationLost(node_id=2, iteration=7, reason="its trainer closed or died before pushing its part"),
    control.Vacancy(node_id=2, iteration=8, reason="its trainer closed or died"),
    control.Vacancy(node_id=2, iteration=9, filled=True),
    control.PartWanted(node_id=3, peer=2, iteration=8),
    LayoutAck(pending=True),
    PeerUnreachable(node_id=2, peer=4, reason="connection to node 4 closed"),
    control.MemberUp(node_id=4, data_host="10.0.0.4", data_port=7001, workers=2),
    LayoutAck(first_iteration=12),
    control.PolicyReply(iteration=12, version=3, policy=None, joining=(4,)),
    control.Register(node_id=4, data_host="10.0.0.4", data_port=7001, attach=True),
    LinkBeliefs(version=4, rates={(1, 2): 10.0, (2, 1): 20.5}),
    LinkBeliefs(version=5, rates={(1, 2): 10.0}, amends=3,
                offload={(2, 1): (((2, 3, 1), 0.25), ((2, 4, 3, 1), 0.5)), (1, 3): (((1, 2, 3), 1.0),)}),
    PolicyRequest(node_id=1, iteration=17, known_version=-1),
    PolicyReply(iteration=17, version=2, policy={"wire": 1, "version": 2, "topology": "fapt", "roots": [1],
                                                 "trees": {"1": {"1": None, "2": 1}}, "chunk_share": {"1": 1.0},
                                                 "quality": {"1": 1.0, "2": 1.0}, "aux_paths": {}}),
    PolicyReply(iteration=18, version=2, policy=None),
    LinkReport(src=1, dst=2, mbit_s=37.5, t=10.0, samples=4),
    LinkReport(src=1, dst=2, mbit_s=3.5, t=11.0, samples=4, warm=False),
    Error(message="unknown node 12"),
    PolicyOverride(rates={(1, 2): 10.0, (2, 1): 20.5}),
    PolicyOverrideAck(version=5),
    StatusRequest(),
    Status(expected=(1, 2, 3), registered=(1, 3), alive=(1, 3), complete=False, version=-1),
    Status(expected=(1, 2), registered=(1, 2), alive=(2,), complete=True, version=3, bindings=((7, 2), (8, 3))),
    Status(expected=(1, 2), registered=(1, 2), alive=(1, 2), complete=True, version=0,
           probed=((1, 2, 41.5, ""), (2, 1, -1.0, "probe to 10.0.0.1:9 failed: refused")), probe_s=3.25),
    PolicyFetch(version=-1),
    Status(expected=(1, 2), registered=(1, 2), alive=(1, 2), complete=True, version=0,
           edge={2: ("userspace", "cannot load: EPERM"), 1: ("xdp (native)", "")}),
    EdgeReport(node_id=2, mode="xdp (generic)"),
    EdgeReport(node_id=2, mode="userspace", fallback="cannot load: bpf_prog_load EPERM"),
    HistoryRequest(since_iteration=12, since_version=3),
    History(bindings=((0, 0), (1, 0), (2, 1)),
            policies=(PolicyRecord(0, "first plan", (1,), ((1, 2, 1), (1, 3, 2))),
                      PolicyRecord(1, "node down", (2, 1), ()))),
    control.LanReport(node_id=2, gateway_gbit=10.0,
                      workers=(control.LanWorkerRow(0, 2.0, 2.0),
                               control.LanWorkerRow(1, 0.5, 1.0, 0.1, "int8", 3, 4.0)),
                      racks=(control.LanRackRow(3, 8.0, 4.0, (("int8", 2.0),)),), measured=True, t=5.0),
    control.LanPlan(node_id=2, version=0, planner="aleph", clusters=((0, (1,)),), direct=(0,),
                    rates=((0, 1.5), (1, 1.5)), predicted_gbit=3.0),
    control.Register(node_id=2, data_host="10.0.0.2", data_port=7002, probe_port=7102),
    control.ProbeRequest(targets=((1, "10.0.0.1", 7101), (3, "10.0.0.3", 7103)), nbytes=4 << 20, timeout_s=30.0,
                         heartbeat_s=1.0),
    control.ProbeResult(node_id=2, rows=((1, 812.5, ""), (3, -1.0, "probe to 10.0.0.3:7103 failed: refused"))),
]


def body(frame: bytes) -> bytes:
    (length,) = control.LENGTH.unpack_from(frame)
    assert len(frame) == control.LENGTH.size + length
    return frame[control.LENGTH.size:]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.TYPE)
def test_round_trip(message: control.Message) -> None:
    assert decode(body(encode(message))) == message


def test_every_type_has_a_sample() -> None:
    assert {m.TYPE for m in SAMPLES} == set(control.MESSAGES)


def test_a_probe_request_is_bounded_before_a_node_acts_on_it() -> None:
    request = control.ProbeRequest(targets=(), nbytes=2, timeout_s=1.0, heartbeat_s=1.0)
    for bad in ({"nbytes": 1}, {"nbytes": control.PROBE_MAX_BYTES + 1}, {"timeout_s": 0.0}, {"heartbeat_s": -1.0}):
        raw = msgpack.unpackb(body(encode(request)))
        with pytest.raises(control.ControlError, match="probe_request"):
            decode(msgpack.packb({**raw, **bad}))
    with pytest.raises(control.ControlError, match="does not accept probe_request"):
        decode(body(encode(request)), control.TO_SCHEDULER)


def test_frame_layout_is_length_prefixed_msgpack_with_version_and_type() -> None:
    frame = encode(Heartbeat(node_id=5, t=1.5))
    data = msgpack.unpackb(body(frame))
    assert data == {"v": 1, "type": "heartbeat", "node_id": 5, "t": 1.5}


def raw(data: object) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"v": 2, "type": "heartbeat", "node_id": 1, "t": 0.0}, "version 2"),
        ({"type": "heartbeat", "node_id": 1, "t": 0.0}, "version None"),
        ({"v": 1, "type": "launch_missiles"}, "unknown control message type 'launch_missiles'"),
        ({"v": 1, "type": "heartbeat", "node_id": 1}, "heartbeat: Object missing required field `t`"),
        ({"v": 1, "type": "heartbeat", "node_id": 1, "t": 0.0, "x": 1}, "heartbeat: Object contains unknown field `x`"),
        ({"v": 1, "type": "heartbeat", "node_id": "1", "t": 0.0},
         "heartbeat: Expected `int`, got `str` - at `$.node_id`"),
        ({"v": 1, "type": "heartbeat", "node_id": True, "t": 0.0}, "Expected `int`, got `bool` - at `$.node_id`"),
        ({"v": 1, "type": "register", "node_id": 1, "data_host": "h", "data_port": 70000},
         "Expected `int` <= 65535 - at `$.data_port`"),
        ({"v": 1, "type": "register_ack", "members": [[1, "h"]], "config": {}, "scheduler_time": 0},
         "Expected `array` of length 3, got 2 - at `$.members[0]`"),
        ({"v": 1, "type": "register_ack", "members": [[1, "h", 5], [1, "h", 6]], "config": {},
          "scheduler_time": 0}, "listed twice"),
        ({"v": 1, "type": "register", "node_id": 1, "data_host": "h", "data_port": 7, "workers": 0},
         "register.workers: a DC contributes at least its own trainer (1 worker), got 0"),
        ({"v": 1, "type": "register", "node_id": 1, "data_host": "h", "data_port": 7, "workers": 2.0},
         "register: Expected `int`, got `float` - at `$.workers`"),
        ({"v": 1, "type": "register_ack", "members": [[1, "h", 5]], "config": {}, "scheduler_time": 0,
          "workers": [[1, -2]]}, "register_ack.workers[1]: a DC contributes at least its own trainer"),
        ({"v": 1, "type": "register_ack", "members": [[1, "h", 5]], "config": {}, "scheduler_time": 0,
          "workers": [[1, 2], [1, 3]]}, "node 1 listed twice"),
        ({"v": 1, "type": "register_ack", "members": [[1, "h", 5]], "config": {}, "scheduler_time": 0,
          "workers": [[4, 2]]}, "node(s) [4] are not members"),
        ({"v": 1, "type": "register_ack", "members": [[1, "h", 5]], "config": {}, "scheduler_time": 0,
          "workers": {"1": 2}}, "Expected `array`, got `object` - at `$.workers`"),
        ({"v": 1, "type": "policy_reply", "iteration": 1, "version": 1, "policy": [1]},
         "Expected `object | null`, got `array` - at `$.policy`"),
        ({"v": 1, "type": "policy_override", "rates": [[1, 2, -3.0]]}, "must be positive"),
        ({"v": 1, "type": "policy_override", "rates": [[1, 2, float("inf")]]},
         "Expected `float` <= 1.7976931348623157e+308 - at `$.rates[0][2]`"),
        ({"v": 1, "type": "link_beliefs", "version": 2, "rates": [], "amends": 1,
          "offload": [[2, 1, [2, 1], 0.5]]}, "must list at least three nodes"),
        ({"v": 1, "type": "link_beliefs", "version": 2, "rates": [], "amends": 1,
          "offload": [[2, 1, [2, 3, 2, 1], 0.5]]}, "not a simple detour from 2 to 1"),
        ({"v": 1, "type": "link_beliefs", "version": 2, "rates": [], "amends": 1,
          "offload": [[2, 1, [2, 3, 1], 0.0]]}, "must be in (0, 1]"),
        ({"v": 1, "type": "link_beliefs", "version": 2, "rates": [], "amends": 1,
          "offload": [[2, 1, [2, 3, 1], 0.6], [2, 1, [2, 4, 1], 0.6]]}, "fractions of 2->1 sum above 1"),
        ({"v": 1, "type": "link_report", "src": 1, "dst": 2, "mbit_s": float("nan"), "t": 0.0, "samples": 4},
         "link_report: Expected `float` >= -1.7976931348623157e+308 - at `$.mbit_s`"),
        ({"v": 1, "type": "status", "expected": [], "registered": [], "alive": [], "complete": 1,
          "version": 0, "bindings": []}, "status: Expected `bool`, got `int` - at `$.complete`"),
        ({"v": 1, "type": "status", "expected": [], "registered": [], "alive": [], "complete": True,
          "version": 0, "bindings": [[1, 2, 3]]}, "Expected `array` of length 2, got 3 - at `$.bindings[0]`"),
        ({"v": 1, "type": "status", "expected": [], "registered": [], "alive": [], "complete": True,
          "version": 0, "bindings": [], "edge": [[2, "userspace"]]},
           "Expected `array` of length 3, got 2 - at `$.edge[0]`"),
        ({"v": 1, "type": "edge_report", "node_id": 2, "mode": 3},
         "edge_report: Expected `str`, got `int` - at `$.mode`"),
        ({"v": 1, "type": "history_request", "since_iteration": 0},
         "history_request: Object missing required field `since_version`"),
        ({"v": 1, "type": "history", "bindings": [], "policies": [[0, "first plan", [1]]]},
         "Expected `array` of at least length 4, got 3 - at `$.policies[0]`"),
        ({"v": 1, "type": "history", "bindings": [], "policies": [[0, "first plan", [1], [[1, 2]]]]},
         "Expected `array` of length 3, got 2 - at `$.policies[0][3][0]`"),
        ({"v": 1, "type": "history", "bindings": [], "policies": [[0, 7, [1], []]]},
         "Expected `str`, got `int` - at `$.policies[0][1]`"),
        ([1, 2, 3], "not a map"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(data: object, needle: str) -> None:
    with pytest.raises(ControlError) as info:
        decode(raw(data))
    assert needle in str(info.value)


def test_workers_default_to_one_and_stay_off_the_wire_at_their_default() -> None:
    """A peer that predates ``workers`` neither sends it nor accepts it: frames without it decode as one
    worker per DC, and a message at that default is encoded exactly as before."""
    old_register = {"v": 1, "type": "register", "node_id": 2, "data_host": "h", "data_port": 7}
    assert decode(raw(old_register)) == Register(2, "h", 7, workers=1)
    assert msgpack.unpackb(body(encode(Register(2, "h", 7)))) == old_register
    assert msgpack.unpackb(body(encode(Register(2, "h", 7, workers=4))))["workers"] == 4
    members = {1: ("h", 5), 2: ("h", 6), 3: ("h", 7)}
    old_ack = {"v": 1, "type": "register_ack", "members": [[1, "h", 5], [2, "h", 6], [3, "h", 7]], "config": {},
               "scheduler_time": 0.5}
    ack = decode(raw(old_ack))
    assert isinstance(ack, RegisterAck) and [ack.workers_of(n) for n in (1, 2, 3)] == [1, 1, 1]
    explicit = RegisterAck(members, {}, 0.5, workers={1: 1, 2: 4, 3: 1})
    assert explicit == RegisterAck(members, {}, 0.5, workers={2: 4})
    assert [explicit.workers_of(n) for n in (1, 2, 3)] == [1, 4, 1]
    assert msgpack.unpackb(body(encode(explicit)))["workers"] == [[2, 4]]
    assert msgpack.unpackb(body(encode(RegisterAck(members, {}, 0.5, workers={1: 1})))) == old_ack


def test_new_optional_fields_stay_off_the_wire_at_their_default() -> None:
    """A status without gateways and an edge report without a fallback are encoded as a peer that
    predates those fields sends them."""
    status = Status(expected=(1, 2), registered=(1, 2), alive=(1, 2), complete=True, version=0)
    assert "edge" not in msgpack.unpackb(body(encode(status)))
    assert "fallback" not in msgpack.unpackb(body(encode(EdgeReport(node_id=1, mode="xdp (native)"))))
    record = PolicyRecord(3, "periodic update", (2, 1), ((2, 1, 2), (2, 3, 1), (1, 2, 1)))
    assert record.trees() == {2: {1: 2, 3: 1}, 1: {2: 1}}


@pytest.mark.parametrize("workers", [0, -1])
def test_a_register_with_no_worker_is_refused_when_built(workers: int) -> None:
    with pytest.raises(ControlError, match=f"at least its own trainer .*got {workers}"):
        Register(1, "h", 7, workers=workers)


def test_garbage_bytes_are_rejected() -> None:
    with pytest.raises(ControlError, match="undecodable"):
        decode(b"\xc1\xff\x00garbage")


def test_read_message_takes_a_stream_split_anywhere() -> None:
    async def main() -> list[control.Message | None]:
        stream = b"".join(encode(m) for m in SAMPLES)
        reader = asyncio.StreamReader()

        async def feed() -> None:
            for i in range(len(stream)):
                reader.feed_data(stream[i:i + 1])
                await asyncio.sleep(0)  # let the reader see each byte on its own
            reader.feed_eof()

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(feed())
            out = [await control.read_message(reader) for _ in range(len(SAMPLES) + 1)]
        return out

    assert asyncio.run(main()) == [*SAMPLES, None]


def test_read_message_refuses_oversized_frames_before_buffering_them() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(control.LENGTH.pack(101) + b"x" * 10)  # the rest never comes
        with pytest.raises(ControlError, match="exceeds the limit of 100"):
            await control.read_message(reader, max_frame=100)

    asyncio.run(main())


def test_read_message_from_a_stream() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(encode(SAMPLES[0]) + encode(SAMPLES[1]))
        reader.feed_data(encode(SAMPLES[2])[:5])
        reader.feed_eof()
        assert await control.read_message(reader) == SAMPLES[0]
        assert await control.read_message(reader) == SAMPLES[1]
        with pytest.raises(ControlError, match="closed inside"):
            await control.read_message(reader)
        empty = asyncio.StreamReader()
        empty.feed_eof()
        assert await control.read_message(empty) is None

    asyncio.run(main())


@pytest.mark.parametrize(("text", "expected"), [("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9", ("::1", 9))])
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert control.parse_address(text) == expected
    assert control.parse_address(control.format_address(expected)) == expected


@pytest.mark.parametrize("text", ["localhost", ":80", "h:x", "h:70000"])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ControlError, match=f"^--listen: .*{text!r}"):
        control.parse_address(text, "--listen")
