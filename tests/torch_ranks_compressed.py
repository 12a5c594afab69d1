"""One rank of the check that collectives other than gradient buckets stay exact under the job's compression
(tests/test_torch_compressed.py), against the values computed here for every rank from the same seeds."""
from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import netstorm.torch


def value(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + n)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(-2**40, 2**40, (n,), generator=gen).to(dtype)


def main() -> int:
    dist.init_process_group("netstorm", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = 0
    for dtype in (torch.float64, torch.int64, torch.int32, torch.bool, torch.float16):
        t = value(rank, dtype, 9)
        dist.broadcast(t, src=1)
        assert torch.equal(t, value(1, dtype, 9)), (dtype, t)
        checks += 1
    for dtype in (torch.int64, torch.int16, torch.float32):
        outs = [torch.empty(5, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, value(rank, dtype, 5))
        assert all(torch.equal(outs[r], value(r, dtype, 5)) for r in range(world)), dtype
        checks += 1
    flat = torch.empty(world * 4, dtype=torch.int32)
    dist.all_gather_into_tensor(flat, value(rank, torch.int32, 4))
    assert torch.equal(flat, torch.cat([value(r, torch.int32, 4) for r in range(world)]))
    checks += 1
    for dtype in (torch.int64, torch.int32):
        t = value(rank, dtype, 7)
        dist.all_reduce(t)
        total = torch.stack([value(r, dtype, 7).to(torch.int64) for r in range(world)]).sum(dim=0)
        assert torch.equal(t, total.to(dtype)), dtype
        checks += 1
    # with fp16 compression the nodes send float sums as float16: float all-reduces are as close as that
    half = os.environ.get("NETSTORM_COMPRESSION") == "fp16"
    t = value(rank, torch.float32, 1000)
    dist.all_reduce(t)
    expected = torch.stack([value(r, torch.float32, 1000).double() for r in range(world)]).sum(dim=0).float()
    assert torch.allclose(t, expected, rtol=2e-3 if half else 1e-6, atol=1e-1 if half else 1e-4)
    checks += 1
    for dtype in (torch.float16, torch.bfloat16):
        t = value(rank, dtype, 11)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        mean = torch.stack([value(r, dtype, 11).float() for r in range(world)]).sum(dim=0) / world
        if half:
            assert torch.allclose(t.float(), mean.to(dtype).float(), rtol=1e-2, atol=1e-1), (dtype, t, mean)
        else:
            assert torch.equal(t, mean.to(dtype)), (dtype, t, mean)
        checks += 1
    for op, reduce in ((dist.ReduceOp.MAX, torch.amax), (dist.ReduceOp.MIN, torch.amin)):
        for dtype in (torch.float32, torch.int64):  # an exact gather, reduced at every rank: no compression
            t = value(rank, dtype, 6)
            dist.all_reduce(t, op=op)
            assert torch.equal(t, reduce(torch.stack([value(r, dtype, 6) for r in range(world)]), dim=0)), (op, t)
            checks += 1
    # a partition of groups of different sizes ([0, 2] and [1] of three ranks): a gather's payload grows
    # with its group, and each group still gets its own ranks' values
    parts = [list(range(world))[i::2] for i in range(2)]
    group, _ = dist.new_subgroups_by_enumeration(parts)
    mine = next(p for p in parts if rank in p)
    m = value(rank, torch.int64, 5)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    assert torch.equal(m, torch.amax(torch.stack([value(r, torch.int64, 5) for r in mine]), dim=0)), m
    outs = [torch.empty(5, dtype=torch.float32) for _ in mine]
    dist.all_gather(outs, value(rank, torch.float32, 5), group=group)
    assert all(torch.equal(o, value(r, torch.float32, 5)) for o, r in zip(outs, mine, strict=True))
    checks += 1
    works = [dist.all_reduce(torch.full((3,), float(rank + i)), async_op=True) for i in range(4)]
    for w in works:
        w.wait()
    checks += 1
    dist.barrier()
    try:  # what sums cannot do is refused by name under compression too
        dist.send(torch.ones(2), dst=(rank + 1) % world)
    except NotImplementedError as exc:
        assert "send" in str(exc), exc
        checks += 1
    stats = netstorm.torch.stats()
    print(json.dumps({"rank": rank, "ok": True, "checks": checks, "iterations": stats.iterations}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
