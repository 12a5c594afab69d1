"""Room in the kernel's slab for bpf_timer allocations, made from process context.

Since 6.18 ``bpf_timer_init`` allocates its ``struct bpf_hrtimer`` with ``kmalloc_nolock()``, whatever the
calling context. That allocator only takes objects already free in the size class's slabs: on this
machine's kernel it never grows the cache, so on a quiet host, once the accounted 192-byte class has no
free object left, every further ``bpf_timer_init`` answers ENOMEM until something else happens to free
objects of that class (a busy host does so all the time, which is why the failure comes and goes).

The loader therefore makes the room itself. Creating pipes allocates ``struct pipe_inode_info`` from the
same accounted size class through the ordinary allocator, which does grow the cache; closing them frees
those objects onto the current CPU's partial list, where the next ``kmalloc_nolock()`` on that CPU finds
them. The priming thread stays pinned to one CPU meanwhile. Both structure sizes are read from the
kernel's BTF, so a kernel where they fall into different classes is reported instead of guessed at.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import cache
from types import TracebackType

VMLINUX_BTF = "/sys/kernel/btf/vmlinux"
BTF_KIND_STRUCT = 4
#: pipes created and closed per call of SlabRoom.make: a few slabs' worth, within one CPU's partial list
PIPES_PER_ROUND = 64


def kmalloc_class(size: int) -> int:
    """The generic kmalloc cache an object of ``size`` bytes comes from (x86-64 classes: powers of two from
    8, plus 96 and 192)."""
    if size <= 0:
        raise ValueError(f"object size must be positive, not {size}")
    if 64 < size <= 96:
        return 96
    if 128 < size <= 192:
        return 192
    return max(8, 1 << (size - 1).bit_length())


@cache
def struct_size(name: str) -> int | None:
    """``sizeof(struct name)`` in the running kernel, from its BTF; None when BTF or libbpf is missing."""
    if not os.path.exists(VMLINUX_BTF):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1")
    except OSError:
        return None
    lib.btf__load_vmlinux_btf.restype = ctypes.c_void_p
    lib.btf__find_by_name_kind.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
    lib.btf__resolve_size.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.btf__resolve_size.restype = ctypes.c_longlong
    lib.btf__free.argtypes = [ctypes.c_void_p]
    lib.btf__free.restype = None
    btf = lib.btf__load_vmlinux_btf()
    if not btf:
        return None
    try:
        type_id = lib.btf__find_by_name_kind(btf, name.encode(), BTF_KIND_STRUCT)
        size = lib.btf__resolve_size(btf, type_id) if type_id > 0 else -1
        return int(size) if size > 0 else None
    finally:
        lib.btf__free(btf)


def pipes_share_the_timer_class() -> bool:
    """Whether a pipe's inode info comes from the same kmalloc class as a bpf_timer's allocation."""
    timer, pipe = struct_size("bpf_hrtimer"), struct_size("pipe_inode_info")
    return timer is not None and pipe is not None and kmalloc_class(timer) == kmalloc_class(pipe)


class SlabRoom:
    """Pins the calling thread to one CPU while open; ``make`` frees fresh objects of the timer's class there.

    Used as a context manager around a burst of ``bpf_timer_init`` calls; the thread's CPU affinity is
    restored on exit."""

    def __init__(self) -> None:
        self.usable = pipes_share_the_timer_class()
        self.rounds = 0
        self._affinity: set[int] | None = None

    def __enter__(self) -> SlabRoom:
        self._affinity = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(self._affinity)})
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._affinity is not None:
            os.sched_setaffinity(0, self._affinity)
            self._affinity = None

    def make(self, pipes: int = PIPES_PER_ROUND) -> bool:
        """Free up to ``pipes`` objects of the timer's class on this CPU; False when this cannot help."""
        if not self.usable:
            return False
        made: list[tuple[int, int]] = []
        try:
            for _ in range(pipes):
                made.append(os.pipe())
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not made:
                raise
        finally:
            for read_end, write_end in made:
                os.close(read_end)
                os.close(write_end)
        self.rounds += 1
        return True
