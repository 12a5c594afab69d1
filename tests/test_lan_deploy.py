"""The LAN configuration a gateway deploys (two-level topology, a worker's deployment), the slot pool's
layout, and the precision conversion every aggregator shares, checked without a network."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.errors import ConfigError
from netstorm.lan.deploy import Deployment, LanTopology
from netstorm.lan.errors import WireError
from netstorm.lan.header import DATA_PRECISIONS, HEADER_BYTES, Header, Kind, Precision, lanes_for_mtu
from netstorm.lan.layout import MAX_MAP_BYTES, EdgeLayout
from netstorm.lan.packets import ack_packets, data_packets
from netstorm.lan.precision import decode_lanes, int8_scales, to_fixed, worker_values


def test_topology_masks_follow_the_clusters_and_round_trip() -> None:
    topo = LanTopology.parse("1:0,2;3:4", 7)
    assert topo.levels == 2 and topo.unclustered == (5, 6)
    assert topo.gateway_mask() == (1 << 1) | (1 << 3) | (1 << 5) | (1 << 6)
    assert topo.cluster_mask(1) == 0b111 and topo.cluster_mask(3) == 0b11000
    assert [topo.aggregator_of(w) for w in range(7)] == [1, 1, 1, 3, 3, None, None]
    assert LanTopology.decode(topo.encode()) == topo
    assert LanTopology(4).levels == 1 and LanTopology(4).gateway_mask() == 0b1111


@pytest.mark.parametrize("text,workers", [("0:1;1:2", 3), ("0:5", 3), ("x:1", 3), ("0:0", 2)])
def test_a_bad_topology_is_refused_by_name(text: str, workers: int) -> None:
    with pytest.raises(ConfigError):
        LanTopology.parse(text, workers)


def test_deployment_round_trips_and_garbage_is_a_wire_error() -> None:
    d = Deployment(pool=64, lanes=357, scale=16, send_to=("10.0.0.3", 9700), group=("239.1.2.3", 9701),
                   members=(4, 5), retransmit=0.01, first_iteration=7)
    assert Deployment.decode(d.encode()) == d
    with pytest.raises(WireError):
        Deployment.decode(b"\x93garbage")


def test_the_pool_reuses_slots_in_sequence_and_bounds_memory() -> None:
    lay = EdgeLayout.uniform([1000, 10, 700], scale=8, lanes=100, pool=4)
    assert lay.num_chunks == 10 + 1 + 7 and lay.num_slots == 4
    seqs = [lay.seq(t, c) for t in range(3) for c in range(lay.chunks[t])]
    assert seqs == list(range(lay.num_chunks))
    assert [lay.slot(*lay.locate(q)) for q in seqs] == [q % 4 for q in seqs]
    rows = data_packets(lay, job=1, worker=0, iteration=3, tensor=2, values=np.ones(700))
    assert [Header.decode(bytes(r)).slot for r in rows] == [(11 + c) % 4 for c in range(7)]
    assert EdgeLayout.uniform([61_000_000], 16, lanes_for_mtu(1500), pool=1024).map_bytes < MAX_MAP_BYTES
    with pytest.raises(WireError, match="smaller pool"):
        EdgeLayout.uniform([10**9], 16, lanes_for_mtu(1500), pool=0)


def test_lanes_fit_the_mtu() -> None:
    assert lanes_for_mtu(1500) == 357 and HEADER_BYTES + 4 * 357 + 28 == 1500
    with pytest.raises(WireError):
        lanes_for_mtu(60)


@pytest.mark.parametrize("precision", DATA_PRECISIONS)
def test_narrow_lanes_travel_at_their_width_and_widen_exactly(precision: Precision) -> None:
    rng = np.random.default_rng(int(precision))
    lay = EdgeLayout.uniform([300], scale=12, lanes=120)
    values = (rng.standard_normal(300) * 3).astype(np.float32)
    rows = data_packets(lay, job=1, worker=2, iteration=9, tensor=0, values=values, precision=precision)
    assert rows.shape[1] == HEADER_BYTES + precision.lane_bytes * 120
    want = np.rint(worker_values(values, precision, 120) * 2.0**12).astype(np.int64)
    got = []
    for row in rows:
        head = Header.decode(bytes(row))
        assert head.precision == precision and head.kind == Kind.DATA
        got.append(to_fixed(np.frombuffer(bytes(row), np.uint8, offset=HEADER_BYTES), precision, head.wscale,
                            head.scale)[: head.count])
    assert np.array_equal(np.concatenate(got), want)


def test_int8_scales_use_the_whole_range_and_fp16_rounds_to_nearest() -> None:
    matrix = np.array([[0.5, -1.0, 0.25], [100.0, 3.0, 0.0], [0.0, 0.0, 0.0]])
    scales = int8_scales(matrix)
    assert list(scales) == [6, 0, 0]     # 1.0 * 2**6 = 64 <= 127 < 128; 100 * 2**0 = 100 <= 127 < 200
    halves = decode_lanes(np.array([0x3C00, 0x0001, 0xFBFF], "<u2"), Precision.FP16, np.zeros(1))
    assert list(halves) == [1.0, 2.0**-24, -65504.0]


def test_ack_datagrams_list_chunks_and_decode() -> None:
    packets = ack_packets(np.arange(300), job=4, iteration=11, per_packet=256)
    assert len(packets) == 2
    heads = [Header.decode(p) for p in packets]
    assert [h.count for h in heads] == [256, 44] and all(h.kind == Kind.ACK for h in heads)
    assert np.array_equal(np.frombuffer(packets[1], "<u4", offset=HEADER_BYTES), np.arange(256, 300))


def test_the_gateway_takes_a_topology_before_it_starts_only() -> None:
    from bpf.gateway import EdgeOptions, GatewayRole

    role = GatewayRole(EdgeOptions(workers=4, listen=("127.0.0.1", 0), mode="userspace"), iteration_timeout=1.0)
    role.deploy(LanTopology.parse("0:1", 4))
    assert role.options.topology == LanTopology.parse("0:1", 4)
    role.agent = object()  # type: ignore[assignment]
    with pytest.raises(RuntimeError):
        role.deploy(LanTopology(4))
    with pytest.raises(ConfigError):
        EdgeOptions(workers=3, listen=("127.0.0.1", 0), mode="userspace", topology=LanTopology(4))
