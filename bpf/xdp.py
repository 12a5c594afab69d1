"""The XDP aggregator as an object: compile and link (bpf/timer_link.py), configure, attach, read out.

One instance owns one slot map sized by an EdgeLayout, the configuration map (expected contributor mask,
timer period, job, UDP port, whether tokens are checked), the token map (the value each worker's DATA must
carry, per iteration of a window), the uplink meter map (each worker's first window of DATA per iteration:
bytes, first and last arrival), per-CPU counters and the ring buffer the timer callback writes to.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import math
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bpf import timer_link
from bpf.timer_link import LoaderError
from bpf.timer_memory import SlabRoom
from netstorm.lan.batch import distinct
from netstorm.lan.header import MAX_WORKERS, OFFSETS, Header, Kind, c_definitions
from netstorm.lan.kinds import LOADER_KINDS
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.slots import STATS, TOKEN_WINDOW, SlotEvent, slot_dtype

HERE = Path(__file__).resolve().parent
XDP_FLAGS_UPDATE_IF_NOEXIST = 1
XDP_FLAGS_SKB_MODE = 2
XDP_FLAGS_DRV_MODE = 4
_EVENT = struct.Struct("<IIIIQQHbBI")
"""``struct ns_event`` (bpf/aggregator.c) for one report: the fields of ``SlotEvent`` in order, then padding."""
METER_DTYPE = np.dtype({"names": ["iteration", "packets", "bytes", "first_ns", "last_ns"],
                         "formats": ["<u4", "<u4", "<u8", "<u8", "<u8"], "offsets": [4, 8, 16, 24, 32],
                         "itemsize": 40})
"""``struct ns_meter`` (bpf/slot.h) after its 4-byte bpf_spin_lock."""
METER_ENTRIES = MAX_WORKERS * TOKEN_WINDOW
"""The meter map: one entry per worker and iteration of the token window, an iteration's entries consecutive."""
ARRIVAL_MAGIC = 0x4E534152
"""``struct ns_arrival``'s mark: XDP metadata the agent gives a frame it runs through the program."""
BPF_F_LOCK = 4
SLOT_RUN = 64
"""Slots one batched lookup reads at most (a value is 56 bytes plus the lanes)."""
_instances = itertools.count()


class _BatchOpts(ctypes.Structure):
    _fields_ = [("sz", ctypes.c_size_t), ("elem_flags", ctypes.c_uint64), ("flags", ctypes.c_uint64)]
#: tries per slot before the loader gives up on its timer (each ENOMEM is followed by making room)
PRIME_ATTEMPTS = 32


class _TestRunOpts(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t), ("data_in", ctypes.c_void_p), ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32), ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p), ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32), ("repeat", ctypes.c_int), ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class Upstream:
    """Where a cluster aggregator forwards its completed slots: the gateway, as worker ``worker``."""

    worker: int
    ifindex: int
    """The interface towards the gateway."""
    gateway: tuple[str, int]
    gateway_mac: bytes
    own: tuple[str, int]
    """This host's address on that interface and the source port of forwarded datagrams."""
    own_mac: bytes


@dataclass(frozen=True)
class KernelResults:
    """Where a gateway's program sends the results it returns itself (``edge_results=kernel``): each completed
    slot as the RESULT of its chunk to the workers' multicast group, out of the interface it came in on."""

    group: tuple[str, int]
    group_mac: bytes
    own: tuple[str, int]
    """The gateway's address on its LAN interface and the source port of the results (its own)."""
    own_mac: bytes
    total: int
    """The workers each result sums (its header's ``total``)."""
    chunks: int
    """Chunks per iteration: the program reports an iteration once it has sent the result of each."""


def multicast_mac(address: str) -> bytes:
    """The Ethernet address an IPv4 multicast group maps to (RFC 1112: 01:00:5e and its low 23 bits)."""
    low = int.from_bytes(socket.inet_aton(address), "big") & 0x7FFFFF
    return bytes([0x01, 0x00, 0x5E]) + low.to_bytes(3, "big")


class XdpAggregator:
    """A loaded (not yet attached) aggregation program for one layout, job and UDP port. With ``upstream``
    it is a cluster aggregator (two-level LAN): completed slots go on to the gateway as its DATA."""

    def __init__(self, layout: EdgeLayout, *, job: int, port: int, expected: int, timeout: float,
                 max_nacks: int = 20, upstream: Upstream | None = None) -> None:
        self.layout = layout
        self.upstream = upstream
        name = f"ns_slots_{os.getpid()}_{next(_instances)}"
        # the ring buffer holds two reports from every slot at once, a timer's and a gap's (power-of-two pages,
        # at least 16)
        pages = 1 << max(4, math.ceil(math.log2(max(1, layout.num_slots) * 2 * 64 / 4096)))
        cflags = [f"-I{HERE}", f"-DNS_LANES={layout.lanes}", f"-DNS_SLOTS={max(1, layout.num_slots)}",
                  f"-DNS_TOKEN_WINDOW={TOKEN_WINDOW}",
                  f"-DNS_RING_PAGES={pages}"]
        cflags.append(f"-DNS_METER_ENTRIES={METER_ENTRIES}")
        self._slot_map = name.encode()
        self._meter_map = f"ns_meter_{name[len('ns_slots_'):]}".encode()

        def named(text: str) -> str:
            return text.replace("NS_SLOT_MAP", name).replace("NS_METER_MAP", self._meter_map.decode())

        owner = named((HERE / "slots.c").read_text())
        # the datagram header comes from the one definition of its layout, shared with the workers
        prog = c_definitions() + named((HERE / "aggregator.c").read_text())
        self._owner, self._module, self.fd = timer_link.compile_and_load(
            owner, prog, prog_name="ns_aggregate", callback_name="ns_timer_cb", timer_map=name, cflags=cflags)
        self._lib = timer_link.libbpf()
        self._lib.bpf_xdp_attach.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p]
        self._lib.bpf_xdp_detach.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p]
        self._lib.bpf_prog_test_run_opts.argtypes = [ctypes.c_int, ctypes.POINTER(_TestRunOpts)]
        self._lib.bpf_map_lookup_elem_flags.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                         ctypes.c_uint64]
        self._one: np.ndarray | None = None
        self._one_key = ctypes.c_uint32(0)
        self._lib.bpf_map_lookup_batch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                   ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32),
                                                   ctypes.POINTER(_BatchOpts)]
        self._value_size = 0
        self._slots_fd = -1
        self._meter_fd = -1
        self.meter_packets = layout.num_slots
        """DATA datagrams per worker and iteration the uplink meter counts (``configure`` installs it): the
        pool, which a worker sends back to back before its first ACK wait."""
        self.epoch = 0
        """The deployment epoch DATA must carry (``redeploy``)."""
        self.horizon: int | None = None
        """The newest iteration whose DATA is summed (``bound``; None: any)."""
        self._attached: list[tuple[int, int]] = []
        self.results: KernelResults | None = None
        """Where the program returns results itself (``return_results``; None: to the agent as AGG)."""
        self._events: list[SlotEvent] = []
        self._ring_open = False
        self._agg_token = 0
        self._port = port
        self.configure(job=job, port=port, expected=expected, timeout=timeout, max_nacks=max_nacks)
        self.prime_timers()

    def prime_timers(self) -> None:
        """Initialise every slot's bpf_timer from process context (BPF_PROG_TEST_RUN with the loader-only
        TIMER_INIT kind), so the data path only starts and cancels timers and never meets a failed
        allocation. The kernel allocates each timer without locks, from objects already free in its slab
        class; when none is left, bpf/timer_memory.py frees some on this CPU and the slot is tried again."""
        cfg = self._module[b"ns_cfg"][self._module[b"ns_cfg"].Key(0)]
        frame = bytearray(udp_frame(Header(Kind.DATA, 0, 0, 0, 0, 0, 0, 0, 0).encode(), dport=int(cfg.port)))
        frame[UDP_PAYLOAD + OFFSETS["kind"]] = TIMER_INIT_KIND
        slot, total = UDP_PAYLOAD + OFFSETS["slot"], UDP_PAYLOAD + OFFSETS["total"]
        with SlabRoom() as room:
            for index in range(self.layout.num_slots):
                frame[slot: slot + 4] = index.to_bytes(4, "little")
                for attempt in range(PRIME_ATTEMPTS):
                    verdict, out = self.test_run(bytes(frame))
                    code = int.from_bytes(out[total: total + 4], "little")
                    if verdict == XDP_DROP or code != errno.ENOMEM:
                        break
                    if not room.make():
                        # no way to make room on this kernel: give an asynchronous refill a moment
                        time.sleep(0.001 * (attempt + 1))
                if verdict != XDP_DROP:
                    raise LoaderError(self._prime_failure(index, code, room))

    def _prime_failure(self, index: int, code: int, room: SlabRoom) -> str:
        reason = os.strerror(code) if code else "unknown error"
        text = (f"initialising the bpf_timer of slot {index} of {self.layout.num_slots} failed ({reason}, "
                f"{PRIME_ATTEMPTS} attempts)")
        if code == errno.ENOMEM and not room.usable:
            text += ("; the kernel allocates timers without locks from free slab objects only, and this kernel's "
                     "BTF does not show pipes sharing the timer's size class, so the loader cannot make room")
        elif code == errno.ENOMEM:
            text += f" although {room.rounds} rounds of freed slab objects were offered"
        return text

    def configure(self, *, job: int, port: int, expected: int, timeout: float, max_nacks: int) -> None:
        """Install the control side's view: which workers contribute, the timer period, job and port."""
        self._port = port   # where a widened datagram is re-emitted: a program configured anew may move
        table = self._module[b"ns_cfg"]
        value = table.Leaf()
        value.expected = expected
        value.timeout_ns = int(timeout * 1e9)
        value.job = job
        value.port = port
        value.max_nacks = max_nacks
        value.meter_packets = self.meter_packets
        value.epoch = self.epoch
        value.auth = 1 if self._agg_token else 0
        value.agg_token = self._agg_token
        value.bounded = 0 if self.horizon is None else 1
        value.horizon = 0 if self.horizon is None else self.horizon & 0xFFFFFFFF
        self._put_results(value)
        up = self.upstream
        if up is not None:
            value.forward = 1
            value.up_worker = up.worker
            value.up_ifindex = up.ifindex
            value.up_ip = int.from_bytes(socket.inet_aton(up.gateway[0]), "little")
            value.own_ip = int.from_bytes(socket.inet_aton(up.own[0]), "little")
            value.up_port = socket.htons(up.gateway[1])
            value.own_port = socket.htons(up.own[1])
            for i in range(6):
                value.up_mac[i] = up.gateway_mac[i]
                value.own_mac[i] = up.own_mac[i]
        table[table.Key(0)] = value

    def return_results(self, results: KernelResults | None) -> None:
        """From now on send each completed slot back to the workers as RESULT (``results``), or pass it up to
        the agent as AGG (None). Only a gateway's program returns results; a cluster aggregator forwards."""
        if results is not None and self.upstream is not None:
            raise ValueError("a cluster aggregator forwards its sums to the gateway; only the gateway returns results")
        self.results = results
        table = self._module[b"ns_cfg"]
        value = table[table.Key(0)]
        self._put_results(value)
        table[table.Key(0)] = value

    def _put_results(self, value: Any) -> None:
        got = self.results
        value.results = 1 if got is not None else 0
        if got is None:
            return
        value.result_total = got.total
        value.chunks = got.chunks
        value.group_ip = int.from_bytes(socket.inet_aton(got.group[0]), "little")
        value.group_port = socket.htons(got.group[1])
        value.own_ip = int.from_bytes(socket.inet_aton(got.own[0]), "little")
        value.own_port = socket.htons(got.own[1])
        for i in range(6):
            value.group_mac[i] = got.group_mac[i]
            value.own_mac[i] = got.own_mac[i]

    def redeploy(self, *, expected: int, epoch: int) -> None:
        """A new deployment from an iteration boundary on (netstorm/lan/redeploy.py): the expected
        contributors and the epoch DATA must carry, rewritten in the configuration map (one update, no
        reload); slots in progress keep their contributors, so nothing summed is lost."""
        self.epoch = epoch
        table = self._module[b"ns_cfg"]
        value = table[table.Key(0)]
        value.expected = expected
        value.epoch = epoch
        table[table.Key(0)] = value

    def bound(self, horizon: int | None) -> None:
        """Sum DATA of no iteration newer than ``horizon`` from now on (None: of any), as the fallback's
        ``bound``. A bound only rises: where the program raised it itself (results mode, as an iteration
        completes) the newer of the two stays."""
        table = self._module[b"ns_cfg"]
        value = table[table.Key(0)]
        if horizon is not None and value.bounded and ((int(value.horizon) - horizon) & 0xFFFFFFFF) < 2**31:
            horizon = int(value.horizon)
        self.horizon = horizon
        value.bounded = 0 if horizon is None else 1
        value.horizon = 0 if horizon is None else horizon & 0xFFFFFFFF
        table[table.Key(0)] = value

    def configured(self) -> dict[str, int]:
        """The configuration map as the program reads it: expected contributors and epoch."""
        table = self._module[b"ns_cfg"]
        value = table[table.Key(0)]
        return {"expected": int(value.expected), "epoch": int(value.epoch)}

    def require_tokens(self, agg_token: int) -> None:
        """Check tokens from now on (``agg_token`` != 0: the value every aggregate passed up carries), or stop
        checking (0). DATA then needs the token ``install_tokens`` put in place for its worker and iteration."""
        self._agg_token = agg_token
        table = self._module[b"ns_cfg"]
        value = table[table.Key(0)]
        value.auth = 1 if agg_token else 0
        value.agg_token = agg_token
        table[table.Key(0)] = value

    def install_tokens(self, entries: list[tuple[int, int, int]]) -> None:
        """Put (worker, iteration, token) in the token map, each in its worker's window entry for the
        iteration (replacing the one ``TOKEN_WINDOW`` iterations older)."""
        table = self._module[b"ns_tokens"]
        for worker, iteration, token in entries:
            value = table.Leaf()
            value.iteration = iteration & 0xFFFFFFFF
            value.token = token
            table[table.Key(worker * TOKEN_WINDOW + (iteration & (TOKEN_WINDOW - 1)))] = value

    def attach(self, ifindex: int, *, mode: str = "auto") -> str:
        """Attach to ``ifindex`` in the caller's network namespace; returns "native" or "generic"."""
        tries = {"auto": [("native", XDP_FLAGS_DRV_MODE), ("generic", XDP_FLAGS_SKB_MODE)],
                 "native": [("native", XDP_FLAGS_DRV_MODE)], "generic": [("generic", XDP_FLAGS_SKB_MODE)]}[mode]
        errors = []
        for name, flags in tries:
            rc = self._lib.bpf_xdp_attach(ifindex, self.fd, flags, None)
            if rc == 0:
                self._attached.append((ifindex, flags))
                return name
            errors.append(f"{name}: {os.strerror(-rc)}")
        raise LoaderError(f"attaching XDP to ifindex {ifindex} failed ({'; '.join(errors)})")

    def detach(self) -> None:
        """Detach from every interface ``attach`` put the program on (in the caller's namespace)."""
        for ifindex, flags in self._attached:
            self._lib.bpf_xdp_detach(ifindex, flags, None)
        self._attached = []

    def prog_id(self) -> int:
        """The kernel's id of the loaded program (what ``ip link`` and bpftool show for an interface)."""
        with open(f"/proc/self/fdinfo/{self.fd}") as info:
            for line in info:
                if line.startswith("prog_id:"):
                    return int(line.split()[1])
        raise LoaderError("the program's fdinfo has no prog_id")

    def map_fds(self) -> dict[str, int]:
        """The program's maps by name (slot map, configuration, tokens, counters, ring buffer)."""
        import bcc

        # the slot map's value type has fields bcc's table wrapper cannot decode: ask for its fd by name
        fds = {"slots": int(bcc.libbcc.lib.bpf_table_fd(self._owner.module, self._slot_map)),
               "meter": int(bcc.libbcc.lib.bpf_table_fd(self._owner.module, self._meter_map))}
        for name in ("ns_cfg", "ns_tokens", "ns_stats", "ns_events"):
            fds[name] = int(self._module[name.encode()].map_fd)
        return fds

    def slot_states(self, indices: np.ndarray) -> np.ndarray:
        """The key, scale, busy flag and contributor bitmap of the slots ``indices``, read under each slot's
        spin lock (``BPF_F_LOCK``) with one batched lookup per run of consecutive slots (at most SLOT_RUN
        each); a slot the kernel would not give is returned with bitmap 0 and busy 0."""
        if self._value_size == 0:   # the slot map's fd and value size, found once (bcc's lookups are slow)
            self._slots_fd = self.map_fds()["slots"]
            with open(f"/proc/self/fdinfo/{self._slots_fd}") as info:
                self._value_size = next(int(line.split()[1]) for line in info if line.startswith("value_size:"))
        fd = self._slots_fd
        dtype = slot_dtype(self._value_size)
        wanted = np.asarray(indices, np.int64)
        slots = distinct(wanted)
        table = np.zeros(slots.size, dtype)
        # runs of consecutive slots, at most SLOT_RUN each; a lone slot (a lost chunk's, usually: losses are
        # scattered) is one plain lookup into a buffer kept for it, not a batch set up for one entry
        cuts = np.flatnonzero(np.diff(slots) != 1) + 1
        bounds = [(int(a), int(b)) for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), slots.size], strict=True)]
        for begin, end in bounds:
            for start in range(begin, end, SLOT_RUN):
                stop = min(end, start + SLOT_RUN)
                if stop - start == 1:
                    table[start] = self._read_one(fd, int(slots[start]), dtype)
                    continue
                keys, read = self._read_run(fd, int(slots[start]), stop - start, dtype)
                table[start + np.searchsorted(slots[start:stop], keys)] = read
        return table[np.searchsorted(slots, wanted)]

    def _read_one(self, fd: int, key: int, dtype: np.dtype[Any]) -> np.ndarray:
        """One slot read under its lock (``BPF_F_LOCK``); zeros (bitmap 0, busy 0) if the kernel will not."""
        if self._one is None or self._one.dtype != dtype:
            self._one = np.zeros(1, dtype)
        self._one_key.value = key
        if self._lib.bpf_map_lookup_elem_flags(fd, ctypes.byref(self._one_key), self._one.ctypes.data, BPF_F_LOCK):
            return np.zeros(1, dtype)[0]
        return self._one[0].copy()

    def _read_run(self, fd: int, first: int, n: int, dtype: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Entries ``first`` .. ``first + n - 1`` of an array map whose values have a bpf_spin_lock, each read
        under it (``BPF_F_LOCK``), in one batched lookup: the keys the kernel gave and their values."""
        values = np.zeros(n, dtype)
        keys = (ctypes.c_uint32 * n)()
        count = ctypes.c_uint32(n)
        prev = ctypes.c_uint32(first - 1)
        nxt = ctypes.c_uint32(0)
        opts = _BatchOpts(ctypes.sizeof(_BatchOpts), BPF_F_LOCK, 0)
        rc = self._lib.bpf_map_lookup_batch(fd, ctypes.byref(prev) if first else None, ctypes.byref(nxt), keys,
                                            values.ctypes.data, ctypes.byref(count), ctypes.byref(opts))
        got = int(count.value) if rc == 0 or count.value else 0
        return np.ctypeslib.as_array(keys)[:got].astype(np.int64), values[:got]

    def uplink_spans(self, iteration: int, workers: int) -> list[tuple[int, int, float, float]]:
        """What the program counted of each worker's first window of ``iteration`` (its first pool's worth of
        DATA): (worker, bytes, first arrival, last arrival), arrivals in ``time.monotonic`` seconds (the
        kernel's CLOCK_MONOTONIC), workers that sent none left out. One batched lookup of the iteration's
        ``workers`` consecutive entries, each read under its lock."""
        if self._meter_fd < 0:
            self._meter_fd = self.map_fds()["meter"]
        keys, rows = self._read_run(self._meter_fd, (iteration % TOKEN_WINDOW) * MAX_WORKERS, workers, METER_DTYPE)
        mine = (rows["iteration"] == iteration & 0xFFFFFFFF) & (rows["packets"] > 0)
        return [(int(key) % MAX_WORKERS, int(row["bytes"]), int(row["first_ns"]) * 1e-9, int(row["last_ns"]) * 1e-9)
                for key, row in zip(keys[mine], rows[mine], strict=True)]

    def completed_chunks(self, iteration: int) -> int:
        """Chunks of ``iteration`` that completed in the program (results mode; its ``ns_done`` count, 0 once
        the entry went on to another iteration of the token window)."""
        table = self._module[b"ns_done"]
        value = table[table.Key(iteration & (TOKEN_WINDOW - 1))]
        return int(value.count) if int(value.iteration) == iteration & 0xFFFFFFFF else 0

    def kernel_map_bytes(self) -> int:
        """Kernel memory the program's maps hold, as the kernel accounts it (``memlock`` in each map's
        fdinfo): what a pool of slots costs, whatever the model."""
        total = 0
        for fd in self.map_fds().values():
            with open(f"/proc/self/fdinfo/{fd}") as info:
                for line in info:
                    if line.startswith("memlock:"):
                        total += int(line.split()[1])
        return total

    def stats(self) -> dict[str, int]:
        """Counters summed over CPUs."""
        table = self._module[b"ns_stats"]
        return {name: int(sum(table[table.Key(i)])) for i, name in enumerate(STATS)}

    # ring buffer -------------------------------------------------------------------------------------
    @property
    def events_fd(self) -> int:
        """Readable when the timer callback has reported slots (for loop.add_reader)."""
        self._open_ring()
        return int(self._module[b"ns_events"].map_fd)

    def _open_ring(self) -> None:
        if self._ring_open:
            return

        def on_event(_ctx: Any, data: Any, size: int) -> int:
            if size >= _EVENT.size:   # one report per call: unpacked directly, not through numpy
                self._events.append(SlotEvent(*_EVENT.unpack(ctypes.string_at(data, _EVENT.size))[:9]))
            return 0

        self._on_event = on_event  # bcc keeps only a weak hold on the callback
        self._module[b"ns_events"].open_ring_buffer(on_event)
        self._ring_open = True

    def drain_events(self) -> list[SlotEvent]:
        """Slot reports written since the last call (non-blocking)."""
        self._open_ring()
        self._module.ring_buffer_consume()
        out, self._events = self._events, []
        return out

    def poll_events(self, timeout_ms: int) -> list[SlotEvent]:
        """Wait up to ``timeout_ms`` for slot reports (blocking; for tests and tools without a loop)."""
        self._open_ring()
        self._module.ring_buffer_poll(timeout_ms)
        out, self._events = self._events, []
        return out

    # direct runs ------------------------------------------------------------------------------------
    def test_run(self, frame: bytes, *, meta: bytes = b"") -> tuple[int, bytes]:
        """Run the program once on an Ethernet frame without an interface: (XDP verdict, frame after).
        ``meta`` (a multiple of 4 bytes, at most 32) is the frame's XDP metadata, not part of the result."""
        data_in = ctypes.create_string_buffer(meta + frame, len(meta) + len(frame))
        data_out = ctypes.create_string_buffer(len(meta) + len(frame) + 4096)   # a narrow DATA frame grows
        opts = _TestRunOpts()
        opts.sz = ctypes.sizeof(_TestRunOpts)
        opts.data_in = ctypes.cast(data_in, ctypes.c_void_p)
        opts.data_size_in = len(meta) + len(frame)
        opts.data_out = ctypes.cast(data_out, ctypes.c_void_p)
        opts.data_size_out = len(data_out)
        opts.repeat = 1
        if meta:
            ctx = _XdpMd(data=len(meta), data_end=len(meta) + len(frame))
            opts.ctx_in = ctypes.cast(ctypes.pointer(ctx), ctypes.c_void_p)
            opts.ctx_size_in = ctypes.sizeof(ctx)
        rc = self._lib.bpf_prog_test_run_opts(self.fd, ctypes.byref(opts))
        if rc != 0:
            raise LoaderError(f"BPF_PROG_TEST_RUN failed: {os.strerror(-rc)}")
        return int(opts.retval), data_out.raw[len(meta): opts.data_size_out]

    def run_widened(self, data: bytes, *, arrived_ns: int | None = None) -> tuple[int, bytes]:
        """A narrow-precision DATA datagram the program passed up for want of tailroom, widened to int32
        fixed point here (as the program converts) and run through the program: (verdict, datagram after),
        the datagram an AGG when it completed a slot, or the forwarded DATA of a cluster aggregator. The
        uplink meter counts it as it arrived: ``len(data)`` bytes at ``arrived_ns`` (``time.monotonic_ns``,
        now by default)."""
        frame = udp_frame(widen(data, self.layout.lanes), dport=self._port)
        when = time.monotonic_ns() if arrived_ns is None else arrived_ns
        verdict, out = self.test_run(frame, meta=arrival_meta(when, len(data)))
        return verdict, out[UDP_PAYLOAD:]

    def close(self) -> None:
        self.detach()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._module.cleanup()
        self._owner.cleanup()


XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = 1, 2, 3, 4
TIMER_INIT_KIND = LOADER_KINDS["TIMER_INIT"]
"""The loader's own kind (never on the wire): initialise the timer of the slot the frame names."""
UDP_PAYLOAD = 14 + 20 + 8
"""Where the datagram starts in the Ethernet/IPv4/UDP frames ``udp_frame`` builds."""


class _XdpMd(ctypes.Structure):
    """``struct xdp_md`` as BPF_PROG_TEST_RUN takes it: ``data`` is the metadata's length."""

    _fields_ = [("data", ctypes.c_uint32), ("data_end", ctypes.c_uint32), ("data_meta", ctypes.c_uint32),
                ("ingress_ifindex", ctypes.c_uint32), ("rx_queue_index", ctypes.c_uint32),
                ("egress_ifindex", ctypes.c_uint32)]


class PassProgram:
    """An XDP program that passes every frame. On a veth pair a frame an XDP program sends back out (XDP_TX)
    reaches the other end only if that end runs an XDP program itself (its NAPI receive path takes XDP
    frames; without one the kernel drops them), so emulation attaches this to the bridge's end of a gateway
    whose program returns results. A physical NIC needs nothing of the kind."""

    def __init__(self) -> None:
        from bcc import BPF

        self._bpf = BPF(text=b"int ns_pass(struct xdp_md *ctx) { return XDP_PASS; }")
        self._fn = self._bpf.load_func(b"ns_pass", BPF.XDP)
        self.attached: list[str] = []

    def attach(self, interface: str) -> None:
        """Attach in native mode to ``interface`` of the caller's network namespace."""
        self._bpf.attach_xdp(interface.encode(), self._fn, XDP_FLAGS_DRV_MODE)
        self.attached.append(interface)

    def close(self) -> None:
        """Unload (an interface it is still attached to keeps the program until the interface goes)."""
        self._bpf.cleanup()


def arrival_meta(ns: int, nbytes: int) -> bytes:
    """``struct ns_arrival``: when (CLOCK_MONOTONIC ns) and how large a datagram arrived, as XDP metadata."""
    return struct.pack("<QII", ns, nbytes, ARRIVAL_MAGIC)


def widen(data: bytes, lanes: int) -> bytes:
    """A DATA datagram's narrow lanes as int32 fixed point at its scale (the program's conversion, in numpy),
    flagged OVERFLOW where a lane leaves int32."""
    from netstorm.lan.header import HEADER_BYTES, HEADER_DTYPE, Flag, Precision
    from netstorm.lan.precision import to_fixed

    head = np.frombuffer(data[:HEADER_BYTES], HEADER_DTYPE).copy()
    precision = Precision(int(head["precision"][0]))
    if precision == Precision.FIXED32:
        return data
    fixed = to_fixed(np.frombuffer(data, np.uint8, offset=HEADER_BYTES), precision, int(head["wscale"][0]),
                     int(head["scale"][0]))
    if np.any(np.abs(fixed) > 2**31 - 1):
        head["flags"] |= int(Flag.OVERFLOW)
    head["precision"], head["wscale"] = 0, 0
    lanes_out = np.zeros(lanes, "<i4")
    lanes_out[: fixed.size] = np.clip(fixed, -(2**31), 2**31 - 1)[:lanes]
    return head.tobytes() + lanes_out.tobytes()


def udp_frame(payload: bytes, *, dport: int, sport: int = 40000, src: str = "10.0.0.2",
              dst: str = "10.0.0.1") -> bytes:
    """An Ethernet/IPv4/UDP frame around ``payload`` (for BPF_PROG_TEST_RUN)."""
    udp_len = 8 + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0x4000, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    csum = 0
    for (word,) in struct.iter_unpack("!H", ip):
        csum += word
    csum = (csum & 0xFFFF) + (csum >> 16)
    ip = ip[:10] + struct.pack("!H", ~csum & 0xFFFF) + ip[12:]
    eth = b"\x02\x00\x00\x00\x00\x01" + b"\x02\x00\x00\x00\x00\x02" + b"\x08\x00"
    return eth + ip + struct.pack("!HHHH", sport, dport, udp_len, 0) + payload

