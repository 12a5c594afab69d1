"""Train a small MLP across DCs through NetStorm and check it against single-process training.

    python examples/train_mlp.py --dcs 3 --steps 10

starts ``netstorm local`` with 3 DCs on loopback and one trainer per DC (a thread of this process,
each with its own connection to its DC's node and its own shard of a classification data set
generated here from a seed: nothing is downloaded), then trains the same model in one process on the
union of the shards, and compares the parameters after every step.
With equal batches per DC, the mean over DCs of each DC's mean-loss gradient is the gradient of the
mean loss over the union, so the two runs agree up to float rounding.

    python examples/train_mlp.py --socket RUN/node-3.sock --shard 2 --shards 3 --steps 10 --out p.npz

is one DC's trainer (the form the emulator runs in each DC); it prints one JSON line per step.
Each DC builds its model from a different seed on purpose: the optimizer wrapper's registration makes
every DC start from the values the DCs agree on.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import nn

FEATURES, HIDDEN, CLASSES = 12, 32, 4


def make_data(seed: int, shards: int, batch: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (steps, shards, batch, FEATURES) and labels from a random linear teacher, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, shards, batch, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    noise = 0.3 * torch.randn(steps, shards, batch, CLASSES, generator=gen)
    return x, (x @ teacher + noise).argmax(dim=-1)


def make_model(seed: int) -> nn.Module:
    """The MLP with initial values drawn from ``seed`` (its own generator: safe in threads)."""
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.3, 0.3, generator=gen)
    return model


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def train_dc(socket: str, shard: int, args: argparse.Namespace,
             report: Callable[[int, float], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One DC: its shard of every step's batch, gradients averaged over the DCs through its node.

    Returns the parameters after registration and after every step, and the losses of every step.
    """
    import netstorm
    from netstorm.torch import DistributedOptimizer

    x, y = make_data(args.seed, args.shards, args.batch, args.steps)
    model = make_model(args.seed + 1 + shard)
    loss_fn = nn.CrossEntropyLoss()
    kv = netstorm.connect(socket, timeout=args.timeout)
    try:
        opt = DistributedOptimizer(make_optimizer(model, args.lr), model.named_parameters(), kv,
                                   overlap=args.overlap)
        params, losses = [flat(model)], []
        for step in range(args.steps):
            opt.zero_grad()
            loss = loss_fn(model(x[step, shard]), y[step, shard])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            params.append(flat(model))
            if report is not None:
                report(step, losses[-1])
    finally:
        kv.close()
    return np.stack(params), np.array(losses)


def train_reference(initial: np.ndarray, x: torch.Tensor, y: torch.Tensor, lr: float) -> tuple[np.ndarray, np.ndarray]:
    """Single-process training on the union of the shards, from the DCs' agreed initial values."""
    model = make_model(0)  # values replaced by ``initial``
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.tensor(initial), model.parameters())  # a copy
    opt = make_optimizer(model, lr)
    loss_fn = nn.CrossEntropyLoss()
    params, losses = [flat(model)], []
    for step in range(x.shape[0]):
        opt.zero_grad()
        loss = loss_fn(model(x[step].reshape(-1, FEATURES)), y[step].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        params.append(flat(model))
    return np.stack(params), np.array(losses)


def drive(args: argparse.Namespace) -> int:
    """Cluster + one trainer per DC + the reference; 0 when every step matches within tolerance."""
    from netstorm.trainers.launch import local_cluster

    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="netstorm-mlp-"))
    args.shards = args.dcs
    with local_cluster(args.dcs, run_dir, ready_timeout=args.timeout) as cluster, \
            ThreadPoolExecutor(args.dcs) as pool:
        futures = [pool.submit(train_dc, cluster.socket(node), i, args) for i, node in enumerate(cluster.node_ids)]
        runs = [future.result() for future in futures]
    for node, (params, losses) in zip(cluster.node_ids, runs, strict=True):
        np.savez(run_dir / f"dc-{node}.npz", params=params, losses=losses)
    x, y = make_data(args.seed, args.dcs, args.batch, args.steps)
    ref_params, ref_losses = train_reference(runs[0][0][0], x, y, args.lr)
    ok = True
    print(f"{'step':>4} {'loss (1 process)':>16} {'loss (DC mean)':>15} {'max |param diff|':>17}")
    for step in range(args.steps + 1):
        diff = max(float(np.abs(params[step] - ref_params[step]).max()) for params, _ in runs)
        close = all(np.allclose(params[step], ref_params[step], rtol=args.rtol, atol=args.atol) for params, _ in runs)
        ok &= close
        losses = ("", "") if step == 0 else (f"{ref_losses[step - 1]:.6f}",
                                             f"{np.mean([dc_losses[step - 1] for _, dc_losses in runs]):.6f}")
        print(f"{step:>4} {losses[0]:>16} {losses[1]:>15} {diff:>17.3g}{'' if close else '  MISMATCH'}")
    print(("MATCH" if ok else "MISMATCH") + f": {args.dcs} DCs vs one process on the union, {args.steps} steps, "
          f"rtol {args.rtol:g}, atol {args.atol:g}; run dir {run_dir}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dcs", type=int, default=3, help="DCs of the local cluster (driver mode)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="samples per DC per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--overlap", action="store_true",
                        help="push each gradient as soon as backward produced it (see DistributedOptimizer)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the cluster or a step")
    parser.add_argument("--run-dir", default=None, help="driver: where sockets, logs and results go")
    parser.add_argument("--socket", default=None, help="trainer mode: this DC's node socket")
    parser.add_argument("--shard", type=int, default=0, help="trainer mode: this DC's shard index")
    parser.add_argument("--shards", type=int, default=1, help="trainer mode: number of DCs")
    parser.add_argument("--out", default="params.npz", help="trainer mode: parameters after every step")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.socket is not None:
        if not 0 <= args.shard < args.shards:
            parser.error(f"--shard must be in [0, {args.shards}), got {args.shard}")
        params, losses = train_dc(args.socket, args.shard, args, lambda step, loss: print(
            json.dumps({"step": step, "loss": loss, "shard": args.shard}), flush=True))
        np.savez(args.out, params=params, losses=losses)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
