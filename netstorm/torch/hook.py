"""A DDP communication hook: gloo or NCCL inside a DC, NetStorm across DCs (hybrid replication).

See docs/ARCHITECTURE.md, *PyTorch*."""

from __future__ import annotations

import os
import queue
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from netstorm.compression.options import CompressionOptions
from netstorm.torch import codec
from netstorm.torch.backend import NetStormBackendError, NetStormWork
from netstorm.torch.stage import Stage, StageStats


class NetStormHookState:
    """The hook's state: the DC's process group, which rank of it leads, and the leader's stage."""

    def __init__(self, stage: Stage | None, group: dist.ProcessGroup | None = None, leader: int = 0) -> None:
        self.group = group
        self.leader = leader
        """The leader's rank within ``group``."""
        self.local_rank = dist.get_rank(group)
        self.local_size = dist.get_world_size(group)
        self.leader_global = dist.get_global_rank(group, leader) if group is not None else leader
        if (self.local_rank == leader) != (stage is not None):
            raise ValueError("exactly the leader holds a stage (a connection to its DC's node)")
        self.stage = stage
        self._buckets = 0
        self._ranks = 0.0
        """Ranks of the whole job, summed by the leaders once (compression only)."""
        self._error: BaseException | None = None
        self._jobs: queue.Queue[tuple[torch.Tensor, tuple[int, ...], NetStormWork] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="netstorm-hook", daemon=True)
        self._worker.start()

    @classmethod
    def connect(cls, group: dist.ProcessGroup | None = None, *, leader: int = 0, address: str | None = None,
                round_elements: int | None = None, timeout: float | None = None,
                compression: CompressionOptions | None = None) -> NetStormHookState:
        """The leader connects to its node (``address``, else the ``torch_socket`` template, else
        NETSTORM_SOCKET) and registers the round with the job's compression (``compression``, else the
        resolved options: NETSTORM_COMPRESSION, NETSTORM_FEDIAC_K, ...); the other ranks of the DC only
        keep the group. Every leader must use the same compression and round (the layout hash checks)."""
        import netstorm
        from netstorm.config import resolve
        from netstorm.torch.jobranks import socket_address

        stage = None
        if dist.get_rank(group) == leader:
            config = resolve(environ=os.environ)
            where = address if address is not None else socket_address(config.torch_socket, dist.get_rank(),
                                                                                 ranks_per_dc=config.torch_ranks_per_dc)
            client = netstorm.connect(where) if timeout is None else netstorm.connect(where, timeout=timeout)
            options = compression if compression is not None else CompressionOptions.of(config)
            try:
                stage = Stage(client, round_elements or config.torch_round, options, seed=dist.get_rank())
            except BaseException:
                client.close()
                raise
        return cls(stage, group, leader)

    def stats(self) -> StageStats | None:
        """The leader's counts and seconds (None on the other ranks)."""
        return self.stage.snapshot() if self.stage is not None else None

    def submit(self, tensor: torch.Tensor, bucket: tuple[int, ...] = ()) -> NetStormWork:
        """Queue a bucket; ``bucket`` keys its error feedback under compression (the same at every rank)."""
        work = NetStormWork()
        self._jobs.put((tensor, bucket or (0, tensor.numel()), work))
        return work

    def close(self) -> None:
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join(timeout=5.0)
        if self.stage is not None:
            self.stage.close()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            tensor, bucket, work = job
            self._buckets += 1
            if self._error is not None:
                work.fail(self._error)
                continue
            try:
                self._sync(tensor, bucket)
            except Exception as exc:  # the bucket's future carries it to DDP as a torch error
                error = exc if isinstance(exc, NetStormBackendError) else NetStormBackendError(
                    f"netstorm hook: rank {dist.get_rank()}: bucket #{self._buckets} failed: "
                    f"{type(exc).__name__}: {exc}")
                self._error = error
                work.fail(error)
                continue
            work.complete(tensor)

    def _sync(self, tensor: torch.Tensor, bucket: tuple[int, ...]) -> None:
        if self.local_size > 1:
            dist.all_reduce(tensor, group=self.group)
        packet = torch.empty(tensor.numel() + 1, dtype=torch.float32)
        if self.stage is not None:
            try:
                summed = self._across(tensor, bucket)
            except Exception as exc:
                failure = NetStormBackendError(
                    f"netstorm hook: DC {self.stage.node_id} (leader rank {dist.get_rank()}): bucket #{self._buckets} "
                    f"failed after node iteration {self.stage.iteration}: {type(exc).__name__}: {exc}")
                if self.local_size > 1:
                    packet.zero_()
                    packet[-1] = -1.0
                    dist.broadcast(packet, src=self.leader_global, group=self.group)
                raise failure from exc
            began = time.perf_counter()
            total = summed[-1]
            packet.copy_(torch.from_numpy(summed))
            packet[:-1].div_(float(total))
            self.stage.charge(time.perf_counter() - began)
        if self.local_size > 1:
            dist.broadcast(packet, src=self.leader_global, group=self.group)
        if packet[-1].item() < 0:
            raise NetStormBackendError(f"netstorm hook: rank {dist.get_rank()}: bucket #{self._buckets}: the DC's "
                                       f"leader (rank {self.leader_global}) failed to sync it across DCs")
        with torch.no_grad():
            tensor.copy_(packet[:-1].reshape(tensor.shape).to(tensor.dtype))

    def _across(self, tensor: torch.Tensor, bucket: tuple[int, ...]) -> np.ndarray:
        """The leader's part: the DC sums summed over the DCs, and the job's rank count as the last element."""
        stage = self.stage
        assert stage is not None
        began = time.perf_counter()
        values = codec.values(tensor)
        if stage.compression.method == "none":
            payload = np.concatenate([values, np.array([self.local_size], np.float32)])
            stage.charge(time.perf_counter() - began)
            return stage.reduce(payload)
        stage.charge(time.perf_counter() - began)
        if not self._ranks:  # small integers: exact in every lane, fp16's included
            self._ranks = float(stage.reduce(np.array([self.local_size], np.float32), exact=True)[0])
        summed = stage.reduce_compressed(values, bucket)
        return np.concatenate([summed, np.array([self._ranks], np.float32)])


def netstorm_hook(state: NetStormHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP comm hook: the bucket's mean over every rank of every DC (see the module docstring)."""
    buffer = bucket.buffer()
    return state.submit(buffer, (bucket.index(), buffer.numel())).get_future()


# DDP's register_comm_hook checks the annotations as objects; this module's are strings (postponed).
netstorm_hook.__annotations__ = {"state": NetStormHookState, "bucket": dist.GradBucket,
                                 "return": Future[torch.Tensor]}
