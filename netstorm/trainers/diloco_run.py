"""One DC's DiLoCo trainer on real data: ``python -m netstorm.trainers.diloco_run --socket PATH ...``.

It trains ``--train`` (``realdata``: digits or pylm) with AdamW inner steps and ``netstorm.torch``'s
DiLoCo against its DC's node, and writes JSON lines to ``--out``: ``start`` (parameters, bytes, a
fragment's bytes on the wire, the step it joined a running job at), one ``sync`` per fragment sync
(its start, seconds, contributors, weight, attempts, WAN bytes, digest), ``eval`` after every full
round of fragments (held-out loss and accuracy of the global parameters, when no sync is in flight)
and ``end`` (compute and wall seconds, evaluation excluded). ``--compute-s S`` pads every inner step
to at least S seconds of wall time: a GPU-class step on a CPU-only host. Run again with the same command
line after its DC restarted, it rejoins the running job and continues from the live step.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from netstorm.trainers.diloco_options import add_options, emit


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(prog="python -m netstorm.trainers.diloco_run")
    out.add_argument("--socket", required=True, help="the DC's node (a Unix socket path or tcp://HOST:PORT)")
    add_options(out)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    import netstorm
    from netstorm.diloco.outer import OuterSGD
    from netstorm.torch.diloco import DiLoCo
    from netstorm.trainers.realdata import build

    torch.set_num_threads(args.threads)
    task = build(args.train, args.dc_index, args.dcs, args.seed, args.batch)
    kv = netstorm.connect(args.socket, timeout=args.timeout)
    inner = torch.optim.AdamW(task.model.parameters(), lr=task.lr)
    dl = DiLoCo(task.model, inner, OuterSGD(args.outer_lr, args.outer_momentum), kv, sync_every=args.sync_every,
                fragments=args.fragments, fragment_delay=args.fragment_delay,
                outer_compression=args.outer_compression, error_feedback=args.error_feedback,
                straggler_s=args.straggler_s, seed=args.seed, rejoin=not args.no_rejoin)
    # evaluation runs on the global parameters: a second model whose parameters are views of them
    import copy
    evaluator = copy.deepcopy(task.model)
    with torch.no_grad():
        for p, view in zip(evaluator.parameters(), _views(dl), strict=True):
            p.data = torch.from_numpy(view)
    with open(args.out, "a", encoding="utf-8") as out:
        state = dl.sync.state
        emit(out, "start", dc=kv.node_id, train=args.train, parameters=task.parameters,
             bytes=4 * task.parameters, fragment_bytes=state.width * state.compression.wire_bytes_per_value(),
             joined_at=dl.sync.joined_at, step=dl.sync.steps, t=time.time())
        start = time.monotonic()
        compute = eval_s = 0.0
        seen = 0
        while dl.sync.steps < args.steps:
            t0 = time.monotonic()
            x, y = task.batch(dl.sync.steps + 1)
            loss = task.loss(task.model, x, y)
            loss.backward()
            inner_start = time.monotonic()
            remaining = args.compute_s - (inner_start - t0)
            if remaining > 0:
                time.sleep(remaining)  # the padding --compute-s asks for: a GPU-class step's wall time
            record = dl.step()
            inner.zero_grad()
            compute += (time.monotonic() - t0) - (_last_wait(dl))
            for r in dl.records[seen:]:
                emit(out, "sync", **{k: (list(v) if isinstance(v, tuple) else v) for k, v in r.__dict__.items()})
            seen = len(dl.records)
            if record is not None and (record.index + 1) % args.fragments == 0 and dl.sync.in_flight() == 0:
                e0 = time.monotonic()
                eval_loss, accuracy = task.evaluate(evaluator)
                eval_s += time.monotonic() - e0
                emit(out, "eval", t_s=time.monotonic() - start - eval_s, step=dl.sync.steps, loss=eval_loss,
                     accuracy=accuracy)
        wall = time.monotonic() - start - eval_s
        dl.close()
        emit(out, "end", steps=dl.sync.steps, wall_s=wall, compute_s=compute,
             compute_fraction=compute / wall if wall else None, digest=dl.digest().hex())
    kv.close()
    return 0


def _views(dl: Any) -> list[Any]:
    state = dl.sync.state.params
    out, at = [], 0
    for shape in dl.sync.shapes.values():
        size = 1
        for n in shape:
            size *= n
        out.append(state[at:at + size].reshape(shape))
        at += size
    return out


def _last_wait(dl: Any) -> float:
    """Seconds the last ``step()`` waited for a sync's result (what is not compute)."""
    return float(dl.sync.last_wait_s)


if __name__ == "__main__":
    sys.exit(main())
