"""``edge_mtu`` where it binds: the widest DATA datagram a worker sends fits the configured MTU, one lane
more would not (up to the wire's MAX_LANES: a jumbo MTU of 9000, which the option accepts, once made the
lane count raise), and MTUs the wire cannot carry are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm import config
from netstorm.errors import ConfigError
from netstorm.lan.errors import WireError
from netstorm.lan.header import IP_UDP_BYTES, MAX_LANES, lanes_for_mtu
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import data_packets


@pytest.mark.parametrize("mtu", [576, 1500, 3504, 9000])
def test_the_widest_datagram_fits_the_mtu_and_one_lane_more_would_not(mtu: int) -> None:
    lanes = lanes_for_mtu(mtu)
    layout = EdgeLayout.uniform([3 * lanes + 1], scale=8, lanes=lanes)
    values = np.arange(3 * lanes + 1, dtype=np.float32) / 7
    rows = data_packets(layout, job=1, worker=0, iteration=0, tensor=0, values=values)
    packet = rows.shape[1] + IP_UDP_BYTES
    assert packet <= mtu and (mtu < packet + 4 or lanes == MAX_LANES), (mtu, lanes, packet)
    assert config.resolve(overrides={"edge_mtu": mtu}).edge_mtu == mtu


@pytest.mark.parametrize("mtu", [575, 9001])
def test_an_mtu_outside_the_wire_is_refused(mtu: int) -> None:
    with pytest.raises(ConfigError, match="edge_mtu"):
        config.resolve(environ={"NETSTORM_EDGE_MTU": str(mtu)})


def test_an_mtu_too_small_for_one_lane_is_refused_by_the_wire() -> None:
    with pytest.raises(WireError, match="lanes"):
        lanes_for_mtu(IP_UDP_BYTES + 44 + 3)
