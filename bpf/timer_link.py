"""The bcc 0.26 link step for programs that use bpf_timer; nothing else in the project knows about it.

bcc 0.26 cannot hand a map pointer to ``bpf_timer_init`` nor relocate a callback's address, and the kernel
wants BTF func_info for a program with a callback. So:

1. the timer map lives in an *owner* module as a shared table (one function there touches it, which makes
   bcc create the map with BTF, required for ``struct bpf_timer`` and ``struct bpf_spin_lock``);
2. the *program* module declares it ``extern`` and receives ``-DTIMER_MAP_FD=<fd>``, passing
   ``(void *)bpf_pseudo_fd(1, TIMER_MAP_FD)`` as the map, and ``-DTIMER_CB_MARK=<constant>``, passing
   ``(void *)TIMER_CB_MARK`` as the callback; the callback is an ordinary one-parameter function reading
   its value pointer from r3;
3. here the callback's instructions are appended after the program's, the marked ``ld_imm64`` becomes a
   ``BPF_PSEUDO_FUNC`` load (src_reg 4, imm = relative instruction offset), a small BTF (program global,
   callback static) is built with libbpf and the result loaded with ``bpf_prog_load`` and two func_info
   records.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from netstorm.errors import NetStormError

INSN_BYTES = 8
LD_IMM64 = 0x18
BPF_PSEUDO_FUNC = 4
BTF_INT_SIGNED = 1
BTF_FUNC_STATIC = 0
BTF_FUNC_GLOBAL = 1
PROG_TYPE_XDP = 6
LOG_BYTES = 1 << 22


class LoaderError(NetStormError):
    """A program could not be compiled, linked or loaded; the message says what is missing or wrong."""


class _ProgLoadOpts(ctypes.Structure):
    """libbpf 1.1's ``struct bpf_prog_load_opts`` (``sz`` tells libbpf which fields we know)."""

    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("attempts", ctypes.c_int),
        ("expected_attach_type", ctypes.c_int),
        ("prog_btf_fd", ctypes.c_uint32),
        ("prog_flags", ctypes.c_uint32),
        ("prog_ifindex", ctypes.c_uint32),
        ("kern_version", ctypes.c_uint32),
        ("attach_btf_id", ctypes.c_uint32),
        ("attach_prog_fd", ctypes.c_uint32),
        ("attach_btf_obj_fd", ctypes.c_uint32),
        ("fd_array", ctypes.c_void_p),
        ("func_info", ctypes.c_void_p),
        ("func_info_cnt", ctypes.c_uint32),
        ("func_info_rec_size", ctypes.c_uint32),
        ("line_info", ctypes.c_void_p),
        ("line_info_cnt", ctypes.c_uint32),
        ("line_info_rec_size", ctypes.c_uint32),
        ("log_level", ctypes.c_uint32),
        ("log_size", ctypes.c_uint32),
        ("log_buf", ctypes.c_char_p),
    ]


def libbpf() -> Any:
    """libbpf.so.1 (installed with bcc) with the prototypes this module calls."""
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise LoaderError(f"libbpf.so.1 not found ({exc}); install Debian's libbpf1 (with python3-bpfcc)") from None
    vp, cint, cstr = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    lib.btf__new_empty.restype = vp
    lib.btf__new_empty.argtypes = []
    lib.btf__add_int.argtypes = [vp, cstr, ctypes.c_size_t, cint]
    lib.btf__add_ptr.argtypes = [vp, cint]
    lib.btf__add_func_proto.argtypes = [vp, cint]
    lib.btf__add_func_param.argtypes = [vp, cstr, cint]
    lib.btf__add_func.argtypes = [vp, cstr, cint, cint]
    lib.btf__load_into_kernel.argtypes = [vp]
    lib.btf__fd.argtypes = [vp]
    lib.btf__free.argtypes = [vp]
    lib.btf__free.restype = None
    lib.bpf_prog_load.argtypes = [cint, cstr, cstr, vp, ctypes.c_size_t, ctypes.POINTER(_ProgLoadOpts)]
    return lib


def new_mark() -> int:
    """A 64-bit constant unlikely to occur in real code, marking where the callback's address goes."""
    return (0x7E11 << 48) | secrets.randbits(48)


def link_callback(prog: bytes, callback: bytes, mark: int) -> bytes:
    """``prog`` followed by ``callback``, every ``ld_imm64 rX, mark`` turned into a BPF_PSEUDO_FUNC load."""
    if len(prog) % INSN_BYTES or len(callback) % INSN_BYTES:
        raise LoaderError("instruction streams must be whole 8-byte instructions")
    out = bytearray(prog + callback)
    n_prog = len(prog) // INSN_BYTES
    lo, hi = mark & 0xFFFFFFFF, mark >> 32
    found = 0
    i = 0
    while i < n_prog - 1:
        code, regs, off, imm = struct.unpack_from("<BBhi", out, i * INSN_BYTES)
        if code != LD_IMM64:
            i += 1
            continue
        imm_hi = struct.unpack_from("<i", out, (i + 1) * INSN_BYTES + 4)[0]
        if (imm & 0xFFFFFFFF) == lo and (imm_hi & 0xFFFFFFFF) == hi:
            if regs >> 4:
                raise LoaderError(f"marked ld_imm64 at instruction {i} already carries src_reg {regs >> 4}")
            # callback starts at n_prog; the call-relative offset counts from the instruction after ld_imm64
            struct.pack_into("<BBhi", out, i * INSN_BYTES, code, (BPF_PSEUDO_FUNC << 4) | (regs & 0x0F), off,
                             n_prog - (i + 1))
            struct.pack_into("<i", out, (i + 1) * INSN_BYTES + 4, 0)
            found += 1
        i += 2
    if not found:
        raise LoaderError(f"callback mark 0x{mark:016x} not found in the program; was TIMER_CB_MARK used?")
    return bytes(out)


@dataclass
class _Btf:
    handle: int
    fd: int
    prog_id: int
    callback_id: int


def _build_btf(lib: Any, prog_name: str, callback_name: str) -> _Btf:
    """int prog(int *ctx) [global]; static int callback(void *map, int *key, void *value)."""
    btf = lib.btf__new_empty()
    if not btf:
        raise LoaderError(f"btf__new_empty failed: {os.strerror(ctypes.get_errno())}")
    ids: list[int] = []

    def check(value: int, what: str) -> int:
        if value < 0:
            lib.btf__free(btf)
            raise LoaderError(f"libbpf {what} failed: {os.strerror(-value)}")
        ids.append(value)
        return value

    int_id = check(lib.btf__add_int(btf, b"int", 4, BTF_INT_SIGNED), "btf__add_int")
    int_ptr = check(lib.btf__add_ptr(btf, int_id), "btf__add_ptr")
    void_ptr = check(lib.btf__add_ptr(btf, 0), "btf__add_ptr")
    prog_proto = check(lib.btf__add_func_proto(btf, int_id), "btf__add_func_proto")
    check(lib.btf__add_func_param(btf, b"ctx", int_ptr), "btf__add_func_param")
    prog_id = check(lib.btf__add_func(btf, prog_name.encode(), BTF_FUNC_GLOBAL, prog_proto), "btf__add_func")
    cb_proto = check(lib.btf__add_func_proto(btf, int_id), "btf__add_func_proto")
    for param, type_id in ((b"map", void_ptr), (b"key", int_ptr), (b"value", void_ptr)):
        check(lib.btf__add_func_param(btf, param, type_id), "btf__add_func_param")
    cb_id = check(lib.btf__add_func(btf, callback_name.encode(), BTF_FUNC_STATIC, cb_proto), "btf__add_func")
    err = lib.btf__load_into_kernel(btf)
    if err < 0:
        lib.btf__free(btf)
        raise LoaderError(f"loading the callback's BTF into the kernel failed: {os.strerror(-err)}")
    return _Btf(handle=btf, fd=lib.btf__fd(btf), prog_id=prog_id, callback_id=cb_id)


def load_with_callback(
    prog: bytes,
    callback: bytes,
    mark: int,
    *,
    prog_name: str,
    callback_name: str,
    prog_type: int = PROG_TYPE_XDP,
    license: str = "GPL",
) -> int:
    """Link ``callback`` into ``prog`` and load it; returns the program fd (the caller closes it)."""
    lib = libbpf()
    insns = link_callback(prog, callback, mark)
    n_prog = len(prog) // INSN_BYTES
    btf = _build_btf(lib, prog_name, callback_name)
    try:
        func_info = (ctypes.c_uint32 * 4)(0, btf.prog_id, n_prog, btf.callback_id)
        buf = ctypes.create_string_buffer(insns)

        def attempt(log_level: int, log: Any) -> int:
            opts = _ProgLoadOpts()
            opts.sz = ctypes.sizeof(_ProgLoadOpts)
            opts.prog_btf_fd = btf.fd
            opts.func_info = ctypes.cast(func_info, ctypes.c_void_p)
            opts.func_info_cnt = 2
            opts.func_info_rec_size = 8
            if log is not None:
                opts.log_level = log_level
                opts.log_size = LOG_BYTES
                opts.log_buf = ctypes.cast(log, ctypes.c_char_p)
            return int(lib.bpf_prog_load(prog_type, prog_name[:15].encode(), license.encode(),
                                         ctypes.cast(buf, ctypes.c_void_p), len(insns) // INSN_BYTES,
                                         ctypes.byref(opts)))

        fd = attempt(0, None)
        if fd >= 0:
            return fd
        code = -fd
        if code == errno.EPERM:
            raise LoaderError(f"loading {prog_name} needs root (CAP_BPF and CAP_NET_ADMIN)")
        log = ctypes.create_string_buffer(LOG_BYTES)
        attempt(1, log)
        keep = int(os.environ.get("NS_BPF_LOG_LINES", "25"))
        tail = "\n".join(log.value.decode(errors="replace").strip().splitlines()[-keep:])
        raise LoaderError(f"the kernel rejected {prog_name} with callback {callback_name}: "
                          f"{os.strerror(code)}\n{tail}")
    finally:
        lib.btf__free(btf.handle)


def compile_and_load(
    owner_text: str,
    prog_text: str,
    *,
    prog_name: str,
    callback_name: str,
    timer_map: str,
    cflags: Sequence[str] = (),
) -> tuple[Any, Any, int]:
    """Compile the owner module (defining the shared ``timer_map``) and the program module with bcc, then
    link and load. Returns (owner BPF, program BPF, program fd); the two BPF objects own the maps."""
    try:
        import bcc
    except Exception as exc:
        raise LoaderError(f"bcc is not importable ({exc}); run scripts/setup.sh (installs python3-bpfcc and "
                          "links it into .venv)") from None
    kdir = f"/lib/modules/{os.uname().release}/build"
    if not os.path.exists(os.path.join(kdir, "include")):
        raise LoaderError(f"kernel headers missing at {kdir}; scripts/setup.sh links Debian's linux-headers there")
    flags = [*cflags, "-Wno-unused-value", "-Wno-pointer-sign"]
    try:
        owner = bcc.BPF(text=owner_text.encode(), cflags=flags)
    except Exception as exc:
        raise LoaderError(f"compiling the timer map owner failed: {exc}") from None
    map_fd = int(bcc.libbcc.lib.bpf_table_fd(owner.module, timer_map.encode()))
    if map_fd < 0:
        owner.cleanup()
        raise LoaderError(f"the owner module defines no table {timer_map!r}")
    mark = new_mark()
    try:
        defines = [f"-DTIMER_MAP_FD={map_fd}", f"-DTIMER_CB_MARK={mark}ULL"]
        module = bcc.BPF(text=prog_text.encode(), cflags=[*flags, *defines])
    except Exception as exc:
        owner.cleanup()
        raise LoaderError(f"compiling {prog_name} failed: {exc}") from None
    try:
        fd = load_with_callback(module.dump_func(prog_name.encode()), module.dump_func(callback_name.encode()), mark,
                                prog_name=prog_name, callback_name=callback_name)
    except Exception:
        module.cleanup()
        owner.cleanup()
        raise
    return owner, module, fd
