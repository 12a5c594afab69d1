"""The layout a node builds from its trainer's tensors and the job's options, and the tensors of a model an
operator names: one function for both, so the hash ``netstorm layout-hash`` prints for the scheduler's
``layout_hash`` is the one every node of the job computes for a trainer registering that model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from netstorm import models
from netstorm.compression.methods import COMPRESSION
from netstorm.compression.options import VOTES, CompressionOptions
from netstorm.errors import ConfigError, LayoutError, NetStormError
from netstorm.layout import Layout, TensorSpec, dtype_name


def job_layout(specs: Sequence[TensorSpec], chunk_size: int, compression: str = "none",
               node_compression: str = "none", votes: int = 0, workers: int = 1) -> Layout:
    """The layout of ``specs`` registered with the trainer's ``compression`` at a node whose own option is
    ``node_compression``: float chunks travel as float16 when either says so; with a consensus compression
    (FediAC) of the trainer's and its vote tensor, the roots' threshold a follows from ``votes`` (0: from the
    job's ``workers``) and the hash covers it."""
    fp16 = any(COMPRESSION.get_entry(c).float16 for c in (compression, node_compression))
    gia = None
    if COMPRESSION.get_entry(compression).consensus and any(spec.name == VOTES for spec in specs):
        gia = (VOTES, CompressionOptions(compression, votes=votes).votes_of(workers))
    return Layout.build(specs, chunk_size, "float16" if fp16 else "float32", gia)


def model_specs(model: str) -> list[TensorSpec]:
    """The tensors of ``model``: a model name or size as trainers take it (``alexnet``, ``resnet50``,
    ``61.1M``, ``1e6/8``: float32 tensors, as the synthetic trainer registers them), or a ``.npz`` file of
    the model's arrays (``numpy.savez(path, **model)``: names, shapes and dtypes, read without the data)."""
    path = Path(model)
    if model.endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as archive:
                return [_spec(name, archive, path) for name in archive.files]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model file {path}: {exc}") from None
    try:
        layout = models.layout(model)
    except NetStormError as exc:
        raise ConfigError(f"model {model!r}: {exc}") from None
    return [TensorSpec(name, shape, "float32") for name, shape in layout.tensors]


def _spec(name: str, archive: np.lib.npyio.NpzFile, path: Path) -> TensorSpec:
    """One array's entry of ``archive``: its header only (shape and dtype), never its data."""
    zipped = archive.zip
    assert zipped is not None  # an archive np.load opened from a path
    with zipped.open(f"{name}.npy") as member:
        version = np.lib.format.read_magic(member)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(member)
    try:
        return TensorSpec(name, tuple(int(n) for n in shape), dtype_name(dtype))
    except LayoutError as exc:
        raise ConfigError(f"model file {path}: {exc}") from None
