"""Training tasks for the emulator's torch-ddp trainer: a model and data generated here from a seed.

Nothing is downloaded and no data set package is needed: every rank draws the same task from the same
seed and takes its own shard of each step's batch; a held-out set, drawn from the same distribution,
measures accuracy. Torch is imported only when a task is built, so the CLI lists the tasks without it.

- ``blobs``: ten Gaussian classes in 64 dimensions whose means overlap, an MLP 64-1000-1000-10 (about
  1.08 M parameters, 4.3 MB of gradient per step: the size the emulation results use); its accuracy
  climbs over tens of steps towards the classes' overlap limit.
- ``shapes``: 16x16 noisy images of six shapes (bars in four directions, squares, crosses) at random
  places, a small CNN (about 38 K parameters): a real convolutional model, light on the WAN.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    parameters: int
    """Trainable parameters of the task's model (float32 elements of one gradient)."""
    lr: float
    batch: int
    """Samples per rank per step."""
    target_accuracy: float
    """The held-out accuracy whose first crossing the results report as time to accuracy."""


BLOBS_HIDDEN = 1000
BLOBS_FEATURES = 64
BLOBS_CLASSES = 10
SHAPES_SIDE = 16
SHAPES_CLASSES = 6

TASKS: dict[str, TaskSpec] = {
    "blobs": TaskSpec("blobs", BLOBS_FEATURES * BLOBS_HIDDEN + BLOBS_HIDDEN + BLOBS_HIDDEN * BLOBS_HIDDEN
                      + BLOBS_HIDDEN + BLOBS_HIDDEN * BLOBS_CLASSES + BLOBS_CLASSES,
                      lr=0.05, batch=32, target_accuracy=0.8),
    "shapes": TaskSpec("shapes", (1 * 16 * 9 + 16) + (16 * 32 * 9 + 32) + (32 * 4 * 4 * 64 + 64)
                       + (64 * SHAPES_CLASSES + SHAPES_CLASSES), lr=0.1, batch=32, target_accuracy=0.5),
}
"""The tasks, in ``--train`` order: the first is the default."""


def build_model(name: str, seed: int) -> torch.nn.Module:
    """The task's model with initial values drawn from ``seed``."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if name == "blobs":
        return nn.Sequential(nn.Linear(BLOBS_FEATURES, BLOBS_HIDDEN), nn.ReLU(),
                             nn.Linear(BLOBS_HIDDEN, BLOBS_HIDDEN), nn.ReLU(),
                             nn.Linear(BLOBS_HIDDEN, BLOBS_CLASSES))
    if name == "shapes":
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, SHAPES_CLASSES))
    raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")


def _blobs(gen: torch.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    means = torch.randn(BLOBS_CLASSES, BLOBS_FEATURES, generator=torch.Generator().manual_seed(1)) * 0.35
    labels = torch.randint(0, BLOBS_CLASSES, (count,), generator=gen)
    return means[labels] + torch.randn(count, BLOBS_FEATURES, generator=gen), labels


def _shapes(gen: torch.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    side = SHAPES_SIDE
    labels = torch.randint(0, SHAPES_CLASSES, (count,), generator=gen)
    images = 0.4 * torch.randn(count, 1, side, side, generator=gen)
    rows = torch.randint(3, side - 3, (count,), generator=gen)
    cols = torch.randint(3, side - 3, (count,), generator=gen)
    span = torch.arange(-3, 4)
    for i in range(count):
        r, c, kind = int(rows[i]), int(cols[i]), int(labels[i])
        if kind == 0:
            images[i, 0, r, c + span] += 1.0
        elif kind == 1:
            images[i, 0, r + span, c] += 1.0
        elif kind == 2:
            images[i, 0, r + span, c + span] += 1.0
        elif kind == 3:
            images[i, 0, r + span, c - span] += 1.0
        elif kind == 4:
            images[i, 0, r - 2:r + 3, c - 2:c + 3] += 1.0
        else:
            images[i, 0, r, c + span] += 1.0
            images[i, 0, r + span, c] += 1.0
    return images, labels


def make_data(name: str, seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` samples of the task and their labels, from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if name == "blobs":
        return _blobs(gen, count)
    if name == "shapes":
        return _shapes(gen, count)
    raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Held-out mean cross-entropy and accuracy (a fraction 0-1)."""
    import torch

    with torch.no_grad():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(dim=-1) == y).float().mean().item()
    return float(loss), float(accuracy)


def parameter_count(model: Any) -> int:
    return sum(int(p.numel()) for p in model.parameters() if p.requires_grad)


def parameters_digest(model: Any) -> str:
    """A hash of every parameter's bytes: equal at every DC after a step exactly when the models are."""
    import hashlib

    import torch

    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in model.parameters()])
    return hashlib.blake2b(flat.numpy().tobytes(), digest_size=16).hexdigest()
