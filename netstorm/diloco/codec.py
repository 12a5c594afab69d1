"""Outer compression of a fragment's pseudo-gradient, with optional error feedback.

- ``none``: float32 values, summed by the nodes.
- ``fp16``: the nodes send the values as float16 (the job's ``fp16`` registration); each DC rounds its
  own values to float16 first, so error feedback knows what was sent.
- ``int8`` / ``int4``: two rounds. First every DC adds a one-hot of its largest |value| to a histogram
  (``compression.quantize``), which gives every DC the same peak m; then each DC sends
  q = stochastic_round(v * Q / m), |q| <= Q = 2**(b-1) - 1, as integers the nodes sum exactly. The lane
  is the narrowest that holds N * Q: int8 for int4 (up to 18 DCs), int16 for int8 (up to 258), so int4
  puts 1 byte per value on the wire and int8 2 bytes (a node sums lanes, so the bits of a value cannot
  be packed tighter than the sum needs).

With error feedback, what a DC did not send (its value minus what it sent, decoded) is added to its
next pseudo-gradient of the same fragment.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from netstorm.compression import quantize
from netstorm.errors import ConfigError

Method = Literal["none", "fp16", "int8", "int4"]
METHODS: tuple[Method, ...] = ("none", "fp16", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
LANES = {"int8": "int16", "int4": "int8"}


@dataclasses.dataclass(frozen=True)
class OuterCompression:
    method: Method = "none"
    error_feedback: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"outer_compression must be one of {', '.join(METHODS)}, got {self.method!r}")

    @property
    def quantized(self) -> bool:
        return self.method in BITS

    @property
    def rounds(self) -> int:
        """Node iterations per fragment sync: the peak round first when quantized."""
        return 2 if self.quantized else 1

    @property
    def levels(self) -> int:
        """Q: the largest |q| one DC sends."""
        return 2 ** (BITS[self.method] - 1) - 1

    @property
    def lane(self) -> str:
        return LANES[self.method]

    def max_contributors(self) -> int:
        """How many DCs' integers the lane sums without overflow."""
        if not self.quantized:
            return 1 << 30
        return int(np.iinfo(np.dtype(self.lane)).max) // self.levels

    def wire_bytes_per_value(self) -> int:
        if self.quantized:
            return int(np.dtype(self.lane).itemsize)
        return 2 if self.method == "fp16" else 4

    def to_send(self, target: np.ndarray) -> np.ndarray:
        """Unquantized methods: the float32 values a DC pushes (what the nodes will carry)."""
        if self.method == "fp16":
            return target.astype(np.float16).astype(np.float32)
        return target

    def quantize(self, target: np.ndarray, peak: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The integers q a DC pushes for the agreed ``peak``, and what they decode to (q / f)."""
        if peak <= 0.0:
            zero = np.zeros(target.shape, np.dtype(self.lane))
            return zero, np.zeros_like(target)
        factor = self.levels / peak
        q = np.clip(quantize.stochastic_round(target * factor, rng), -self.levels, self.levels)
        return q.astype(self.lane), (q / factor).astype(np.float32)

    def dequantize(self, total: np.ndarray, peak: float, weight: int) -> np.ndarray:
        """The mean of the contributors' values from the sum of their integers."""
        if peak <= 0.0:
            return np.zeros(total.shape, np.float32)
        return (np.asarray(total, np.float64) * (peak / self.levels) / weight).astype(np.float32)
