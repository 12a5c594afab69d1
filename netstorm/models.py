"""Parameter layouts of the models the benchmarks synchronize, without importing torch.

Shapes are torchvision's (``alexnet``: 61,100,840 parameters; ``resnet50``: 25,557,032, batch-norm
scale and shift included, running statistics excluded as they are buffers, not gradients), in the
order ``named_parameters()`` yields them. Any other model is a plain parameter count.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from netstorm.errors import PolicyError

Shape = tuple[int, ...]
FLOAT32_BYTES = 4
MODELS = ("alexnet", "resnet50")


@dataclass(frozen=True)
class ModelLayout:
    """Named float32 tensors in registration order."""

    name: str
    tensors: tuple[tuple[str, Shape], ...]

    @property
    def sizes(self) -> list[int]:
        """Elements per tensor."""
        return [math.prod(shape) for _, shape in self.tensors]

    @property
    def params(self) -> int:
        return sum(self.sizes)

    @property
    def bytes(self) -> int:
        """Bytes of one float32 copy of every parameter."""
        return self.params * FLOAT32_BYTES


def _conv(name: str, out_ch: int, in_ch: int, k: int, bias: bool) -> list[tuple[str, Shape]]:
    out: list[tuple[str, Shape]] = [(f"{name}.weight", (out_ch, in_ch, k, k))]
    if bias:
        out.append((f"{name}.bias", (out_ch,)))
    return out


def _linear(name: str, out_f: int, in_f: int) -> list[tuple[str, Shape]]:
    return [(f"{name}.weight", (out_f, in_f)), (f"{name}.bias", (out_f,))]


def _bn(name: str, channels: int) -> list[tuple[str, Shape]]:
    return [(f"{name}.weight", (channels,)), (f"{name}.bias", (channels,))]


def alexnet() -> ModelLayout:
    """torchvision.models.alexnet(num_classes=1000)."""
    tensors = [
        *_conv("features.0", 64, 3, 11, True),
        *_conv("features.3", 192, 64, 5, True),
        *_conv("features.6", 384, 192, 3, True),
        *_conv("features.8", 256, 384, 3, True),
        *_conv("features.10", 256, 256, 3, True),
        *_linear("classifier.1", 4096, 256 * 6 * 6),
        *_linear("classifier.4", 4096, 4096),
        *_linear("classifier.6", 1000, 4096),
    ]
    return ModelLayout("alexnet", tuple(tensors))


def resnet50() -> ModelLayout:
    """torchvision.models.resnet50(num_classes=1000): bottleneck blocks [3, 4, 6, 3], expansion 4."""
    tensors = [*_conv("conv1", 64, 3, 7, False), *_bn("bn1", 64)]
    inplanes = 64
    for stage, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            tensors += _conv(f"{prefix}.conv1", planes, inplanes, 1, False) + _bn(f"{prefix}.bn1", planes)
            tensors += _conv(f"{prefix}.conv2", planes, planes, 3, False) + _bn(f"{prefix}.bn2", planes)
            tensors += _conv(f"{prefix}.conv3", planes * 4, planes, 1, False) + _bn(f"{prefix}.bn3", planes * 4)
            if block == 0:
                tensors += _conv(f"{prefix}.downsample.0", planes * 4, inplanes, 1, False)
                tensors += _bn(f"{prefix}.downsample.1", planes * 4)
            inplanes = planes * 4
    tensors += _linear("fc", 1000, 2048)
    return ModelLayout("resnet50", tuple(tensors))


_SIZE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)(?P<suffix>[kKmMgG]?)")
_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


FORWARD_SHARE = 1 / 3
"""The share of a training step's compute time spent in forward; backward takes the rest (it computes
two gradients per layer to forward's one output, so it costs about twice as much)."""


def backward_yields(sizes: Sequence[int], compute_s: float) -> list[tuple[int, float]]:
    """When backward hands over each layer's gradient in a step of ``compute_s`` seconds: (layer index,
    seconds from the step's start), last layer first. Forward takes FORWARD_SHARE of the time, and each
    layer's share of backward is its share of the parameters."""
    total = sum(sizes)
    forward_s = compute_s * FORWARD_SHARE
    backward_s = compute_s - forward_s
    out: list[tuple[int, float]] = []
    done = 0
    for i in reversed(range(len(sizes))):
        done += sizes[i]
        out.append((i, forward_s + backward_s * done / total))
    return out


def layout(spec: str) -> ModelLayout:
    """``alexnet``, ``resnet50``, or a parameter count (``15275210``, ``1e6``, ``61.1M``) as one tensor;
    ``COUNT/LAYERS`` (``0.5M/8``) splits the count into that many near-equal layers, which is what lets a
    trainer overlap a plain-size model's synchronization with its backward pass."""
    key = spec.strip().lower()
    if key == "alexnet":
        return alexnet()
    if key == "resnet50":
        return resnet50()
    size, slash, layers_text = spec.strip().partition("/")
    match = _SIZE.fullmatch(size.strip())
    if match is None:
        raise PolicyError(f"unknown model {spec!r}: give {', '.join(MODELS)}, a parameter count such as 1e6, "
                          f"or a count and a layer count such as 1e6/8")
    count = float(match["number"]) * _SUFFIX[match["suffix"].lower()]
    if not count.is_integer() or count < 1:
        raise PolicyError(f"model size {spec!r} is not a whole, positive number of parameters")
    total = int(count)
    if not slash:
        return ModelLayout(f"{total} params", (("params", (total,)),))
    if not layers_text.strip().isdigit() or not 1 <= int(layers_text) <= total:
        raise PolicyError(f"model {spec!r}: the layer count after '/' must be a whole number from 1 to {total}")
    layers = int(layers_text)
    base, extra = divmod(total, layers)
    return ModelLayout(f"{total} params in {layers} layers",
                       tuple((f"layer{i}", (base + (i < extra),)) for i in range(layers)))
