"""How a result travels back to the LAN workers: float32 lanes, or, for a compressed job's integer rounds,
exact integers of the narrowest width that holds them, or a bitmap.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Final

import numpy as np

from netstorm.lan.errors import WireError
from netstorm.lan.header import Precision, lanes_for_bytes
from netstorm.lan.layout import EdgeLayout

RESULT_DTYPES: Final = {Precision.FIXED32: "<f4", Precision.INT8: "i1", Precision.INT16: "<i2",
                        Precision.INT32: "<i4", Precision.BITMAP: "u1", Precision.SCALED32: "<i4"}
"""The numpy dtype of a RESULT datagram's lanes at each precision it may carry."""
EXACT_INTEGER: Final = 2**24
"""Largest integer a result carries: a worker gathers result lanes as float32, exact up to here."""
_INTEGERS: Final = (Precision.INT8, Precision.INT16, Precision.INT32)


class Format(enum.Enum):
    FLOAT = "float"
    INTEGER = "integer"
    BITMAP = "bitmap"


@dataclasses.dataclass(frozen=True)
class ResultWire:
    """How each tensor of one iteration's result travels: its format and the chunks of its lanes."""

    sizes: tuple[int, ...]
    """Elements of each result tensor."""
    formats: tuple[Format, ...]
    layout: EdgeLayout
    """The lanes of each tensor (a bitmap's: one byte per 8 elements), cut into datagrams."""

    @classmethod
    def float32(cls, layout: EdgeLayout) -> ResultWire:
        """Every tensor of ``layout`` as float32 lanes, chunked as the data: what a dense iteration returns."""
        return cls(layout.sizes, tuple(Format.FLOAT for _ in layout.sizes), layout)

    @classmethod
    def of(cls, sizes: Sequence[int], formats: Sequence[Format], *, lanes: int) -> ResultWire:
        """``sizes`` elements in ``formats``; ``lanes``: the int32 lanes a datagram carries (the LAN's MTU)."""
        sizes, formats = tuple(int(s) for s in sizes), tuple(formats)
        if len(sizes) != len(formats):
            raise WireError(f"{len(sizes)} result tensors but {len(formats)} formats")
        per = lanes_for_bytes(4 * lanes, Precision.BITMAP) if all(f is Format.BITMAP for f in formats) else lanes
        extents = [-(-s // 8) if f is Format.BITMAP else s for s, f in zip(sizes, formats, strict=True)]
        return cls(sizes, formats, EdgeLayout.uniform(extents, scale=0, lanes=per, pool=1))

    def allowed(self) -> np.ndarray:
        """(tensor, precision code) -> whether a RESULT datagram of that tensor may carry that precision."""
        out = np.zeros((len(self.formats), 256), bool)
        for t, form in enumerate(self.formats):
            if form is Format.INTEGER:
                out[t, [int(p) for p in _INTEGERS]] = True
            elif form is Format.BITMAP:
                out[t, int(Precision.BITMAP)] = True
            else:   # float32 lanes, or the aggregate's own fixed-point lanes from the aggregation program
                out[t, [int(Precision.FIXED32), int(Precision.SCALED32)]] = True
        return out

    def encode(self, tensor: int, values: np.ndarray) -> tuple[Precision, np.ndarray]:
        """Tensor ``tensor``'s result (its elements) as lanes: the precision they travel at and their values
        (``layout.sizes[tensor]`` of them). WireError when an integer or bitmap tensor holds anything its
        format cannot carry exactly (a fraction, an integer beyond 2**24, a bitmap value other than 0/1)."""
        flat = np.asarray(values).reshape(-1)
        if flat.size != self.sizes[tensor]:
            raise WireError(f"result tensor {tensor} has {flat.size} elements, the wire says {self.sizes[tensor]}")
        form = self.formats[tensor]
        if form is Format.FLOAT:
            return Precision.FIXED32, flat.astype(np.float32)
        if form is Format.BITMAP:
            if not np.all((flat == 0) | (flat == 1)):
                raise WireError(f"result tensor {tensor} travels as a bitmap but holds values other than 0 and 1")
            return Precision.BITMAP, np.packbits(flat.astype(bool), bitorder="little")
        whole = np.rint(flat.astype(np.float64))
        if not np.array_equal(whole, flat) or (whole.size and np.max(np.abs(whole)) > EXACT_INTEGER):
            raise WireError(f"result tensor {tensor} travels as integers but holds a fraction or an integer "
                            f"beyond 2**24")
        low, high = (float(whole.min()), float(whole.max())) if whole.size else (0.0, 0.0)
        for precision in _INTEGERS:
            info = np.iinfo(np.dtype(RESULT_DTYPES[precision]))
            if info.min <= low and high <= info.max:
                return precision, whole.astype(RESULT_DTYPES[precision])
        raise AssertionError("every integer up to 2**24 fits int32")

    def decode(self, lanes: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Each tensor's elements (float32, exact) from its lanes as gathered (float32, one per lane); float32
        lanes are returned as they are (no copy: a worker gathers each iteration's result into its own
        matrix)."""
        out = []
        for size, form, part in zip(self.sizes, self.formats, lanes, strict=True):
            flat = np.asarray(part).reshape(-1)
            if form is Format.BITMAP:
                bits = np.unpackbits(flat.astype(np.uint8), count=size, bitorder="little")
                out.append(bits.astype(np.float32))
            else:
                out.append(flat.astype(np.float32, copy=False))
        return out
