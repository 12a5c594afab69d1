"""The edge wire format and fixed point, and the agent's sans-I/O core: hand-checked cases, brute force
against numpy, and rejection of malformed input with a typed error."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bpf.agent import IterationSums
from netstorm.lan.batch import valid_headers
from netstorm.lan.errors import WireError
from netstorm.lan.fixedpoint import INT32_MAX, quantize, rescale_for
from netstorm.lan.header import (
    FIELDS,
    HEADER_BYTES,
    HEADER_DTYPE,
    HEADER_STRUCT,
    MAGIC,
    NEED_NONE,
    OFFSETS,
    VERSION,
    Flag,
    Header,
    Kind,
    c_definitions,
    lanes_of,
)
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import control_packet, data_packets, fit_scales, nack_packets, result_packets
from netstorm.lan.slots import SlotEvent

LAYOUT = EdgeLayout.uniform([1000, 7], scale=10, lanes=358)
BPF = Path(__file__).resolve().parent.parent / "bpf"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def compile_and_run(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "layout.c").write_text(source)
    built = subprocess.run(["cc", "-std=c11", "-o", str(tmp_path / "layout"), str(tmp_path / "layout.c")],
                           capture_output=True, text=True, timeout=60, check=False)
    if built.returncode != 0:
        return built
    return subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, timeout=10, check=False)


@needs_cc
def test_the_c_header_has_the_python_layout(tmp_path: Path) -> None:
    """The C text generated from FIELDS, compiled by a C compiler, puts every field where the Python side
    packs and unpacks it (the struct format and the numpy dtype)."""
    prints = "".join(f'    printf("{f.name} %zu %zu\\n", offsetof(struct ns_hdr, {f.name}), '
                     f"sizeof(((struct ns_hdr *)0)->{f.name}));\n" for f in FIELDS)
    run = compile_and_run(tmp_path, "#include <stddef.h>\n#include <stdio.h>\n" + c_definitions()
                          + 'int main(void) {\n    printf("size %zu 0\\n", sizeof(struct ns_hdr));\n' + prints
                          + "    return 0;\n}\n")
    assert run.returncode == 0, run.stderr
    seen = {name: (int(offset), int(size)) for name, offset, size in map(str.split, run.stdout.splitlines())}
    assert seen.pop("size") == (HEADER_BYTES, 0) and HEADER_STRUCT.size == HEADER_BYTES
    offset = 0
    for field, code in zip(FIELDS, HEADER_STRUCT.format[1:], strict=True):  # the format after "<"
        assert seen[field.name] == (OFFSETS[field.name], struct.calcsize("<" + code))
        assert OFFSETS[field.name] == offset
        offset += seen[field.name][1]
    assert list(seen) == [f.name for f in FIELDS]


@needs_cc
def test_a_c_header_out_of_step_with_python_does_not_compile(tmp_path: Path) -> None:
    """The generated text asserts every offset, so a C struct that drifted from FIELDS fails to build."""
    text = c_definitions()
    drifted = re.sub(r"(    __u8 version;[^\n]*\n)(    __u8 kind;[^\n]*\n)", r"\2\1", text)  # swap two fields
    assert drifted != text
    assert compile_and_run(tmp_path, c_definitions() + "int main(void) { return 0; }\n").returncode == 0
    failed = compile_and_run(tmp_path, drifted + "int main(void) { return 0; }\n")
    assert failed.returncode != 0 and "ns_hdr.version" in failed.stderr


def test_the_xdp_program_does_not_define_the_header_itself() -> None:
    """bpf/aggregator.c and slot.h take the header and its constants from the generated text only."""
    for name in ("aggregator.c", "slot.h", "slots.c"):
        source = (BPF / name).read_text()
        assert not re.search(r"struct ns_hdr\s*\{", source), name
        assert not re.search(r"#define\s+NS_(MAGIC|VERSION|KIND_(?!TIMER_INIT)|FLAG_|MAX_WORKERS)", source), name
    generated = c_definitions()
    program = (BPF / "aggregator.c").read_text()
    used = set(re.findall(r"\bNS_(?:MAGIC|VERSION|KIND_[A-Z_]+|FLAG_[A-Z]+|MAX_WORKERS)\b", program))
    assert used - {"NS_KIND_TIMER_INIT"} <= set(re.findall(r"#define (NS_\w+)", generated))
    assert {"NS_MAGIC", "NS_VERSION", "NS_KIND_DATA", "NS_KIND_AGG", "NS_FLAG_OVERFLOW", "NS_MAX_WORKERS"} <= used


def test_header_round_trip_and_field_offsets() -> None:
    head = Header(Kind.DATA, job=513, worker=63, iteration=2**32 - 1, tensor=7, chunk=9, slot=11, count=358,
                  scale=-5, need=-128, flags=Flag.OVERFLOW)
    raw = head.encode()
    assert len(raw) == HEADER_BYTES
    assert raw[:4] == bytes([0x4E, 0x53, VERSION, 1])     # magic "NS" little-endian, version, kind
    assert int.from_bytes(raw[8:12], "little") == 2**32 - 1
    assert Header.decode(raw + bytes(4 * 358)) == head


def test_the_header_codec_follows_the_field_table() -> None:
    """Header.encode and decode put every field where FIELDS (hence the C struct) says it is."""
    head = Header(Kind.RESULT, job=0x0102, worker=3, iteration=0x04050607, tensor=0x08090A0B, chunk=0x0C0D0E0F,
                  slot=0x10111213, count=0x0115, scale=-22, need=23, flags=Flag.RESCALE, total=0x18191A1B,
                  token=0x2021222324252627)
    raw = head.encode()
    row = np.frombuffer(raw, HEADER_DTYPE)[0]
    assert (int(row["magic"]), int(row["version"])) == (MAGIC, VERSION)
    for field in FIELDS[2:]:
        assert int(row[field.name]) == int(getattr(head, field.name)), field.name
    assert Header.decode(raw + bytes(4 * head.count)) == head


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda b: b[:10], "shorter"),
    (lambda b: b"\x00\x00" + b[2:], "bad magic"),
    (lambda b: b[:2] + b"\x01" + b[3:], "version"),      # version 1 had no token
    (lambda b: b[:3] + b"\x63" + b[4:], "unknown kind"),
    (lambda b: b[:7] + b"\x80" + b[8:], "unknown flags"),
    (lambda b: b[:-1], "payload bytes"),
    (lambda b: b[:6] + b"\x40" + b[7:], "worker 64"),
    (lambda b: b[:28] + b"\x05\x00\x00\x00" + b[32:], "DATA datagram with total 5: only RESULT carries one"),
])
def test_malformed_datagrams_are_rejected_with_a_reason(mutate: object, message: str) -> None:
    good = bytes(data_packets(LAYOUT, job=1, worker=2, iteration=3, tensor=1, values=np.ones(7))[0])
    Header.decode(good)
    with pytest.raises(WireError, match=message):
        Header.decode(mutate(good))  # type: ignore[operator]


def test_result_total_round_trips_at_offset_28() -> None:
    """A RESULT says how many workers' gradients it sums, in the header word other kinds keep zero."""
    head = Header(Kind.RESULT, job=1, worker=0, iteration=7, tensor=1, chunk=0, slot=3, count=7, scale=0,
                  total=2**32 - 1)
    raw = head.encode()
    assert int.from_bytes(raw[28:32], "little") == 2**32 - 1
    assert Header.decode(raw + bytes(4 * 7)) == head
    res = result_packets(LAYOUT, job=1, iteration=7, tensor=0, values=np.ones(1000), total=13)
    assert [Header.decode(bytes(r)).total for r in res] == [13, 13, 13]
    assert Header.decode(bytes(data_packets(LAYOUT, job=1, worker=0, iteration=7, tensor=0,
                                            values=np.ones(1000))[0])).total == 0
    with pytest.raises(WireError, match="at least one worker"):
        result_packets(LAYOUT, job=1, iteration=7, tensor=0, values=np.ones(1000), total=0)


def test_control_datagrams_carry_no_payload() -> None:
    nack = control_packet(Kind.NACK, job=1, worker=0, iteration=4, tensor=1, chunk=0, scale=3, flags=Flag.RESCALE)
    head = Header.decode(nack)
    assert (head.kind, head.iteration, head.scale, head.flags) == (Kind.NACK, 4, 3, Flag.RESCALE)
    with pytest.raises(WireError, match="unexpected payload"):
        Header.decode(nack + b"\x00" * 4)
    pull = control_packet(Kind.PULL, job=1, worker=0, iteration=4, tensor=1, chunk=0)
    with pytest.raises(WireError, match="unexpected payload"):
        Header.decode(pull + b"\x00" * 4)


def test_a_nack_lists_chunks_and_a_rescale_nack_names_one() -> None:
    listed = nack_packets(np.array([7, 3, 7, 2**32 - 1]), job=1, iteration=4, per_packet=3)
    assert len(listed) == 2
    head = Header.decode(listed[0])
    assert (head.kind, head.count, head.flags) == (Kind.NACK, 3, Flag.NONE)
    assert lanes_of(listed[0], "<u4").tolist() == [7, 3, 7]
    assert lanes_of(listed[1], "<u4").tolist() == [2**32 - 1]
    # a RESCALE NACK listing chunks is malformed, in the batch check as in decode
    bad = bytearray(listed[0])
    bad[OFFSETS["flags"]] = int(Flag.RESCALE)
    with pytest.raises(WireError, match="RESCALE NACK"):
        Header.decode(bytes(bad))
    heads = np.frombuffer(bytes(bad[:HEADER_BYTES]) + listed[1][:HEADER_BYTES], HEADER_DTYPE)
    assert valid_headers(heads, np.array([len(bad), len(listed[1])])).tolist() == [False, True]


def test_fit_scale_is_the_largest_that_fits_by_brute_force() -> None:
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((50, 20)) * 10.0 ** rng.integers(-6, 9, (50, 1))
    rows[0] = 0.0
    for row, need in zip(rows, fit_scales(rows), strict=True):
        if not row.any():
            assert need == NEED_NONE
            continue
        fits = [s for s in range(-60, 100) if np.all(np.abs(np.rint(row * 2.0**s)) <= INT32_MAX)]
        assert need == max(fits)


def test_quantize_flags_clipping_instead_of_wrapping() -> None:
    lanes, overflow = quantize(np.array([1.5, -2.25, 3e9]), 1)
    assert overflow and lanes[2] == INT32_MAX and list(lanes[:2]) == [3, -4]   # rint(-4.5) = -4 (to even)


def test_rescale_leaves_room_for_every_worker() -> None:
    for workers in (1, 2, 3, 8, 64):
        s = rescale_for(20, workers)
        assert workers * (2**31 - 1) / 2**(20 - s) <= 2**31 - 1 + 1e-9


def test_data_packets_split_pad_and_address_slots() -> None:
    values = np.arange(1000, dtype=np.float32) / 8
    rows = data_packets(LAYOUT, job=1, worker=4, iteration=9, tensor=0, values=values)
    assert rows.shape == (3, HEADER_BYTES + 4 * 358)
    heads = [Header.decode(bytes(r)) for r in rows]
    assert [h.count for h in heads] == [358, 358, 284]
    assert [h.slot for h in heads] == [0, 1, 2] and LAYOUT.slot(1, 0) == 3
    got = np.concatenate([lanes_of(bytes(r))[: h.count] for r, h in zip(rows, heads, strict=True)])
    assert np.array_equal(got, values * 2**10) and not lanes_of(bytes(rows[2]))[284:].any()
    res = result_packets(LAYOUT, job=1, iteration=9, tensor=0, values=values, total=3)
    assert np.array_equal(lanes_of(bytes(res[1]), "<f4")[:358], values[358:716])


def test_iteration_sums_nack_exactly_the_missing_and_rescale_everyone() -> None:
    sums = IterationSums(LAYOUT, iteration=9, workers=4, job=1)
    event = SlotEvent(iteration=9, tensor=1, chunk=0, slot=3, bitmap=0b0101, expected=0b1111, job=1, scale=10,
                      nacks=1)
    assert sums.on_event(event) == (LAYOUT.seq(1, 0), [1, 3])
    assert sums.missing == {(1, 0): [1, 3]}
    done = IterationSums(LAYOUT, iteration=9, workers=4, job=1)
    done.take(np.array([(1, 0, 7, 10)], [("tensor", "<u4"), ("chunk", "<u4"), ("count", "<u2"), ("scale", "i1")]),
              np.zeros((1, 358), np.int32), now=0.0)
    assert done.on_event(event) is None     # completed since: nobody is NACKed
    over = Header(Kind.AGG, 1, 0, 9, 1, 0, 3, 7, scale=10, need=11, flags=Flag.OVERFLOW)
    rescale = sums.on_agg(over, np.zeros(358, np.int32), 0.0)
    assert [w for w, _ in rescale] == [0, 1, 2, 3]   # each fits at 11, four of them at 11 - 2
    assert all(Header.decode(d).scale == 9 and Header.decode(d).flags == Flag.RESCALE for _, d in rescale)
    # an overflow the workers' own needs cannot explain is an error, not a silent wrap
    with pytest.raises(WireError, match="overflow at scale 10"):
        sums.on_agg(Header(Kind.AGG, 1, 0, 9, 0, 1, 1, 358, scale=10, need=12, flags=Flag.OVERFLOW),
                    np.zeros(358, np.int32), 0.0)
    ok = Header(Kind.AGG, 1, 0, 9, 1, 0, 3, 7, scale=8)
    assert sums.on_agg(ok, np.arange(358, dtype=np.int32), 0.0) == []
    assert np.array_equal(sums.result()[1], (np.arange(7) / 2**8).astype(np.float32))
    assert (1, 0) not in sums.pending and "tensor 0 chunk 0" in sums.describe_missing()


def test_many_sequence_numbers_at_once_match_one_at_a_time() -> None:
    from netstorm.lan.layout import EdgeLayout

    layout = EdgeLayout.uniform([10, 1, 25], scale=16, lanes=4, pool=3)
    tensors = np.array([0, 0, 1, 2, 2, 3, 1, 0, -1], np.int64)
    chunks = np.array([0, 2, 0, 6, 7, 0, 1, 3, 0], np.int64)
    seqs, known = layout.seqs(tensors, chunks)
    for t, c, q, k in zip(tensors.tolist(), chunks.tolist(), seqs.tolist(), known.tolist(), strict=True):
        try:
            want: int | None = layout.seq(t, c)
        except WireError:
            want = None
        assert (q if k else None) == want, (t, c)
    assert known.tolist() == [True, True, True, True, False, False, False, False, False]
