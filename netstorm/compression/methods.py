"""The compression methods (``compression``): one registry that the options, the trainer wire, the
node, the LAN tier's rounds, the client and the trainers' ``--compression`` read.

An entry says what the rest of the system must do differently for the method (its flags); the method's
own encoding lives in ``netstorm.compression.codecs`` and ``session``, which ask the registry rather
than the name. Reading the registry loads nothing but this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

import msgspec

from netstorm.errors import ConfigError
from netstorm.registry import Registry


@dataclass(frozen=True)
class Method:
    summary: str
    """One line for the CLI's help and the docs."""
    sparse: bool = False
    """Votes on indices, then sends values at the agreed ones: two rounds per iteration, integer vote and
    value tensors registered beside the model's, and the LAN tier's integer rounds."""
    consensus: bool = False
    """The roots threshold the vote counts at a (``fediac_votes``), so the layout covers a; otherwise an
    index with any vote is kept (a = 1, the union)."""
    quantized: bool = False
    """Values travel as b-bit integers with a scale: b derived from a dense first round when
    ``fediac_bits`` is 0, and one GIA may serve ``fediac_gia_reuse`` iterations."""
    float16: bool = False
    """The nodes send float chunks as float16."""


COMPRESSION: Registry[Method] = Registry("compression", {
    "none": Method("float32 sums"),
    "fediac": Method("FediAC: consensus sparsification, b-bit values", sparse=True, consensus=True, quantized=True),
    "topk": Method("top-k: each contributor's k largest, their union summed", sparse=True),
    "fp16": Method("float16 chunks between DCs", float16=True),
}, ConfigError)

METHODS = COMPRESSION.names
"""Every method's name, the default first: ``--compression`` choices and the trainer wire's values."""

WireName = Annotated[str, msgspec.Meta(pattern="^(" + "|".join(re.escape(m) for m in METHODS) + ")$")]
"""A method's name on the trainer wire: decoding refuses any other."""


def method(name: object) -> Method:
    """The registry's entry for ``name``; ConfigError naming every method otherwise."""
    return COMPRESSION.get_entry(name)
