"""Buffers of the LAN tier's per-batch paths with their pages in place before the first write.

A gateway's agent allocates per iteration a model's worth of exact sums and of RESULT datagrams, and each
buffer's pages were first touched one at a time as chunks completed: a page fault (and, on a VM, an exit)
per 4 KiB inside the batch that took the chunk. ``populated`` asks the kernel for every page of a new
buffer in one call (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14), which costs the zeroing the faults
would have cost and none of the traps. Where the call is not available the buffer is returned as
``np.empty`` would (its pages then fault as before): the contents are never relied on either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from typing import Final

import numpy as np

MADV_POPULATE_WRITE: Final = 23
PAGE: Final = mmap.PAGESIZE
MIN_BYTES: Final = 256 * 1024
"""Smaller buffers come from the allocator's own (already touched) memory: not worth a system call."""

_madvise = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int
except (OSError, AttributeError):   # no libc with madvise: plain buffers
    _madvise = None
_supported = _madvise is not None


def populated(shape: int | tuple[int, ...], dtype: np.dtype | type | str) -> np.ndarray:
    """``np.empty(shape, dtype)`` with every whole page of it already mapped and writable (contents
    unspecified, as ``np.empty``'s)."""
    global _supported
    out = np.empty(shape, dtype)
    if not _supported or out.nbytes < MIN_BYTES:
        return out
    assert _madvise is not None
    start = -(-out.ctypes.data // PAGE) * PAGE
    stop = (out.ctypes.data + out.nbytes) // PAGE * PAGE
    if stop > start and _madvise(start, stop - start, MADV_POPULATE_WRITE) != 0:
        _supported = False   # an older kernel (EINVAL): fault page by page from now on
    return out
