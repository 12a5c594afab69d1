"""The gloo baseline: PyTorch's all_reduce (gloo backend) of a model-sized tensor, one process per DC.

``python -m netstorm.emulation.gloo_trainer --rank R --world N --store HOST:PORT --address ADDR
--model alexnet|resnet50|SIZE --iterations K [--compute-s S] [--overlap] [--out FILE]``

The process group is built directly so gloo's data connections bind to ``--address`` (the DC's node
address, reached over the shaped overlay) while the rendezvous store runs on the unshaped management
network. The whole model is one flat float32 tensor, the most favourable case for gloo (one ring
all-reduce rather than one per layer); with ``--overlap``, as DDP does, each layer's all-reduce starts when
the backward part of the compute time yields it, and the iteration waits for them all. Rank r
contributes ``P * (r + 1) + k`` for a fixed integer pattern ``P``; the sum is checked exactly. Output:
one JSON line per iteration in the synthetic trainer's format (iteration, seconds, sync_s, exact, dc).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np


def layer_sizes(spec: str) -> list[int]:
    """Elements per layer of a model spec, as the synthetic trainer lays it out."""
    from netstorm.trainers.synthetic import model_layers

    return [int(np.prod(shape, dtype=np.int64)) for _, shape in model_layers(spec)]


def model_parameters(spec: str) -> int:
    """Parameters of a model spec."""
    return sum(layer_sizes(spec))


def _pattern(size: int) -> np.ndarray:
    return np.resize(np.arange(-125, 126, dtype=np.float32), size)


def run(args: argparse.Namespace, stream: IO[str]) -> int:
    import torch
    import torch.distributed as dist

    from netstorm.models import backward_yields

    gloo: Any = dist.ProcessGroupGloo  # private options API: typed loosely on purpose

    host, _, port = args.store.rpartition(":")
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(host, int(port), args.world, args.rank == 0, timeout=timeout)
    options = gloo._Options()
    options._devices = [gloo.create_device(hostname=args.address)]
    options._timeout = timeout
    group = gloo(store, args.rank, args.world, options)

    sizes = layer_sizes(args.model)
    size = sum(sizes)
    pattern = _pattern(size)
    buffer = np.empty(size, dtype=np.float32)
    tensor = torch.from_numpy(buffer)
    ranks_sum = args.world * (args.world + 1) // 2
    all_exact = True
    # With --overlap, one all-reduce per layer, launched as backward yields it (last layer first).
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    layers = [tensor[int(bounds[i]):int(bounds[i + 1])] for i in range(len(bounds) - 1)]
    for k in range(args.iterations):
        start = time.perf_counter()
        began = time.time()  # wall clock: the runner places the iteration in the rate log
        np.multiply(pattern, np.float32(args.rank + 1), out=buffer)
        buffer += np.float32(k)
        if args.overlap:
            works = []
            for i, due in backward_yields(sizes, args.compute_s):
                time.sleep(max(0.0, start + due - time.perf_counter()))
                works.append(group.allreduce([layers[i]]))
            sync_start = time.perf_counter()
            for work in works:
                work.wait()
        else:
            time.sleep(max(0.0, args.compute_s - (time.perf_counter() - start)))
            sync_start = time.perf_counter()
            group.allreduce([tensor]).wait()
        sync_s = time.perf_counter() - sync_start
        expected = pattern * np.float32(ranks_sum) + np.float32(args.world * k)
        exact = bool(np.array_equal(buffer, expected))
        all_exact &= exact
        record: dict[str, Any] = {"iteration": k, "seconds": time.perf_counter() - start, "sync_s": sync_s,
                                  "exact": exact, "dc": args.dc, "t": time.time(), "began": began}
        stream.write(json.dumps(record) + "\n")
        stream.flush()
    # Leave together: a rank that exits while others still read would break their last all-reduce.
    group.barrier().wait()
    return 0 if all_exact else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netstorm.emulation.gloo_trainer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dc", type=int, required=True, help="this DC's id (for the output)")
    parser.add_argument("--store", required=True, help="HOST:PORT of the rendezvous store (rank 0 serves it)")
    parser.add_argument("--address", required=True, help="address gloo's data connections bind to")
    parser.add_argument("--model", default="alexnet")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--compute-s", type=float, default=0.0)
    parser.add_argument("--overlap", action="store_true",
                        help="one all-reduce per layer, each launched as soon as the backward part of the compute "
                             "time (two thirds, shared by layer size, last layer first) yields it")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds any collective may take")
    parser.add_argument("--out", default=None, help="JSON lines file (default stdout)")
    args = parser.parse_args(argv)
    if args.out is None:
        return run(args, sys.stdout)
    with Path(args.out).open("w") as stream:
        return run(args, stream)


if __name__ == "__main__":
    sys.exit(main())
