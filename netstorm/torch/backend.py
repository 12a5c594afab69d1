"""The ``netstorm`` process-group backend: ``dist.init_process_group("netstorm")`` syncs through the DC's node.

See docs/ARCHITECTURE.md, *PyTorch*."""

from __future__ import annotations

import dataclasses
import datetime
import io
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from netstorm.errors import UnsupportedCollective
from netstorm.torch import codec, rejoin
from netstorm.torch.jobranks import JobRanks, agree
from netstorm.torch.jobranks import socket_address as socket_address
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


_Job = tuple[str, Callable[[], Any], NetStormWork]

OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")


def op_name(op: Any) -> str:
    """A reduce op's name (``MAX``), never the object's repr."""
    for name in OPS:
        if hasattr(dist.ReduceOp, name) and op == getattr(dist.ReduceOp, name):
            return name
    inner = getattr(op, "op", op)
    return str(getattr(inner, "name", inner))


def _local_reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
    """Every rank's tensor, in rank order, reduced here: the same bits at every rank."""
    stacked = torch.stack(values)
    if op == "MIN":
        return stacked.all(dim=0) if stacked.dtype == torch.bool else stacked.amin(dim=0)
    if op == "MAX":
        return stacked.any(dim=0) if stacked.dtype == torch.bool else stacked.amax(dim=0)
    result = values[0].clone()
    for value in values[1:]:
        if op == "PRODUCT":
            result = result * value if result.dtype != torch.bool else result & value
        elif op == "BAND":
            result = result & value
        elif op == "BOR":
            result = result | value
        else:
            result = result ^ value
    return result


class Channel:
    """The rank's one node connection and worker, shared by the default group and every subgroup: the
    node counts one trainer per rank, and every rank must issue its node iterations in one order."""

    def __init__(self, stage: Stage, rank: int) -> None:
        self.stage = stage
        self.rank = rank
        self.job: JobRanks | None = None
        self.launcher = (rank, 0)
        """The launcher's RANK and WORLD_SIZE (what the job's ranks are agreed from again at a rejoin)."""
        self.joined: rejoin.Joined | None = None
        """A restarted DC's rank: the live state it took when it rejoined, until ``step_boundary`` loads it."""
        self.count = 0
        self.error: NetStormBackendError | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name=f"netstorm-pg-rank{rank}", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            what, run, work = job
            if self.error is not None:
                work.fail(self.error)
                continue
            try:
                value = run()
            except Exception as exc:  # every failure becomes the collective's torch error
                self.error = NetStormBackendError(
                    f"netstorm backend: DC {self.stage.node_id} rank {self.rank}: {what} failed after node "
                    f"iteration {self.stage.iteration}: {type(exc).__name__}: {exc}")
                self.error.__cause__ = exc
                work.fail(self.error)
                continue
            work.complete(value)

    def submit(self, what: str, run: Callable[[], Any]) -> NetStormWork:
        work = NetStormWork()
        self.count += 1
        self._jobs.put((f"collective #{self.count} ({what})", run, work))
        return work

    def run(self, what: str, run: Callable[[], Any]) -> Any:
        """``run`` in the worker after the collectives queued before it; its value, or its error."""
        work = self.submit(what, run)
        work.wait()
        return work._base.value()

    def close(self) -> None:
        """Stop the worker once queued collectives are done, and leave the node."""
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join(timeout=5.0)
        self.stage.close()


@dataclasses.dataclass(frozen=True)
class Partition:
    """Where a subgroup's values go in a node iteration: the groups of its partition of the job's ranks each
    own a slot of every collective's payload (``slots`` of them, this group's is ``slot``)."""

    slot: int
    slots: int

    @classmethod
    def find(cls, stage: Stage, job: JobRanks, members: tuple[int, ...]) -> Partition:
        """One sum at the nodes in which every rank names its group by its group's lowest rank: the groups
        found must be disjoint, cover the job and hold this group as it was made."""
        claims = np.zeros(job.world, np.float32)
        claims[job.rank] = float(min(members) + 1)
        named = np.rint(stage.reduce(claims, exact=True)).astype(np.int64)
        groups: dict[int, list[int]] = {}
        for rank, first in enumerate(named):
            groups.setdefault(int(first) - 1, []).append(rank)
        if groups.get(min(members)) != sorted(members):
            raise UnsupportedCollective(
                f"subgroup of ranks {list(members)}: the job's ranks name the groups {sorted(groups.values())}, "
                f"which do not hold it as made: a netstorm subgroup must be one group of a partition of the "
                f"job's ranks whose groups run the same collectives together")
        order = sorted(groups)
        return cls(order.index(min(members)), len(order))


class ProcessGroupNetStorm(dist.ProcessGroup):
    """A process group whose collectives are sums at the ranks' general nodes (see the module docstring)."""

    def __init__(self, stage: Stage | Channel, rank: int, world_size: int,
                 members: Sequence[int] | None = None) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # the Python-subclass constructor
        self.channel = stage if isinstance(stage, Channel) else Channel(stage, rank)
        self.stage = self.channel.stage
        self._rank = rank
        self._world = world_size
        self.members: tuple[int, ...] | None = tuple(members) if members is not None else None
        """The job ranks of a subgroup, in group-rank order (None: the whole job)."""
        self._partition: Partition | None = None if self.members is not None else Partition(0, 1)
        self._name = ""
        self._desc = ""

    # ---- identity -------------------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The name c10d registered the group under (what torch.compile's functional collectives resolve)."""
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc

    def _get_backend(self, device: Any) -> ProcessGroupNetStorm:  # type: ignore[override]
        """The group is its own backend on every device (FSDP2 asks its backend about tensor allocation)."""
        return self

    def supports_tensor_alloc(self, device: Any) -> bool:
        """Collectives take ordinary tensors: nothing to allocate in a backend's memory."""
        return False

    def stats(self) -> StageStats:
        """Counts and seconds so far: node iterations, padding, node wait and the integration's own cost."""
        return self.stage.snapshot()

    # ---- running collectives --------------------------------------------------------------------------

    def _layout(self) -> Partition:
        if self._partition is None:
            job = self.channel.job
            assert job is not None and self.members is not None
            self._partition = Partition.find(self.stage, job, self.members)
        return self._partition

    def _sum(self, payload: np.ndarray, *, average: bool = False, exact: bool = False) -> np.ndarray:
        """The sum (or mean) of ``payload`` over this group's ranks, in the worker."""
        part = self._layout()
        if part.slots == 1:
            return self.stage.reduce(payload, average=average, exact=exact)
        # the partition's groups send payloads of their own sizes (a gather's grows with the group's ranks)
        out = self.stage.reduce_slot(payload, part.slot, part.slots, exact=exact)
        return out / np.float32(self._world) if average else out

    def _submit(self, what: str, encode: Callable[[], np.ndarray], finish: Callable[[np.ndarray], Any],
                *, average: bool = False, exact: bool = False,
                bucket: tuple[int, ...] | None = None) -> NetStormWork:
        """Queue one collective: ``encode`` runs now (the caller may reuse its tensors once the call
        returns), the sum and ``finish`` in the worker; ``exact`` for 16-bit pieces that must not be
        rounded, ``bucket`` (a gradient bucket's key) for the job's compression."""
        began = time.perf_counter()
        payload = encode()
        self.stage.charge(time.perf_counter() - began)
        stage = self.stage

        def run() -> Any:
            if bucket is not None:
                summed = stage.reduce_compressed(payload, bucket)
            else:
                summed = self._sum(payload, average=average, exact=exact)
            began = time.perf_counter()
            value = finish(summed)
            stage.charge(time.perf_counter() - began)
            return value

        return self.channel.submit(f"{what}, {payload.size} elements", run)

    def shutdown(self) -> None:
        """The whole job's group stops the worker once queued collectives are done, and leaves the node."""
        if self.members is None:
            self.channel.close()

    def abort(self) -> None:
        self.shutdown()

    def _unsupported(self, what: str, why: str) -> UnsupportedCollective:
        return UnsupportedCollective(f"netstorm backend: {what} is not supported: {why}")

    # ---- all-reduce and its kin -----------------------------------------------------------------------

    def allreduce(self, tensors: Sequence[torch.Tensor] | torch.Tensor,  # type: ignore[override]
                  opts: Any = None) -> NetStormWork:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._allreduce(tensors, op_name(op), "allreduce")

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> NetStormWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._allreduce(list(tensors), op_name(op), "allreduce_coalesced")

    def _allreduce(self, tensors: list[torch.Tensor], op: str, what: str,
                   after: Callable[[], Any] | None = None) -> NetStormWork:
        """``op`` over every rank of each tensor, in place; ``after`` runs in the worker once they hold it
        and gives the future's value (default: the tensors)."""
        if op in ("SUM", "AVG"):
            return self._sum_reduce(tensors, op, what, after)
        if op not in ("MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR"):
            raise self._unsupported(f"{what} with op {op}", "it runs SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR and "
                                                            "BXOR")
        if op in ("BAND", "BOR", "BXOR") and any(t.dtype.is_floating_point or t.is_complex() for t in tensors):
            raise self._unsupported(f"{what} with op {op}", f"bitwise ops need integer or bool tensors, got "
                                                            f"{[str(t.dtype) for t in tensors]}")
        world = self._world

        def finish(gathered: list[list[torch.Tensor]]) -> list[torch.Tensor]:
            for tensor, values in zip(tensors, gathered, strict=True):
                with torch.no_grad():
                    tensor.copy_(_local_reduce(values, op))
            return after() if after is not None else tensors

        return self._gather_exact(tensors, f"{what} {op}", finish, world)

    def _sum_reduce(self, tensors: list[torch.Tensor], op: str, what: str,
                    after: Callable[[], Any] | None) -> NetStormWork:
        average = op == "AVG"
        floating = [t.dtype in codec.FLOATS for t in tensors]
        if average and not all(floating):
            raise self._unsupported(f"{what} with op AVG", f"a mean needs floating tensors, got "
                                                          f"{[str(t.dtype) for t in tensors]}")
        if any(t.is_complex() for t in tensors):
            raise self._unsupported(f"{what} with op {op}", "complex tensors do not travel (view them as real)")
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
            return after() if after is not None else tensors

        return self._submit(f"{what} {op}", encode, finish, average=average, exact=not all(floating))

    def _gather_exact(self, inputs: list[torch.Tensor], what: str,
                      finish: Callable[[list[list[torch.Tensor]]], Any], world: int) -> NetStormWork:
        """Every rank's ``inputs``, bit for bit, in rank order (each in its own slot of the sum); ``finish``
        gets, per input, the list of every rank's tensor (host copies)."""
        sizes = [codec.bits_size(t) for t in inputs]
        rank = self._rank

        def encode() -> np.ndarray:
            parts = []
            for tensor, size in zip(inputs, sizes, strict=True):
                part = np.zeros(world * size, np.float32)
                part[rank * size:(rank + 1) * size] = codec.bits(tensor)
                parts.append(part)
            return np.concatenate(parts) if parts else np.zeros(0, np.float32)

        def decode(summed: np.ndarray) -> Any:
            gathered = []
            position = 0
            for tensor, size in zip(inputs, sizes, strict=True):
                values = []
                for r in range(world):
                    host = torch.empty(tensor.shape, dtype=tensor.dtype)
                    codec.store_bits(host, summed[position + r * size:position + (r + 1) * size])
                    values.append(host)
                gathered.append(values)
                position += world * size
            return finish(gathered)

        return self._submit(what, encode, decode, exact=True)

    def allreduce_compressed(self, tensor: torch.Tensor, bucket: tuple[int, ...]) -> NetStormWork:
        """The mean over every rank of a gradient bucket through the job's compression (``compressed.py``);
        ``bucket`` keys its error feedback and must be the same at every rank. Its future holds ``tensor``,
        overwritten with the mean."""
        if tensor.dtype not in codec.FLOATS:
            raise TypeError(f"netstorm backend: compressed all-reduce needs a floating bucket, not {tensor.dtype}")
        if self.members is not None:
            raise self._unsupported("compressed all-reduce on a subgroup", "the job's compression runs on the "
                                                                           "whole job's group")
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
        return self._allreduce(targets, op_name(op), "reduce")

    def reduce_scatter(self, outputs: Sequence[torch.Tensor],  # type: ignore[override]
                       inputs: Sequence[Sequence[torch.Tensor]], opts: Any = None) -> NetStormWork:
        """Each rank's ``outputs[i]`` is the op over every rank of ``inputs[i][rank]``: the all-reduce of
        the concatenated inputs, each rank keeping its part."""
        outputs = list(outputs)
        lists = [list(row) for row in inputs]
        if len(lists) != len(outputs) or any(len(row) != self._world for row in lists):
            raise ValueError(f"netstorm backend: reduce_scatter needs {len(outputs)} input lists of {self._world} "
                             f"tensors each")
        flats = [torch.cat([t.detach().reshape(-1) for t in row]) for row in lists]
        return self._scatter_parts(outputs, flats, opts, "reduce_scatter")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> NetStormWork:
        """``reduce_scatter_tensor``: ``output`` is this rank's part of the op over every rank's ``input``."""
        return self._scatter_parts([output], [input.detach().reshape(-1).clone()], opts, "reduce_scatter_tensor")

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> NetStormWork:
        return self._scatter_parts(list(outputs), [t.detach().reshape(-1).clone() for t in inputs], opts,
                                   "reduce_scatter_tensor_coalesced")

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    def _scatter_parts(self, outputs: list[torch.Tensor], flats: list[torch.Tensor], opts: Any,
                       what: str) -> NetStormWork:
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        rank = self._rank
        for out, flat in zip(outputs, flats, strict=True):
            if flat.numel() != self._world * out.numel():
                raise ValueError(f"netstorm backend: {what}: input of {flat.numel()} elements for an output of "
                                 f"{out.numel()} and {self._world} ranks")

        def after() -> list[torch.Tensor]:
            for out, flat in zip(outputs, flats, strict=True):
                n = out.numel()
                with torch.no_grad():
                    out.copy_(flat[rank * n:(rank + 1) * n].view(out.shape))
            return outputs

        return self._allreduce(flats, op, what, after)

    # ---- copies -----------------------------------------------------------------------------------------

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
        return self._allgather(outputs, inputs, None)

    def _allgather(self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                   value: Any) -> NetStormWork:
        """Every rank's ``inputs`` into ``outputs``; the future holds ``value`` (default: the outputs)."""
        inputs = list(inputs)
        lists: list[list[torch.Tensor]] = [list(out) for out in outputs]
        if len(lists) != len(inputs) or any(len(out) != self._world for out in lists):
            raise ValueError(f"netstorm backend: allgather needs {len(inputs)} output lists of {self._world} "
                             f"tensors each")

        def finish(gathered: list[list[torch.Tensor]]) -> Any:
            for out, values in zip(lists, gathered, strict=True):
                for target, got in zip(out, values, strict=True):
                    with torch.no_grad():
                        target.copy_(got.view(target.shape))
            return lists if value is None else value

        return self._gather_exact(inputs, "allgather", finish, self._world)

    def allgather_coalesced(self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                            opts: Any = None) -> NetStormWork:
        return self.allgather(outputs, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> NetStormWork:
        """``all_gather_into_tensor``: ``output`` holds every rank's ``input`` in rank order."""
        pieces = list(output.reshape(self._world, -1).unbind(0))
        return self._allgather([[p.view(input.shape) for p in pieces]], [input], [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> NetStormWork:
        outs = [[p.view(i.shape) for p in o.reshape(self._world, -1).unbind(0)] for o, i in zip(outputs, inputs,
                                                                                              strict=True)]
        return self._allgather(outs, list(inputs), list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def gather(self, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],  # type: ignore[override]
               opts: Any = None) -> NetStormWork:
        """The root's ``outputs[0]`` gets every rank's ``inputs[0]``; the others' outputs are empty."""
        root = opts.rootRank if opts is not None else 0
        inputs = list(inputs)
        lists = [list(out) for out in outputs]
        if self._rank == root and (len(lists) != len(inputs) or any(len(out) != self._world for out in lists)):
            raise ValueError(f"netstorm backend: gather at its root needs {len(inputs)} output lists of "
                             f"{self._world} tensors each")

        def finish(gathered: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
            if self._rank == root:
                for out, values in zip(lists, gathered, strict=True):
                    for target, value in zip(out, values, strict=True):
                        with torch.no_grad():
                            target.copy_(value.view(target.shape))
            return lists

        return self._gather_exact(inputs, f"gather to rank {root}", finish, self._world)

    def scatter(self, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]],  # type: ignore[override]
                opts: Any = None) -> NetStormWork:
        """Each rank's ``outputs[0]`` gets the root's ``inputs[0][rank]``: a sum where the root fills every
        rank's slot."""
        root = opts.rootRank if opts is not None else 0
        outputs = list(outputs)
        world, rank = self._world, self._rank
        sizes = [codec.bits_size(t) for t in outputs]
        rows = [list(row) for row in inputs]
        if rank == root and (len(rows) != len(outputs) or any(len(row) != world for row in rows)):
            raise ValueError(f"netstorm backend: scatter at its root needs {len(outputs)} input lists of {world} "
                             f"tensors each")

        def encode() -> np.ndarray:
            parts = []
            for index, size in enumerate(sizes):
                part = np.zeros(world * size, np.float32)
                if rank == root:
                    for r, tensor in enumerate(rows[index]):
                        part[r * size:(r + 1) * size] = codec.bits(tensor)
                parts.append(part)
            return np.concatenate(parts) if parts else np.zeros(0, np.float32)

        def finish(summed: np.ndarray) -> list[torch.Tensor]:
            position = 0
            for tensor, size in zip(outputs, sizes, strict=True):
                codec.store_bits(tensor, summed[position + rank * size:position + (rank + 1) * size])
                position += world * size
            return outputs

        return self._submit(f"scatter from rank {root}", encode, finish, exact=True)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], opts: Any = None) -> NetStormWork:
        """``all_to_all_single``: ``input``'s dim-0 parts go one to each rank, ``output`` gathers theirs."""
        world = self._world
        rows = input.shape[0] if input.dim() else 1
        splits = list(input_split_sizes) or [rows // world] * world
        row_bytes = (input.numel() // max(rows, 1)) * input.element_size()
        sends = [n * row_bytes for n in splits]
        if len(sends) != world or sum(splits) != rows:
            raise ValueError(f"netstorm backend: all_to_all_single: input splits {splits} for {rows} rows and "
                             f"{world} ranks")
        raw = codec.raw_bytes(input)
        cuts = np.cumsum([0, *sends])
        parts = [raw[cuts[j]:cuts[j + 1]] for j in range(world)]

        def place(received: list[np.ndarray]) -> list[torch.Tensor]:
            joined = np.concatenate(received) if received else np.zeros(0, np.uint8)
            if joined.size != output.numel() * output.element_size():
                raise ValueError(f"all_to_all_single: {joined.size} bytes came for an output of "
                                 f"{output.numel() * output.element_size()}")
            codec.store_raw(output, joined)
            return [output]

        return self._alltoall(parts, place, "all_to_all_single")

    all_to_all_single = alltoall_base  # type: ignore[assignment]

    def alltoall(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                 opts: Any = None) -> NetStormWork:
        """``all_to_all``: ``inputs[j]`` goes to rank j, ``outputs[j]`` comes from it."""
        outputs = list(outputs)
        parts = [codec.raw_bytes(t) for t in inputs]
        if len(parts) != self._world or len(outputs) != self._world:
            raise ValueError(f"netstorm backend: all_to_all needs {self._world} inputs and outputs")

        def place(received: list[np.ndarray]) -> list[torch.Tensor]:
            for target, raw in zip(outputs, received, strict=True):
                codec.store_raw(target, raw)
            return outputs

        return self._alltoall(parts, place, "all_to_all")

    def _alltoall(self, parts: list[np.ndarray], place: Callable[[list[np.ndarray]], Any], what: str) -> NetStormWork:
        """``parts[j]`` (bytes) to rank j: one exact sum of the byte counts (a world x world grid, this rank's
        row filled), then one of the bytes, each (source, destination) pair in its own slot."""
        world, rank = self._world, self._rank
        counts = np.zeros(world * world, np.float32)
        counts[rank * world:(rank + 1) * world] = [float(p.size) for p in parts]
        encoded = [codec.pieces(p) for p in parts]
        began = time.perf_counter()

        def run() -> Any:
            grid = np.rint(self._sum(counts, exact=True)).astype(np.int64).reshape(world, world)
            slots = (grid + 1) // 2  # pieces per pair
            starts = np.concatenate([[0], np.cumsum(slots.reshape(-1))]).astype(np.int64)
            payload = np.zeros(int(starts[-1]), np.float32)
            for j in range(world):
                at = int(starts[rank * world + j])
                payload[at:at + encoded[j].size] = encoded[j]
            summed = self._sum(payload, exact=True)
            received = []
            for src in range(world):
                at = int(starts[src * world + rank])
                received.append(codec.unpieces(summed[at:at + int(slots[src, rank])], int(grid[src, rank])))
            return place(received)

        self.stage.charge(time.perf_counter() - began)
        return self.channel.submit(f"{what}, {sum(p.size for p in parts)} bytes", run)

    def barrier(self, opts: Any = None) -> NetStormWork:
        return self._submit("barrier", lambda: np.zeros(1, np.float32), lambda summed: [], exact=True)

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    # ---- what sums cannot do --------------------------------------------------------------------------

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int = 0) -> NetStormWork:
        raise self._unsupported(f"send to rank {dst}", "point-to-point transfers need only two ranks, and every "
                                                       "node iteration holds every rank of the job: use broadcast "
                                                       "or scatter, or a gloo group for point-to-point")

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int = 0) -> NetStormWork:
        raise self._unsupported(f"recv from rank {src}", "point-to-point transfers need only two ranks, and every "
                                                         "node iteration holds every rank of the job: use broadcast "
                                                         "or scatter, or a gloo group for point-to-point")

    def recv_anysource(self, tensors: Sequence[torch.Tensor], tag: int = 0) -> NetStormWork:
        raise self._unsupported("recv from any source", "point-to-point transfers need only two ranks")


COLLECTIVES = ("allreduce", "allreduce_coalesced", "allreduce_compressed", "reduce", "reduce_scatter",
               "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
               "reduce_scatter_single_coalesced", "broadcast", "allgather", "allgather_coalesced",
               "all_gather_single", "_allgather_base", "allgather_into_tensor_coalesced",
               "all_gather_single_coalesced", "gather", "scatter", "alltoall_base", "all_to_all_single", "alltoall",
               "barrier", "monitored_barrier", "send", "recv", "recv_anysource")
"""The group's methods torch.compile must run as they are, never trace: DDP under torch.compile calls the
group from code dynamo traces (the bucket rebuild's broadcast), and a collective queues work for a thread."""
for _name in COLLECTIVES:
    setattr(ProcessGroupNetStorm, _name, torch.compiler.disable(getattr(ProcessGroupNetStorm, _name)))

def create(options: Any, backend_options: Any = None) -> ProcessGroupNetStorm:
    """The creator ``register_backend`` calls (its extended form: the group's job ranks come with it).

    The whole job's group connects to this rank's node, registers the round and agrees on the job's ranks
    (``jobranks.agree``); a subgroup shares that connection (``Channel``)."""
    members = tuple(int(r) for r in (options.global_ranks_in_group or ()))
    rank, size = int(options.group_rank), int(options.group_size)
    if members:
        default = dist.distributed_c10d._get_default_group()
        if not isinstance(default, ProcessGroupNetStorm):
            raise UnsupportedCollective(f"netstorm backend: new_group of ranks {list(members)} needs the default "
                                        f"group on netstorm too (it shares that group's node connection), not "
                                        f"{default.name()}")
        return ProcessGroupNetStorm(default.channel, rank, size, members)
    return connect(rank, size, options.timeout)


def connect(launcher_rank: int, launcher_world: int, timeout: datetime.timedelta) -> ProcessGroupNetStorm:
    """The whole job's group: join this rank's node, register the round, agree on the job's ranks."""
    import netstorm
    from netstorm.compression.options import CompressionOptions
    from netstorm.config import resolve

    config = resolve(environ=os.environ)
    address = socket_address(config.torch_socket, launcher_rank, ranks_per_dc=config.torch_ranks_per_dc)
    where = address or os.environ.get("NETSTORM_SOCKET")
    client = netstorm.connect(address, timeout=timeout.total_seconds())
    try:
        stage = Stage(client, config.torch_round, CompressionOptions.of(config), seed=launcher_rank,
                      on_dc_loss=config.on_dc_loss)
    except Exception as exc:
        client.close()
        raise NetStormBackendError(f"netstorm backend: rank {launcher_rank} could not join at its node "
                                   f"({where}): {type(exc).__name__}: {exc}") from exc
    joined = None
    try:
        if stage.rejoining:  # a restarted DC: wait for the job's next step boundary, take the live state
            joined = rejoin.join(stage, launcher_rank, launcher_world, timeout.total_seconds())
            job = joined.job
        else:
            job = agree(stage, launcher_rank, launcher_world)
    except Exception as exc:
        stage.close()
        raise NetStormBackendError(f"netstorm backend: rank {launcher_rank} of {launcher_world} at node "
                                   f"{stage.node_id} ({where}): {type(exc).__name__}: {exc}") from exc
    channel = Channel(stage, job.rank)
    channel.job = job
    channel.launcher = (launcher_rank, launcher_world)
    channel.joined = joined
    return ProcessGroupNetStorm(channel, job.rank, job.world)


def register() -> None:
    """Make ``"netstorm"`` a ``torch.distributed`` backend (idempotent; ``import netstorm.torch`` calls it)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])


class Boundary(NamedTuple):
    """What ``step_boundary`` found."""

    step: int
    """The step to train next: the caller's, or at a restarted DC's ranks the survivors'."""
    rejoined: bool
    """A restarted DC joined the group here: every rank must build its DDP wrapper again (a fresh one
    buckets alike on every rank; the joiner's is new)."""
    loaded: bool = False
    """This rank is a restarted DC's: it loaded the live state here."""


def _group(group: dist.ProcessGroup | None) -> ProcessGroupNetStorm:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupNetStorm):
        raise TypeError(f"not a netstorm process group: {type(pg).__name__} of backend {pg.name()}")
    return pg


def step_boundary(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, step: int = 0,
                  group: dist.ProcessGroup | None = None) -> Boundary:
    """Call between training steps (``on_dc_loss = "continue"``): where a DC lost earlier was restarted with
    its command line, its ranks join the group here and load the live model and optimizer state.

    At a survivor it costs nothing unless the nodes have reported a restarted DC among a sum's
    contributors; then the lowest surviving rank sends ``model``'s and ``optimizer``'s state dicts (and
    ``step``) to the joiners (``netstorm.torch.rejoin``). At a joiner's rank, whose
    ``init_process_group`` returned once it had taken that state, it loads it into ``model`` and
    ``optimizer``. Either way ``rejoined`` says the group changed, and the step to train next comes back."""
    pg = _group(group)
    channel = pg.channel
    if pg.members is not None:
        raise UnsupportedCollective("netstorm backend: step_boundary runs on the whole job's group")
    if channel.joined is not None:
        joined, channel.joined = channel.joined, None
        state = torch.load(io.BytesIO(joined.state), weights_only=True)  # tensors and containers only
        model.load_state_dict(state["model"])
        if optimizer is not None:
            if state["optimizer"] is None:
                raise rejoin.RejoinError(f"step_boundary: rank {joined.source} sent no optimizer state")
            optimizer.load_state_dict(state["optimizer"])
        return Boundary(joined.step, True, True)
    stage = channel.stage
    if not stage.may_rejoin or not channel.run("step boundary", lambda: stage.join_pending):
        return Boundary(step, False)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict() if optimizer is not None else None},
               buffer)
    job = channel.job
    assert job is not None
    launcher_rank, launcher_world = channel.launcher
    channel.run(f"rejoin of DC(s) {list(stage.join_pending)} at step {step}",
                lambda: rejoin.survive(stage, launcher_rank, launcher_world, job, buffer.getvalue(), step))
    return Boundary(step, True)


def stats(group: dist.ProcessGroup | None = None) -> StageStats:
    """The backend's counts and seconds for ``group`` (default: the default group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupNetStorm):
        raise TypeError(f"not a netstorm process group: {type(pg).__name__} of backend {pg.name()}")
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


def mean_hook(group: ProcessGroupNetStorm, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP comm hook: each gradient bucket's mean over the ranks the nodes counted, not over the group's
    size as DDP divides by. With ``on_dc_loss = "continue"`` it is the survivors' mean after a DC was
    lost; ``ddp.register_comm_hook(group, mean_hook)``."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG  # type: ignore[assignment]
    return group.allreduce([bucket.buffer()], opts).get_future().then(lambda f: f.value()[0])


mean_hook.__annotations__ = {"group": ProcessGroupNetStorm, "bucket": dist.GradBucket,
                             "return": Future[torch.Tensor]}
