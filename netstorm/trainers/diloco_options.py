"""What every per-DC DiLoCo trainer shares: its command line (but where it syncs through), its JSON lines,
and the digest of the global state, so NetStorm's rows and a peer system's rows compare line for line.

``diloco_run`` adds ``--socket`` (its DC's node); ``torchft_diloco`` adds the Lighthouse's address.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import IO, Any

import numpy as np

from netstorm.diloco import state
from netstorm.trainers.realdata import NAMES


def add_options(parser: argparse.ArgumentParser) -> None:
    """The task, schedule, outer optimizer, compression, pacing and output options."""
    parser.add_argument("--train", choices=NAMES, default=NAMES[0])
    parser.add_argument("--dc-index", type=int, required=True, help="this DC's shard of the data (0-based)")
    parser.add_argument("--dcs", type=int, required=True, help="DCs sharing the data")
    parser.add_argument("--sync-every", type=int, required=True)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--fragment-delay", type=int, default=0)
    parser.add_argument("--outer-compression", choices=("none", "fp16", "int8", "int4"), default="none")
    parser.add_argument("--error-feedback", action="store_true")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--straggler-s", type=float, default=None)
    parser.add_argument("--no-rejoin", action="store_true",
                        help="register no state snapshot (cheaper pushes; no rejoin, every DC starts from --seed)")
    parser.add_argument("--compute-s", type=float, default=0.0)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=0, help="samples per inner step (0: the task's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", required=True)


def emit(out: IO[str], kind: str, **fields: Any) -> None:
    out.write(json.dumps({"kind": kind, **fields}) + "\n")
    out.flush()


def global_digest(params: Sequence[Any], momentum: Sequence[Any], outer_steps: int) -> bytes:
    """``netstorm.diloco.state.digest`` of tensors (or arrays) given one per parameter in the model's order:
    the global parameters, then the outer optimizer's momentum buffers (zeros before its first step), as
    one flat float32 vector each, and the count of outer steps."""
    flat = np.concatenate([_numpy(p) for p in params]) if params else np.zeros(0, np.float32)
    buffers = np.concatenate([_numpy(m) for m in momentum]) if momentum else np.zeros(0, np.float32)
    return state.digest(flat, [buffers], outer_steps)


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, np.float32).reshape(-1)
