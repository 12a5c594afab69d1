"""torch-ddp on DiLoCo's real data (``--task digits|pylm``): the per-step all-reduce reference.

Each rank trains ``realdata``'s model from the same seed on its own shard, with DiLoCo's inner optimizer
(AdamW at the task's rate), under DDP with the whole gradient in one bucket: DiLoCo's DCs and this
reference see the same data and the same initial model. The comm hook pads the step's compute to
``--compute-s`` before the all-reduce starts (the all-reduce waits for the padded step, as it would for a
GPU-class one) and times the all-reduce. The JSON lines are ``diloco_run``'s: ``start``, one ``sync`` per
step (its all-reduce, with the digest of the model it started from), ``eval`` every ``--eval-every``
steps and after the last, ``end``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import IO, Any


def parameters(task: str) -> int:
    """The task's parameter count, without building its data."""
    from netstorm.trainers.realdata import build

    return build(task, 0, 1).parameters


def _emit(stream: IO[str], kind: str, **fields: Any) -> None:
    stream.write(json.dumps({"kind": kind, **fields}) + "\n")
    stream.flush()


def run(args: argparse.Namespace, group: Any, stream: IO[str]) -> int:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from netstorm.trainers.realdata import build
    from netstorm.trainers.tasks import parameters_digest

    task = build(args.task, args.rank, args.world, args.seed)
    world = args.world
    step_began = [0.0]
    sync: dict[str, float] = {"s": 0.0, "began": 0.0}
    padded = [False]

    def hook(_state: Any, bucket: Any) -> Any:
        if not padded[0]:  # the step's compute ends when its (first) bucket is ready: pad it here
            remaining = args.compute_s - (time.monotonic() - step_began[0])
            if remaining > 0:
                time.sleep(remaining)
            padded[0] = True
            sync["began"] = time.time()
        began = time.monotonic()

        def done(future: Any) -> Any:
            sync["s"] += time.monotonic() - began
            return future.value()[0].div_(world)

        return group.allreduce([bucket.buffer()]).get_future().then(done)

    hook.__annotations__ = {}  # DDP checks annotations as objects; this module's are strings

    bucket_mb = 4 * task.parameters / 2**20 + 1.0
    ddp = DistributedDataParallel(task.model, process_group=group, bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(None, hook)
    inner = torch.optim.AdamW(ddp.parameters(), lr=task.lr)
    stats = None
    if args.backend == "netstorm":
        import netstorm.torch

        def stats() -> Any:
            return netstorm.torch.stats(group)

    _emit(stream, "start", dc=args.dc, train=args.task, parameters=task.parameters, bytes=4 * task.parameters,
          fragment_bytes=4 * task.parameters, joined_at=None, step=0, t=time.time())
    start = time.monotonic()
    compute = eval_s = 0.0
    for k in range(1, args.iterations + 1):
        digest = parameters_digest(task.model)
        before = stats().wan_bytes if stats is not None else 0
        step_began[0] = time.monotonic()
        padded[0] = False
        sync["s"] = 0.0
        x, y = task.batch(k)
        loss = task.loss(ddp, x, y)
        loss.backward()  # the hook's all-reduce runs inside; backward returns once it is done
        inner.step()
        inner.zero_grad()
        compute += (time.monotonic() - step_began[0]) - sync["s"]
        wan = stats().wan_bytes - before if stats is not None else None
        _emit(stream, "sync", index=k - 1, fragment=0, seconds=sync["s"], contributors=list(range(world)),
              weight=world, left_out=False, attempts=1, wan_bytes=wan, digest=digest, began=sync["began"])
        if k % args.eval_every == 0 or k == args.iterations:  # every rank: they stay in step
            e0 = time.monotonic()
            eval_loss, accuracy = task.evaluate(task.model)
            eval_s += time.monotonic() - e0
            _emit(stream, "eval", t_s=time.monotonic() - start - eval_s, step=k, loss=eval_loss, accuracy=accuracy)
    wall = time.monotonic() - start - eval_s
    group.barrier().wait()  # leave together: a rank that exits early breaks the others' last collective
    _emit(stream, "end", steps=args.iterations, wall_s=wall, compute_s=compute,
          compute_fraction=compute / wall if wall else None, digest=parameters_digest(task.model))
    if args.backend == "netstorm":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0
