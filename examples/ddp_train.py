"""DDP, unchanged, on the ``netstorm`` process-group backend: one rank per process, started by torchrun.

    netstorm local scenario.toml --run-dir RUN --trainers 2 &          # scheduler + one node per DC
    # one torchrun per DC (each its own rendezvous), each rank a trainer of its DC's node:
    NETSTORM_SOCKET=RUN/node-1.sock torchrun --nproc-per-node 2 --master-port 29501 examples/ddp_train.py --out OUT
    NETSTORM_SOCKET=RUN/node-2.sock torchrun --nproc-per-node 2 --master-port 29502 examples/ddp_train.py --out OUT
    # or one torchrun across the DCs: rank r finds the node of DC r // 2 + 1
    NETSTORM_TORCH_SOCKET='RUN/node-{dc}.sock' NETSTORM_TORCH_RANKS_PER_DC=2 \
        torchrun --nproc-per-node 4 examples/ddp_train.py --out OUT

Either way the process group spans the job: ``get_world_size()`` counts every DC's ranks and
``get_rank()`` is unique across the job.

Each rank finds its DC's node (the ``torch_socket`` template, or NETSTORM_SOCKET), trains the MLP of
``train_mlp.py`` on its shard of the same generated data with ``DistributedDataParallel``, and writes
its parameters after every step to ``OUT/rank-<r>.npz``; ``--check`` (rank 0, after a barrier) trains one
process on the union of the shards from the same initial values and compares every step. DDP averages
the ranks' gradients, so with equal shards the two agree up to float rounding.

``--compile`` trains ``torch.compile(DDP(model))``; ``--shard fsdp`` shards the model with FSDP2's
``fully_shard`` over the whole job, ``--shard hsdp`` over a 2-D mesh (DCs x ranks per DC) that shards
inside each DC over gloo (the DC's own rendezvous) and replicates across DCs over netstorm.

With NETSTORM_ON_DC_LOSS=continue the survivors of a lost DC train on (``mean_hook`` averages over
the ranks each sum counts), and ``netstorm.torch.step_boundary`` before every step lets the DC, restarted
with its command line, rejoin: its ranks load the live model, optimizer state and step there, and every
rank builds its DDP wrapper again. ``--hold-for-rejoin STEP`` has the ranks wait at that step until a
restarted DC is back (fault tests). The same script runs without torchrun when RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT are set (the env:// rendezvous). ``--backend gloo`` runs it on gloo for comparison. On a
failed collective it prints one JSON line ``{"error": ..., "type": ...}`` and exits with status 3.
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
    """Every parameter's full values (a sharded one gathered: a collective, so every rank calls it)."""
    parts = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().reshape(-1).cpu())
    return torch.cat(parts).numpy().copy()


def flat_state(opt: torch.optim.Optimizer) -> np.ndarray:
    """Every tensor of the optimizer's state (SGD's momentum buffers), in parameter order (a sharded one
    gathered: a collective, so every rank calls it)."""
    state = opt.state_dict()["state"]
    values = [value for key in sorted(state) for value in state[key].values() if isinstance(value, torch.Tensor)]
    parts = [(v.full_tensor() if hasattr(v, "full_tensor") else v).detach().reshape(-1).float().cpu() for v in values]
    return torch.cat(parts).numpy().copy() if parts else np.zeros(0, np.float32)


def shard(model: nn.Module, how: str, world: int) -> nn.Module:
    """FSDP2 over the job (``fsdp``) or HSDP (``hsdp``): a (DCs, ranks per DC) mesh whose ranks of one DC
    share a row (the job's ranks are numbered DC by DC), sharded in the row over gloo, replicated down
    the columns over netstorm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if how == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    else:
        per_dc = int(os.environ["LOCAL_WORLD_SIZE"])
        mesh = init_device_mesh("cpu", (world // per_dc, per_dc), mesh_dim_names=("replicate", "shard"),
                                backend_override={"shard": "gloo"})
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


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
    parser.add_argument("--compile", action="store_true", help="train torch.compile(DDP(model))")
    parser.add_argument("--shard", choices=["ddp", "fsdp", "hsdp"], default="ddp",
                        help="DDP, FSDP2 over the job, or FSDP2 sharded in the DC and replicated across DCs")
    parser.add_argument("--stall", default=None, metavar="RANK:STEP",
                        help="that rank waits before that step's backward until killed (fault tests)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the model trains (cuda: the GPU LOCAL_RANK picks; collectives are staged "
                             "through host memory)")
    parser.add_argument("--hold-for-rejoin", type=int, default=None, metavar="STEP",
                        help="with on_dc_loss continue: at that step's boundary, run barriers until a restarted "
                             "DC rejoins (fault tests)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.shard != "ddp":
        parser.error("--device cuda trains DDP (--shard ddp); the sharded meshes here are CPU meshes")
    torch.set_num_threads(1)
    if args.backend == "netstorm":
        import netstorm.torch  # registers the backend
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    print(json.dumps({"rank": rank, "world": world, "launcher_rank": int(os.environ.get("RANK", rank))}),
          flush=True)
    x, y = make_data(args.seed, world, args.batch, args.steps)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        x, y = x.to(device), y.to(device)
    group = dist.distributed_c10d._get_default_group()
    rejoinable = args.backend == "netstorm" and args.shard == "ddp" and \
        getattr(getattr(group, "stage", None), "on_dc_loss", "error") == "continue"

    def wrap(model: nn.Module) -> nn.Module:
        ddp: nn.Module = DistributedDataParallel(model)
        if rejoinable:
            # the survivors' mean after a lost DC: DDP itself divides by the group's size
            ddp.register_comm_hook(group, netstorm.torch.mean_hook)  # type: ignore[operator]
        return torch.compile(ddp) if args.compile else ddp  # type: ignore[return-value]

    if args.shard == "ddp":
        model = make_model(args.seed + 1 + rank).to(device)  # DDP broadcasts rank 0's values at construction
        # rejoinable: built at the first step boundary, where a restarted DC's rank first meets the others
        ddp: nn.Module | None = None if rejoinable else wrap(model)
    else:
        model = make_model(args.seed + 1)  # FSDP keeps each rank's values: every rank starts alike
        ddp = shard(model, args.shard, world)
    opt = make_optimizer(model, args.lr)
    loss_fn = nn.CrossEntropyLoss()
    stall = tuple(int(v) for v in args.stall.split(":")) if args.stall else None
    params, first = [flat(model)], 0
    losses: list[float] = []
    step = 0
    try:
        while step < args.steps:
            if rejoinable:
                boundary = netstorm.torch.step_boundary(model, opt, step)
                if step == args.hold_for_rejoin and not boundary.rejoined:
                    print(json.dumps({"holding": step, "rank": rank}), flush=True)
                while step == args.hold_for_rejoin and not boundary.rejoined:
                    dist.barrier()  # node iterations for the restarted DC's node to join in
                    boundary = netstorm.torch.step_boundary(model, opt, step)
                if boundary.loaded:  # a restarted DC's rank: the live model and optimizer state from here on
                    step = first = boundary.step
                    print(json.dumps({"rejoined": step, "rank": rank}), flush=True)
                if ddp is None or boundary.rejoined:
                    ddp = wrap(model)
                    if not losses:  # what this rank trains from (DDP's construction broadcast rank 0's values)
                        params = [flat(model)]
            assert ddp is not None
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
            step += 1
        Path(args.out).mkdir(parents=True, exist_ok=True)
        np.savez(Path(args.out) / f"rank-{rank}.npz", params=np.stack(params), losses=np.array(losses),
                 first=first, optimizer=flat_state(opt))
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
