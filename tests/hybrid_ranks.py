"""One rank of the hybrid hook's compression check (tests/test_torch_hybrid.py), run under torchrun.

DDP runs on the DC's gloo group with ``netstorm_hook`` behind a wrapper that records, for every bucket,
this rank's own gradient (before the hook sums it inside the DC) and what the hook returned; the test
replays the compression on those records with numpy. The job's compression comes from the environment
(NETSTORM_COMPRESSION, NETSTORM_FEDIAC_*), as the hook resolves it.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from netstorm.torch import NetStormHookState, netstorm_hook

FEATURES, HIDDEN, CLASSES, BATCH = 24, 48, 5, 16


def make_model() -> nn.Module:
    torch.manual_seed(7)  # the same initial values at every rank: DDP broadcasts within the DC only
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def make_data(ranks: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A separable task from a fixed teacher: [steps, ranks, batch, features] and its labels."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(steps, ranks, BATCH, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    return x, (x @ teacher).argmax(dim=-1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks-per-dc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_dc = args.ranks_per_dc
    groups = [dist.new_group(list(range(dc * per_dc, (dc + 1) * per_dc))) for dc in range(world // per_dc)]
    dc = rank // per_dc
    model = make_model()
    elements = sum(p.numel() for p in model.parameters())
    state = NetStormHookState.connect(groups[dc], timeout=120.0, round_elements=elements)
    ddp = DistributedDataParallel(model, process_group=groups[dc], bucket_cap_mb=4 * elements / 2**20 + 1.0)
    records: list[dict[str, Any]] = []

    def hook(hook_state: NetStormHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        own = bucket.buffer().detach().clone().numpy()  # before the hook sums it in place inside the DC
        index = bucket.index()

        def done(fut: Future[torch.Tensor]) -> torch.Tensor:
            value = fut.value()
            records.append({"index": index, "own": own, "result": value.detach().clone().numpy()})
            return value

        return netstorm_hook(hook_state, bucket).then(done)

    hook.__annotations__ = netstorm_hook.__annotations__
    ddp.register_comm_hook(state, hook)
    x, y = make_data(world, args.steps)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    params = [torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()]
    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        loss = loss_fn(ddp(x[step, rank]), y[step, rank])
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy())
    np.savez(Path(args.out) / f"rank-{rank}.npz", params=np.stack(params), losses=np.array(losses),
             index=np.array([r["index"] for r in records]), own=np.stack([r["own"] for r in records]),
             result=np.stack([r["result"] for r in records]))
    stats = state.stats()
    if stats is not None:
        print(f"rank {rank}: {stats.compressed} compressed pieces, {stats.iterations} node iterations", flush=True)
    dist.barrier()
    state.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
