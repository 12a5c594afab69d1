"""The bcc 0.26 timer link step on its own: instruction patching by hand-checked cases, and a real load
whose callback is shown to fire (the slot report arrives through the ring buffer)."""

from __future__ import annotations

import struct

import pytest

from bpf.timer_link import BPF_PSEUDO_FUNC, LD_IMM64, LoaderError, link_callback

MARK = 0x7E11_0000_DEAD_BEEF


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def ld_imm64(dst: int, value: int, src: int = 0) -> bytes:
    lo, hi = value & 0xFFFFFFFF, value >> 32
    return insn(LD_IMM64, dst, src, imm=struct.unpack("<i", struct.pack("<I", lo))[0]) + \
        insn(0, imm=struct.unpack("<i", struct.pack("<I", hi))[0])


MOV_R0_0 = insn(0xB7)
EXIT = insn(0x95)


def test_marked_load_becomes_pseudo_func_with_relative_offset() -> None:
    # 0: r0 = 0; 1-2: r2 = MARK; 3: exit | callback at 4: r0 = 0; exit
    prog = MOV_R0_0 + ld_imm64(2, MARK) + EXIT
    callback = MOV_R0_0 + EXIT
    out = link_callback(prog, callback, MARK)
    assert len(out) == len(prog) + len(callback)
    code, regs, _, imm = struct.unpack_from("<BBhi", out, 8)
    assert code == LD_IMM64 and regs == (BPF_PSEUDO_FUNC << 4) | 2
    assert imm == 4 - (1 + 1)  # callback index minus the instruction after the ld_imm64's first half
    assert struct.unpack_from("<i", out, 16 + 4)[0] == 0
    assert out[:8] == prog[:8] and out[24:] == prog[24:] + callback


def test_other_constants_and_map_loads_are_left_alone() -> None:
    other = ld_imm64(3, MARK ^ 1) + ld_imm64(1, 7, src=1)   # a near miss and a map fd load
    prog = other + ld_imm64(2, MARK) + EXIT
    out = link_callback(prog, MOV_R0_0 + EXIT, MARK)
    assert out[: len(other)] == other
    assert struct.unpack_from("<BBhi", out, len(other))[3] == 7 - (len(other) // 8 + 1)


def test_missing_mark_and_torn_instructions_are_errors() -> None:
    with pytest.raises(LoaderError, match="not found"):
        link_callback(MOV_R0_0 + EXIT, MOV_R0_0 + EXIT, MARK)
    with pytest.raises(LoaderError, match="whole 8-byte"):
        link_callback(MOV_R0_0 + b"\x00", EXIT, MARK)


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.slow
def test_linked_callback_really_fires_through_the_ring_buffer() -> None:
    """Every one of 2000 slots (ten times what a quiet host's slab holds free for timers) reports,
    re-arming itself until max_nacks: the timers were all initialised at load time."""
    import time

    import numpy as np

    from bpf.xdp import XDP_DROP, udp_frame
    from netstorm.lan.packets import data_packets
    from tests.edge_programs import LAYOUT, PORT, TIMER_TENSOR, shared_program

    slots = LAYOUT.chunks[TIMER_TENSOR]
    assert slots == 2000
    agg = shared_program()
    agg.configure(job=1, port=PORT, expected=0b11, timeout=0.1, max_nacks=3)
    before = agg.stats()
    agg.drain_events()
    rows = data_packets(LAYOUT, job=1, worker=1, iteration=5, tensor=TIMER_TENSOR,
                        values=np.ones(LAYOUT.sizes[TIMER_TENSOR]))
    for row in rows:
        verdict, _ = agg.test_run(udp_frame(bytes(row), dport=PORT))
        assert verdict == XDP_DROP
    seen: dict[int, list[int]] = {}
    # each poll returns as soon as any report is in, so bound the wait by a deadline, not by a poll count
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        for event in agg.poll_events(50):
            if event.tensor != TIMER_TENSOR or event.iteration != 5:
                continue   # a report left over from another test's slot on the shared program
            assert event.missing == [0]
            seen.setdefault(event.chunk, []).append(event.nacks)
        if sum(map(len, seen.values())) >= 3 * slots:
            break
    # armed by the first packet, re-armed by the callback itself until max_nacks reports
    assert sorted(seen) == list(range(slots))
    wrong = {chunk: nacks for chunk, nacks in seen.items() if nacks != [1, 2, 3]}
    assert not wrong, (len(wrong), agg.stats())
    assert agg.stats()["timer_fail"] == before["timer_fail"] == 0
    # a report the full ring buffer refused was retried, not charged to max_nacks (so the lists above hold)
    assert agg.stats()["timer_events"] - before["timer_events"] == 3 * slots
