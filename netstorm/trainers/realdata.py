"""Real data for DiLoCo's trainers: scikit-learn's bundled handwritten digits and a byte-level language
model on the Python standard library's own source files. Nothing is downloaded or generated.

- ``digits``: ``sklearn.datasets.load_digits`` (1797 8x8 images, 10 classes); a fixed fifth is held out
  (stratified), each DC samples its batches from its own shard of the rest. An MLP 64-1024-1024-10:
  1,126,410 parameters, 4.5 MB of float32, so a sync moves megabytes at the scenarios' rates.
- ``pylm``: the bytes of every ``*.py`` file under ``sysconfig``'s stdlib path, in sorted order; every
  tenth file is held out. A pre-norm causal transformer over bytes (vocabulary 256, context 64, width
  192, 3 layers, 4 heads): 1,445,824 parameters (5.8 MB). Accuracy is next-byte accuracy.

Evaluation is over a fixed held-out sample, the same at every DC and every step. Torch and scikit-learn
are imported only when a task is built.
"""

from __future__ import annotations

import dataclasses
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

DIGITS_HIDDEN = 1024
LM_CONTEXT, LM_WIDTH, LM_LAYERS, LM_HEADS = 64, 192, 3, 4
EVAL_SAMPLES = {"digits": 360, "pylm": 256}
NAMES = ("digits", "pylm")
"""The tasks, in ``--train`` order: the first is the default."""


@dataclasses.dataclass
class Task:
    name: str
    model: torch.nn.Module
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    """batch(step): this DC's inputs and targets of inner step ``step``."""
    loss: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[torch.nn.Module], tuple[float, float]]
    """Held-out (loss, accuracy)."""
    lr: float
    """The inner optimizer's (AdamW) learning rate."""

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def stdlib_corpus() -> tuple[bytes, bytes]:
    """(train, held-out) bytes of the standard library's Python sources: every tenth file is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train: list[bytes] = []
    held: list[bytes] = []
    for i, path in enumerate(files):
        (held if i % 10 == 9 else train).append(path.read_bytes())
    return b"".join(train), b"".join(held)


def build(name: str, dc_index: int, dcs: int, seed: int = 0, batch: int = 0) -> Task:
    """Task ``name`` for the DC at ``dc_index`` (0-based) of ``dcs``; the model's initial values come from
    ``seed`` (the same at every DC: the job starts from the lowest DC's anyway)."""
    if name == "digits":
        return _digits(dc_index, dcs, seed, batch or 64)
    if name == "pylm":
        return _pylm(dc_index, dcs, seed, batch or 16)
    raise ValueError(f"unknown task {name!r}: digits or pylm")


def _accuracy_loss(model: Any, x: Any, y: Any) -> tuple[float, float]:
    import torch

    with torch.no_grad():
        logits = model(x)
        flat = logits.reshape(-1, logits.shape[-1])
        target = y.reshape(-1)
        loss = torch.nn.functional.cross_entropy(flat, target)
        return float(loss), float((flat.argmax(-1) == target).float().mean())


def _ce(model: Any, x: Any, y: Any) -> Any:
    import torch

    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _digits(dc_index: int, dcs: int, seed: int, batch: int) -> Task:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    mine = np.arange(len(x_train)) % dcs == dc_index
    xs, ys = torch.tensor(x_train[mine]), torch.tensor(y_train[mine])
    xt, yt = torch.tensor(x_test), torch.tensor(y_test)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, DIGITS_HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(DIGITS_HIDDEN, DIGITS_HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(DIGITS_HIDDEN, 10))

    def sample(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.random.default_rng([seed, dc_index, step]).integers(0, len(xs), batch)
        return xs[rows], ys[rows]

    return Task("digits", model, sample, _ce, lambda m: _accuracy_loss(m, xt, yt), lr=1e-3)


class ByteLM:
    """A pre-norm causal transformer over bytes (built lazily so the module imports without torch)."""

    @staticmethod
    def make(seed: int) -> torch.nn.Module:
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(256, LM_WIDTH)
                self.position = nn.Embedding(LM_CONTEXT, LM_WIDTH)
                layer = nn.TransformerEncoderLayer(LM_WIDTH, LM_HEADS, 4 * LM_WIDTH, dropout=0.0,
                                                   batch_first=True, norm_first=True)
                self.blocks = nn.TransformerEncoder(layer, LM_LAYERS, enable_nested_tensor=False)
                self.norm = nn.LayerNorm(LM_WIDTH)
                self.head = nn.Linear(LM_WIDTH, 256)
                self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LM_CONTEXT),
                                     persistent=False)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                n = x.shape[1]
                h = self.embed(x) + self.position(torch.arange(n))
                mask: torch.Tensor = self.mask  # type: ignore[assignment]
                h = self.blocks(h, mask=mask[:n, :n], is_causal=True)
                return self.head(self.norm(h))

        torch.manual_seed(seed)
        return Model()


def _pylm(dc_index: int, dcs: int, seed: int, batch: int) -> Task:
    import torch

    train, held = stdlib_corpus()
    data = torch.frombuffer(bytearray(train), dtype=torch.uint8).long()
    test = torch.frombuffer(bytearray(held), dtype=torch.uint8).long()
    share = len(data) // dcs
    mine = data[dc_index * share:(dc_index + 1) * share]
    starts = np.random.default_rng(12345).integers(0, len(test) - LM_CONTEXT - 1, EVAL_SAMPLES["pylm"])
    xt = torch.stack([test[s:s + LM_CONTEXT] for s in starts])
    yt = torch.stack([test[s + 1:s + 1 + LM_CONTEXT] for s in starts])
    model = ByteLM.make(seed)

    def sample(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = np.random.default_rng([seed, dc_index, step]).integers(0, len(mine) - LM_CONTEXT - 1, batch)
        x = torch.stack([mine[o:o + LM_CONTEXT] for o in offsets])
        y = torch.stack([mine[o + 1:o + 1 + LM_CONTEXT] for o in offsets])
        return x, y

    return Task("pylm", model, sample, _ce, lambda m: _accuracy_loss(m, xt, yt), lr=1e-3)
