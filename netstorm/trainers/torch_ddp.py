"""The emulator's torch-ddp trainer: a real model trained with DDP, on backend ``netstorm`` or ``gloo``.

See docs/ARCHITECTURE.md, *PyTorch*."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from netstorm.compression.methods import METHODS
from netstorm.trainers.realdata import NAMES as REALDATA
from netstorm.trainers.tasks import TASKS, parameters_digest

HELD_OUT = 1000
HELD_OUT_SEED = 999_999


def gloo_group(args: argparse.Namespace, timeout: datetime.timedelta) -> Any:
    """A gloo process group whose data connections bind to ``--address`` (the DC's overlay address, which
    may sit on a loopback-like device that GLOO_SOCKET_IFNAME cannot name), its store on ``--store``."""
    import torch
    import torch.distributed as dist

    gloo: Any = dist.ProcessGroupGloo  # private options API: typed loosely on purpose
    host, _, port = args.store.rpartition(":")
    store = dist.TCPStore(host, int(port), args.world, args.rank == 0, timeout=timeout)
    options = gloo._Options()
    options._devices = [gloo.create_device(hostname=args.address)]
    options._timeout = timeout
    backend = gloo(store, args.rank, args.world, options)
    group = dist.ProcessGroup(store, args.rank, args.world)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return group


def process_group(args: argparse.Namespace, parameters: int) -> Any:
    """The job's process group on ``--backend``: netstorm's (its round sized for ``parameters``) or gloo's."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=args.timeout)
    if args.backend != "netstorm":
        return gloo_group(args, timeout)
    import netstorm.torch  # noqa: F401  (registers the backend)

    os.environ["NETSTORM_SOCKET"] = args.socket
    for name in ("compression", "fediac_k", "fediac_bits", "fediac_votes", "fediac_gia_reuse"):
        if getattr(args, name) is not None:  # the process group resolves its options from the environment
            os.environ["NETSTORM_" + name.upper()] = str(getattr(args, name))
    os.environ.setdefault("NETSTORM_TORCH_ROUND", str(parameters))
    dist.init_process_group("netstorm", store=dist.HashStore(), rank=args.rank, world_size=args.world,
                            timeout=timeout)
    return dist.distributed_c10d._get_default_group()


def run(args: argparse.Namespace, stream: IO[str]) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import netstorm.torch
    from netstorm.trainers import tasks

    torch.set_num_threads(1)
    if args.task in REALDATA:
        from netstorm.trainers import ddp_realdata

        group = process_group(args, ddp_realdata.parameters(args.task))
        return ddp_realdata.run(args, group, stream)
    spec = TASKS[args.task]
    group = process_group(args, spec.parameters)
    model = tasks.build_model(args.task, args.seed)
    bucket_mb = 4 * spec.parameters / 2**20 + 1.0  # one bucket: the whole gradient
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb)
    compression = "none"
    if args.backend == "netstorm":
        compression = group.stage.compression.method
        if compression != "none" or args.comm_hook == "compressed":
            ddp.register_comm_hook(group, netstorm.torch.compressed_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=spec.lr, momentum=0.9)
    x, y = tasks.make_data(args.task, args.seed + 1 + args.rank, spec.batch * args.iterations)
    held_x, held_y = tasks.make_data(args.task, HELD_OUT_SEED, HELD_OUT) if args.rank == 0 else (None, None)
    stats = (lambda: netstorm.torch.stats(group)) if args.backend == "netstorm" else None
    for k in range(args.iterations):
        before = stats() if stats is not None else None
        start = time.perf_counter()
        opt.zero_grad()
        batch = slice(k * spec.batch, (k + 1) * spec.batch)
        loss = torch.nn.functional.cross_entropy(ddp(x[batch]), y[batch])
        loss.backward()  # DDP's all-reduce runs during backward; backward returns once it is done
        opt.step()
        seconds = time.perf_counter() - start
        record: dict[str, Any] = {"iteration": k, "seconds": seconds, "exact": True, "dc": args.dc,
                                  "t": time.time(), "train_loss": float(loss.item())}
        if stats is not None and before is not None:
            after = stats()
            record["overhead_s"] = after.overhead_s - before.overhead_s
            record["node_s"] = after.node_s - before.node_s
            record["sync_s"] = record["node_s"] + record["overhead_s"]
            record["node_iterations"] = after.iterations - before.iterations
            record["wan_bytes"] = after.wan_bytes - before.wan_bytes
            record["round_trips"] = record["node_iterations"]
            if compression != "none":
                record["compression"] = compression
            if after.compressed > before.compressed:
                record["gia"] = after.gia - before.gia
                record["bits"] = after.bits
                vote = after.vote_s - before.vote_s
                record["round_s"] = [vote, record["node_s"] - vote]
        if args.digest:
            record["params_digest"] = parameters_digest(model)
        if held_x is not None and held_y is not None:
            record["loss"], record["accuracy"] = tasks.evaluate(model, held_x, held_y)
        stream.write(json.dumps(record) + "\n")
        stream.flush()
    if args.save is not None:
        import numpy as np

        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in model.parameters()])
        np.save(Path(args.save) / f"rank-{args.rank}.npy", flat.numpy())
    group.barrier().wait()  # leave together: a rank that exits early breaks the others' last collective
    if args.backend == "netstorm":
        dist.destroy_process_group()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m netstorm.trainers.torch_ddp", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["netstorm", "gloo"], required=True)
    parser.add_argument("--task", choices=[*TASKS, *REALDATA], default=next(iter(TASKS)),
                        help="a generated task, or DiLoCo's real data (netstorm/trainers/ddp_realdata.py)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--dc", type=int, required=True, help="this DC's id (for the output)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (every rank the same model)")
    parser.add_argument("--socket", default=None, help="netstorm: this DC's node trainer socket")
    parser.add_argument("--store", default=None, help="gloo: HOST:PORT of the rendezvous store (rank 0 serves it)")
    parser.add_argument("--address", default=None, help="gloo: the address gloo's data connections use")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds any collective may take")
    parser.add_argument("--out", default=None, help="JSON lines file (default stdout)")
    parser.add_argument("--compression", default=None, choices=METHODS,
                        help="netstorm: gradient compression (default: NETSTORM_COMPRESSION, else none)")
    parser.add_argument("--fediac-k", type=float, default=None, help="votes per contributor (share or count)")
    parser.add_argument("--fediac-bits", type=int, default=None, help="bits b of a value (0: derived)")
    parser.add_argument("--fediac-votes", type=int, default=None, help="threshold a (0: derived)")
    parser.add_argument("--fediac-gia-reuse", type=int, default=None,
                        help="iterations one FediAC GIA serves (ours; 1: vote every iteration)")
    parser.add_argument("--comm-hook", choices=("default", "compressed"), default="default",
                        help="netstorm: DDP's bucket all-reduce (default) or compressed_hook even without compression")
    parser.add_argument("--compute-s", type=float, default=0.0,
                        help="digits/pylm: pad each step's compute to at least S seconds before its all-reduce")
    parser.add_argument("--eval-every", type=int, default=1, help="digits/pylm: steps between held-out evaluations")
    parser.add_argument("--digest", action="store_true", help="add params_digest (a hash of the model) to each line")
    parser.add_argument("--save", default=None, help="directory: write the final parameters to rank-R.npy there")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backend == "netstorm" and not args.socket:
        parser.error("--backend netstorm needs --socket")
    if args.backend == "gloo" and args.compression not in (None, "none"):
        parser.error("--compression runs on --backend netstorm")
    if args.backend == "gloo" and not (args.store and args.address):
        parser.error("--backend gloo needs --store and --address")
    if args.out is None:
        return run(args, sys.stdout)
    with Path(args.out).open("w") as stream:
        return run(args, stream)


if __name__ == "__main__":
    sys.exit(main())
