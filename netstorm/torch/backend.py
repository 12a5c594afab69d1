"""The ``netstorm`` process-group backend: ``dist.init_process_group("netstorm")`` syncs through the DC's node.

See docs/ARCHITECTURE.md, *PyTorch*."""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from netstorm.torch import codec
from netstorm.torch.stage import Stage, StageStats

BACKEND = "netstorm"


class NetStormBackendError(dist.DistBackendError):
    """A collective of the ``netstorm`` backend failed; the message names DC, rank, collective, iteration."""


def _fail_on_error(future: Future[Any]) -> Any:
    """``then`` callback: re-raise an error the worker stored as the value, so the chained future (the one
    torch sees) completes with a real error; a plain ``set_exception`` is a value to C++ code."""
    value = future.value()
    if isinstance(value, BaseException):
        raise value
    return value


class NetStormWork(dist.Work):
    """The handle of one collective: ``wait()`` raises its error, ``get_future()`` is what DDP chains on."""

    def __init__(self) -> None:
        super().__init__()
        self._base: Future[Any] = Future()
        self._future: Future[Any] = self._base.then(_fail_on_error)

    def complete(self, value: Any) -> None:
        self._base.set_result(value)

    def fail(self, error: BaseException) -> None:
        self._base.set_result(error)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._base.wait()
        value = self._base.value()
        if isinstance(value, BaseException):
            raise value
        return True

    def get_future(self) -> Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._base.done()

    def is_success(self) -> bool:
        return self._base.done() and not isinstance(self._base.value(), BaseException)


_Job = tuple[str, np.ndarray, Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], Any], NetStormWork]


class ProcessGroupNetStorm(dist.ProcessGroup):
    """A process group whose collectives are sums at the ranks' general nodes (see the module docstring)."""

    def __init__(self, stage: Stage, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # the Python-subclass constructor
        self.stage = stage
        self._rank = rank
        self._world = world_size
        self._count = 0
        self._error: NetStormBackendError | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"netstorm-pg-rank{rank}", daemon=True)
        self._worker.start()

    # ---- identity -------------------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def stats(self) -> StageStats:
        """Counts and seconds so far: node iterations, padding, node wait and the integration's own cost."""
        return self.stage.snapshot()

    # ---- the worker -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            what, payload, reduce, finish, work = job
            if self._error is not None:
                work.fail(self._error)
                continue
            try:
                summed = reduce(payload)
                began = time.perf_counter()
                value = finish(summed)
                self.stage.charge(time.perf_counter() - began)
            except Exception as exc:  # every failure becomes the collective's torch error
                self._error = NetStormBackendError(
                    f"netstorm backend: DC {self.stage.node_id} rank {self._rank}: {what} failed after node "
                    f"iteration {self.stage.iteration}: {type(exc).__name__}: {exc}")
                self._error.__cause__ = exc
                work.fail(self._error)
                continue
            work.complete(value)

    def _submit(self, what: str, encode: Callable[[], np.ndarray], finish: Callable[[np.ndarray], Any],
                *, average: bool = False, exact: bool = False,
                bucket: tuple[int, ...] | None = None) -> NetStormWork:
        """Queue one collective: ``exact`` for 16-bit pieces that must not be rounded, ``bucket`` (a gradient
        bucket's key) for the job's compression."""
        work = NetStormWork()
        self._count += 1
        began = time.perf_counter()
        payload = encode()
        self.stage.charge(time.perf_counter() - began)
        stage = self.stage
        if bucket is not None:
            key = bucket

            def reduce(flat: np.ndarray) -> np.ndarray:
                return stage.reduce_compressed(flat, key)
        else:
            def reduce(flat: np.ndarray) -> np.ndarray:
                return stage.reduce(flat, average=average, exact=exact)
        self._jobs.put((f"collective #{self._count} ({what}, {payload.size} elements)", payload, reduce, finish,
                        work))
        return work

    def shutdown(self) -> None:
        """Stop the worker once queued collectives are done, and leave the node."""
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join(timeout=5.0)
        self.stage.close()

    def abort(self) -> None:
        self.shutdown()

    # ---- collectives ----------------------------------------------------------------------------------

    def allreduce(self, tensors: Sequence[torch.Tensor] | torch.Tensor,  # type: ignore[override]
                  opts: Any = None) -> NetStormWork:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._allreduce(tensors, op, "allreduce")

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> NetStormWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._allreduce(list(tensors), op, "allreduce_coalesced")

    def _allreduce(self, tensors: list[torch.Tensor], op: Any, what: str) -> NetStormWork:
        average = op == dist.ReduceOp.AVG
        if not (average or op == dist.ReduceOp.SUM):
            raise NotImplementedError(f"netstorm backend: {what} supports SUM and AVG, not {op}")
        floating = [t.dtype in codec.FLOATS for t in tensors]
        if average and not all(floating):
            raise NotImplementedError(f"netstorm backend: {what} AVG needs floating tensors, got "
                                      f"{[str(t.dtype) for t in tensors]}")
        sizes = [t.numel() if f else 4 * t.numel() for t, f in zip(tensors, floating, strict=True)]

        def encode() -> np.ndarray:
            parts = [codec.values(t) if f else codec.int_sum_bits(t) for t, f in zip(tensors, floating, strict=True)]
            return np.concatenate(parts) if parts else np.zeros(0, np.float32)

        def finish(summed: np.ndarray) -> list[torch.Tensor]:
            position = 0
            for tensor, is_float, size in zip(tensors, floating, sizes, strict=True):
                part = summed[position:position + size]
                position += size
                (codec.store_values if is_float else codec.store_int_sum)(tensor, part)
            return tensors

        return self._submit(what, encode, finish, average=average, exact=not all(floating))

    def allreduce_compressed(self, tensor: torch.Tensor, bucket: tuple[int, ...]) -> NetStormWork:
        """The mean over every rank of a gradient bucket through the job's compression (``compressed.py``);
        ``bucket`` keys its error feedback and must be the same at every rank. Its future holds ``tensor``,
        overwritten with the mean."""
        if tensor.dtype not in codec.FLOATS:
            raise TypeError(f"netstorm backend: compressed all-reduce needs a floating bucket, not {tensor.dtype}")
        workers = self.stage.workers

        def finish(summed: np.ndarray) -> torch.Tensor:
            codec.store_values(tensor, summed / np.float32(workers))
            return tensor

        return self._submit(f"compressed bucket {bucket}", lambda: codec.values(tensor), finish, bucket=bucket)

    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> NetStormWork:  # type: ignore[override]
        """Like allreduce; only the root's tensor is written (others are left as they were)."""
        tensors = list(tensors)
        root = opts.rootRank if opts is not None else 0
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        targets = [t if self._rank == root else t.clone() for t in tensors]
        work = self._allreduce(targets, op, "reduce")
        return work

    def broadcast(self, tensors: Sequence[torch.Tensor] | torch.Tensor, opts: Any = None) -> NetStormWork:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        root = opts.rootRank if opts is not None else 0
        sizes = [codec.bits_size(t) for t in tensors]
        source = self._rank == root

        def encode() -> np.ndarray:
            if not source:
                return np.zeros(sum(sizes), np.float32)
            parts = [codec.bits(t) for t in tensors]
            return np.concatenate(parts) if parts else np.zeros(0, np.float32)

        def finish(summed: np.ndarray) -> list[torch.Tensor]:
            position = 0
            for tensor, size in zip(tensors, sizes, strict=True):
                if not source:
                    codec.store_bits(tensor, summed[position:position + size])
                position += size
            return tensors

        return self._submit(f"broadcast from rank {root}", encode, finish, exact=True)

    def allgather(self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> NetStormWork:
        inputs = list(inputs)
        lists: list[list[torch.Tensor]] = [list(out) for out in outputs]
        if len(lists) != len(inputs) or any(len(out) != self._world for out in lists):
            raise ValueError(f"netstorm backend: allgather needs {len(inputs)} output lists of {self._world} "
                             f"tensors each")
        sizes = [codec.bits_size(t) for t in inputs]
        world, rank = self._world, self._rank

        def encode() -> np.ndarray:
            parts = []
            for tensor, size in zip(inputs, sizes, strict=True):
                part = np.zeros(world * size, np.float32)
                part[rank * size:(rank + 1) * size] = codec.bits(tensor)
                parts.append(part)
            return np.concatenate(parts) if parts else np.zeros(0, np.float32)

        def finish(summed: np.ndarray) -> list[list[torch.Tensor]]:  # outputs, filled
            position = 0
            for out, size in zip(lists, sizes, strict=True):
                for r in range(world):
                    codec.store_bits(out[r], summed[position + r * size:position + (r + 1) * size])
                position += world * size
            return lists

        return self._submit("allgather", encode, finish, exact=True)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> NetStormWork:
        """``all_gather_into_tensor``: ``output`` holds every rank's ``input`` in rank order."""
        pieces = list(output.reshape(self._world, -1).unbind(0))
        return self.allgather([[p.view(input.shape) for p in pieces]], [input], opts)

    _allgather_base = all_gather_single

    def barrier(self, opts: Any = None) -> NetStormWork:
        return self._submit("barrier", lambda: np.zeros(1, np.float32), lambda summed: [], exact=True)


def socket_address(template: str, rank: int, environ: dict[str, str] | None = None) -> str | None:
    """The rank's node address from the ``torch_socket`` template (None: NETSTORM_SOCKET decides)."""
    if not template:
        return None
    env = os.environ if environ is None else environ
    try:
        return template.format(rank=rank, local_rank=int(env.get("LOCAL_RANK", rank)),
                               group_rank=int(env.get("GROUP_RANK", 0)))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"torch_socket {template!r}: use the fields {{rank}}, {{local_rank}}, {{group_rank}}: "
                         f"{exc}") from None


def create(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> ProcessGroupNetStorm:
    """The creator ``register_backend`` calls: connect to this rank's node, register the round, check sizes."""
    import netstorm
    from netstorm.compression.options import CompressionOptions
    from netstorm.config import resolve

    config = resolve(environ=os.environ)
    address = socket_address(config.torch_socket, rank)
    client = netstorm.connect(address, timeout=timeout.total_seconds())
    try:
        stage = Stage(client, config.torch_round, CompressionOptions.of(config), seed=rank)
    except Exception as exc:
        client.close()
        raise NetStormBackendError(f"netstorm backend: rank {rank} could not join at its node "
                                   f"({address or os.environ.get('NETSTORM_SOCKET')}): {type(exc).__name__}: "
                                   f"{exc}") from exc
    if stage.workers != world_size:
        stage.close()
        raise NetStormBackendError(
            f"netstorm backend: the nodes count {stage.workers} trainers, but the process group has {world_size} "
            f"ranks: set each node's trainers option to the number of ranks in its DC")
    return ProcessGroupNetStorm(stage, rank, world_size)


def register() -> None:
    """Make ``"netstorm"`` a ``torch.distributed`` backend (idempotent; ``import netstorm.torch`` calls it)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, create, devices=["cpu"])


def stats(group: dist.ProcessGroup | None = None) -> StageStats:
    """The backend's counts and seconds for ``group`` (default: the default group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupNetStorm):
        raise TypeError(f"not a netstorm process group: {pg!r}")
    return pg.stats()


def compressed_hook(group: ProcessGroupNetStorm, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP comm hook: each gradient bucket's mean through the job's compression (``compression`` option)
    with error feedback per bucket; ``ddp.register_comm_hook(group, compressed_hook)`` with ``group`` the
    ``netstorm`` process group DDP runs on. Without a sparse method it is a plain mean (fp16: float16 on
    the WAN)."""
    buffer = bucket.buffer()
    return group.allreduce_compressed(buffer, (bucket.index(), buffer.numel())).get_future()


# DDP's register_comm_hook checks the annotations as objects; this module's are strings (postponed).
compressed_hook.__annotations__ = {"group": ProcessGroupNetStorm, "bucket": dist.GradBucket,
                                   "return": Future[torch.Tensor]}
