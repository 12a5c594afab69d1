"""Hybrid: gloo (or NCCL) inside each DC, NetStorm across DCs, through DDP's comm hook.

    netstorm local scenario.toml --run-dir RUN &        # one node per DC, trainers = 1 (the DC's leader)
    NETSTORM_TORCH_SOCKET='RUN/rank-{rank}.sock' torchrun --nproc-per-node 4 examples/hybrid_hook.py \
        --ranks-per-dc 2 --out OUT --check

The job's ranks are split into DCs of ``--ranks-per-dc`` consecutive ranks. DDP runs on the DC's own
process group (gloo here; NCCL on GPUs), so its buckets are summed inside the DC at LAN speed; the comm
hook hands each DC sum to the DC's leader (the DC's first rank), whose node sums the DCs over the WAN,
and the result comes back to every rank of the DC, divided by the ranks of the whole job. In a real
deployment each DC runs its own torchrun (``--nnodes`` of that DC only) and its leader's
NETSTORM_SOCKET names that DC's node; here one torchrun on one host plays every DC, and only the
leaders connect, each through the ``torch_socket`` template (``RUN/rank-0.sock`` and ``RUN/rank-2.sock``
are links to the two nodes' sockets).

Writes ``OUT/rank-<r>.npz`` (parameters after every step); ``--check`` (rank 0) compares them with one
process training on the union of every rank's shard, as ``ddp_train.py`` does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mlp import make_data, make_model, make_optimizer, train_reference

from netstorm.torch import NetStormHookState, netstorm_hook


def flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks-per-dc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_dc = args.ranks_per_dc
    if world % per_dc:
        parser.error(f"{world} ranks do not split into DCs of {per_dc}")
    # every rank creates every DC's group, in the same order (torch.distributed requires it)
    groups = [dist.new_group(list(range(dc * per_dc, (dc + 1) * per_dc))) for dc in range(world // per_dc)]
    dc = rank // per_dc
    state = NetStormHookState.connect(groups[dc], timeout=args.timeout)
    x, y = make_data(args.seed, world, args.batch, args.steps)
    model = make_model(args.seed)  # same initial values everywhere: DDP's broadcast is within the DC only
    ddp = DistributedDataParallel(model, process_group=groups[dc])
    ddp.register_comm_hook(state, netstorm_hook)
    opt = make_optimizer(ddp, args.lr)
    loss_fn = nn.CrossEntropyLoss()
    params = [flat(model)]
    for step in range(args.steps):
        opt.zero_grad()
        loss_fn(ddp(x[step, rank]), y[step, rank]).backward()
        opt.step()
        params.append(flat(model))
        print(json.dumps({"step": step, "rank": rank, "dc": dc}), flush=True)
    np.savez(Path(args.out) / f"rank-{rank}.npz", params=np.stack(params))
    dist.barrier()
    ok = True
    if args.check and rank == 0:
        runs = [np.load(Path(args.out) / f"rank-{r}.npz")["params"] for r in range(world)]
        ref, _ = train_reference(runs[0][0], x, y, args.lr)
        for step in range(args.steps + 1):
            close = all(np.allclose(run[step], ref[step], rtol=1e-4, atol=1e-5) for run in runs)
            ok &= close
            print(json.dumps({"check": step, "close": close,
                              "max_diff": max(float(np.abs(run[step] - ref[step]).max()) for run in runs)}), flush=True)
        print(("MATCH" if ok else "MISMATCH") + f": {world} ranks in {world // per_dc} DCs (gloo inside, netstorm "
              f"across) vs one process, {args.steps} steps", flush=True)
    state.close()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
