"""One rank of the collectives check (tests/test_torch_launch.py): every collective on the ``netstorm``
backend against gloo on the same inputs (a gloo group over the same ranks, on torchrun's store), and
the clear errors of what sums cannot do. Prints one JSON line with the checks that passed."""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import netstorm.torch
from netstorm.errors import UnsupportedCollective

R = dist.ReduceOp


def value(rank: int, dtype: torch.dtype, n: int, *, small: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + n)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    if small:  # products and sums exact in any order
        return torch.randint(1, 4, (n,), generator=gen).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(-2**40, 2**40, (n,), generator=gen).to(dtype)


def main() -> int:
    dist.init_process_group("netstorm", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    done: list[str] = []

    def same(name: str, run: Callable[[Any], Any], exact: bool = True) -> None:
        ours, theirs = run(None), run(gloo)
        pairs = list(zip(ours, theirs, strict=True)) if isinstance(ours, list) else [(ours, theirs)]
        for a, b in pairs:
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            if exact:
                assert torch.equal(a, b), (name, a, b)
            else:
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-4), (name, a, b)
        done.append(name)

    def all_reduce(dtype: torch.dtype, op: object, small: bool = False) -> Callable[[Any], torch.Tensor]:
        def run(group: Any) -> torch.Tensor:
            t = value(rank, dtype, 7, small=small)
            dist.all_reduce(t, op=op, group=group)
            return t
        return run

    same("all_reduce SUM float32", all_reduce(torch.float32, R.SUM), exact=False)
    same("all_reduce SUM int64", all_reduce(torch.int64, R.SUM))
    same("all_reduce AVG float32", all_reduce(torch.float32, R.AVG, small=True), exact=False)
    for op in ("MIN", "MAX", "PRODUCT"):
        same(f"all_reduce {op} float32", all_reduce(torch.float32, getattr(R, op), small=op == "PRODUCT"))
        same(f"all_reduce {op} int32", all_reduce(torch.int32, getattr(R, op), small=op == "PRODUCT"))
    for op in ("BAND", "BOR", "BXOR"):
        same(f"all_reduce {op} int64", all_reduce(torch.int64, getattr(R, op)))

    def reduce_scatter(group: Any) -> torch.Tensor:
        out = torch.empty(3)
        dist.reduce_scatter(out, [value(rank, torch.float32, 3, small=True) + r for r in range(world)],
                            group=group)
        return out
    same("reduce_scatter SUM", reduce_scatter)

    def reduce_scatter_tensor(op: object) -> Callable[[Any], torch.Tensor]:
        def run(group: Any) -> torch.Tensor:
            out = torch.empty(4)
            dist.reduce_scatter_tensor(out, value(rank, torch.float32, 4 * world, small=True), op=op,
                                       group=group)
            return out
        return run
    same("reduce_scatter_tensor SUM", reduce_scatter_tensor(R.SUM))
    same("reduce_scatter_tensor MAX", reduce_scatter_tensor(R.MAX))

    def all_gather(group: Any) -> list[torch.Tensor]:
        outs = [torch.empty(5, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(outs, value(rank, torch.int64, 5), group=group)
        return outs
    same("all_gather int64", all_gather)

    def all_gather_into_tensor(group: Any) -> torch.Tensor:
        out = torch.empty(world * 4, dtype=torch.float64)
        dist.all_gather_into_tensor(out, value(rank, torch.float64, 4), group=group)
        return out
    same("all_gather_into_tensor float64", all_gather_into_tensor)

    def all_to_all_single(uneven: bool) -> Callable[[Any], torch.Tensor]:
        def run(group: Any) -> torch.Tensor:
            if not uneven:
                out = torch.empty(world * 2, dtype=torch.int32)
                dist.all_to_all_single(out, value(rank, torch.int32, world * 2), group=group)
                return out
            sends = [(rank + j) % 3 + 1 for j in range(world)]  # rank sends j this many rows
            recvs = [(r + rank) % 3 + 1 for r in range(world)]
            data = value(rank, torch.float32, sum(sends) * 2).reshape(-1, 2)
            out = torch.empty(sum(recvs), 2)
            dist.all_to_all_single(out, data, recvs, sends, group=group)
            return out
        return run
    same("all_to_all_single", all_to_all_single(False))
    same("all_to_all_single uneven", all_to_all_single(True))

    def all_to_all(group: Any) -> list[torch.Tensor]:
        outs = [torch.empty(3) for _ in range(world)]  # gloo needs equal sizes
        dist.all_to_all(outs, [value(rank, torch.float32, 3) + j for j in range(world)],
                        group=group)
        return outs
    same("all_to_all", all_to_all)

    def gather(group: Any) -> list[torch.Tensor]:
        outs = [torch.empty(3) for _ in range(world)] if rank == 1 else None
        dist.gather(value(rank, torch.float32, 3), outs, dst=1, group=group)
        return outs if outs is not None else [torch.zeros(1)]
    same("gather", gather)

    def scatter(group: Any) -> torch.Tensor:
        out = torch.empty(4, dtype=torch.int64)
        chunks = [value(r, torch.int64, 4) for r in range(world)] if rank == 0 else None
        dist.scatter(out, chunks, src=0, group=group)
        return out
    same("scatter", scatter)

    def broadcast(group: Any) -> torch.Tensor:
        t = value(rank, torch.bfloat16, 9)
        dist.broadcast(t, src=world - 1, group=group)
        return t
    same("broadcast bfloat16", broadcast)

    def reduce(group: Any) -> torch.Tensor:
        t = value(rank, torch.int64, 6)
        dist.reduce(t, dst=0, op=R.MIN, group=group)
        return t if rank == 0 else torch.zeros(1)  # only the root's tensor is defined
    same("reduce MIN", reduce)

    dist.barrier()
    done.append("barrier")

    # subgroups: a partition of the ranks (the groups run together), against gloo's groups of the same ranks
    parts = [list(range(world))[i::2] for i in range(2)] if world > 1 else [[0]]
    ours, _ = dist.new_subgroups_by_enumeration(parts)
    theirs, _ = dist.new_subgroups_by_enumeration(parts, backend="gloo")

    def sub(group: Any) -> list[torch.Tensor]:
        s = value(rank, torch.float32, 5, small=True)
        m = value(rank, torch.int64, 5)
        g = ours if group is None else theirs
        dist.all_reduce(s, group=g)
        dist.all_reduce(m, op=R.MAX, group=g)
        outs = [torch.empty(5, dtype=torch.int64) for _ in range(len(parts[0]))]
        dist.all_gather(outs, m + rank, group=g)
        return [s, m, *outs]
    same("subgroups of a partition", sub)

    # what sums cannot do: a NetStorm error naming the collective and the op
    for name, call in (("send", lambda: dist.send(torch.ones(2), dst=(rank + 1) % world)),
                       ("recv", lambda: dist.recv(torch.ones(2), src=(rank + 1) % world)),
                       ("AVG", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=R.AVG)),
                       ("BAND", lambda: dist.all_reduce(torch.ones(2), op=R.BAND))):
        try:
            call()
        except UnsupportedCollective as exc:
            assert name in str(exc) and "netstorm backend" in str(exc) and " object at " not in str(exc), exc
            done.append(f"error {name}")
        else:
            raise AssertionError(f"{name} did not raise")
    dist.barrier()  # the errors above were refused before any node iteration: the group is intact
    stats = netstorm.torch.stats()
    print(json.dumps({"rank": rank, "ok": True, "checks": done, "iterations": stats.iterations,
                      "compression": os.environ.get("NETSTORM_COMPRESSION", "none")}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
