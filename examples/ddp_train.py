"""DDP, unchanged, on the ``netstorm`` process-group backend: one rank per process, started by torchrun.

    netstorm local examples/job.toml --run-dir RUN &      # scheduler + one node per DC (ids 0, 1, 2)
    NETSTORM_TORCH_SOCKET='RUN/node-{rank}.sock' torchrun --nproc-per-node 3 examples/ddp_train.py --out OUT

Each rank finds its DC's node (the ``torch_socket`` template, or NETSTORM_SOCKET), trains the MLP of
``train_mlp.py`` on its shard of the same generated data with ``DistributedDataParallel``, and writes
its parameters after every step to ``OUT/rank-<r>.npz``; ``--check`` (rank 0, after a barrier) trains one
process on the union of the shards from the same initial values and compares every step. DDP averages
the ranks' gradients, so with equal shards the two agree up to float rounding.

The same script runs without torchrun when RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set (the
env:// rendezvous). ``--backend gloo`` runs it on gloo for comparison. On a failed collective it prints
one JSON line ``{"error": ..., "type": ...}`` and exits with status 3.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mlp import make_data, make_model, make_optimizer, train_reference


def flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="netstorm", choices=["netstorm", "gloo"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may take")
    parser.add_argument("--out", required=True, help="directory for rank-<r>.npz")
    parser.add_argument("--check", action="store_true", help="rank 0 compares with one-process training")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--atol", type=float, default=1e-5)
    parser.add_argument("--stall", default=None, metavar="RANK:STEP",
                        help="that rank waits before that step's backward until killed (fault tests)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.backend == "netstorm":
        import netstorm.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_data(args.seed, world, args.batch, args.steps)
    model = make_model(args.seed + 1 + rank)  # DDP broadcasts rank 0's values at construction
    ddp = DistributedDataParallel(model)
    opt = make_optimizer(ddp, args.lr)
    loss_fn = nn.CrossEntropyLoss()
    stall = tuple(int(v) for v in args.stall.split(":")) if args.stall else None
    params, losses = [flat(model)], []
    try:
        for step in range(args.steps):
            opt.zero_grad()
            loss = loss_fn(ddp(x[step, rank]), y[step, rank])
            if stall == (rank, step):
                print(json.dumps({"stalled": step, "rank": rank}), flush=True)
                time.sleep(3600)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            params.append(flat(model))
            print(json.dumps({"step": step, "rank": rank, "loss": losses[-1]}), flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        np.savez(Path(args.out) / f"rank-{rank}.npz", params=np.stack(params), losses=np.array(losses))
        dist.barrier()
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc), "type": type(exc).__name__, "rank": rank}), flush=True)
        os._exit(3)  # the process group is broken: skip its teardown
    ok = True
    if args.check and rank == 0:
        runs = [np.load(Path(args.out) / f"rank-{r}.npz")["params"] for r in range(world)]
        ref, _ = train_reference(runs[0][0], x, y, args.lr)
        for step in range(args.steps + 1):
            close = all(np.allclose(run[step], ref[step], rtol=args.rtol, atol=args.atol) for run in runs)
            diff = max(float(np.abs(run[step] - ref[step]).max()) for run in runs)
            print(json.dumps({"check": step, "max_diff": diff, "close": close}), flush=True)
            ok &= close
        print(("MATCH" if ok else "MISMATCH") + f": {world} ranks on {args.backend} vs one process, "
              f"{args.steps} steps", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
