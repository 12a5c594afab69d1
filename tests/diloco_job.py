"""An in-process stand-in for a job's nodes, for DiLoCo's fast tests: DCs' clients in threads whose
push_pull sums every live DC's tensors in DC order (so a run equals ``diloco.reference`` bit for bit),
names the live DCs as contributors, and fails an iteration in progress with PeerLost when a DC is killed.
The NetStorm run itself is tests/test_diloco_netstorm.py (slow)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from netstorm.errors import NodeGone, PeerLost

TIMEOUT = 10.0


class Job:
    def __init__(self, dcs: list[int]) -> None:
        self.members = set(dcs)
        self.initial = set(dcs)
        self.cond = threading.Condition()
        self.pushes: dict[int, dict[int, dict[str, np.ndarray]]] = {}
        self.results: dict[int, tuple[dict[str, Any], tuple[int, ...]] | None] = {}
        self.bound: dict[int, frozenset[int]] = {}
        self.providers: dict[int, Any] = {}
        self.iterations = 0
        self.joining: dict[int, threading.Event] = {}
        self.after_push: Any = None
        """after_push(iteration, dc), called with the job locked once a DC's push is in (a fault injector)."""

    def client(self, dc: int) -> Client:
        return Client(self, dc)

    def kill(self, dc: int) -> None:
        with self.cond:
            self.kill_locked(dc)

    def kill_locked(self, dc: int) -> None:
        if True:
            self.members.discard(dc)
            self.providers.pop(dc, None)
            for it, members in self.bound.items():
                if dc in members and self.results.get(it, 0) == 0:
                    self.results[it] = None  # failed everywhere
            self.cond.notify_all()


class Client:
    def __init__(self, job: Job, dc: int) -> None:
        self.job = job
        self.node_id = dc
        self.contributors: tuple[int, ...] = ()
        self.wan_bytes = 0
        self.iteration = 0

    def set_model_provider(self, provider: Any) -> None:
        with self.job.cond:
            self.job.providers[self.node_id] = provider

    def init(self, tensors: Mapping[str, np.ndarray], *, compression: str = "none") -> dict[str, np.ndarray]:
        job = self.job
        with job.cond:
            first_init = job.pushes.setdefault(-1, {})
            if self.node_id in job.initial and self.node_id not in first_init:  # the lowest id's values
                first_init[self.node_id] = {k: np.array(v) for k, v in tensors.items()}
                job.cond.notify_all()
                job.cond.wait_for(lambda: len(job.pushes[-1]) == len(job.initial), TIMEOUT)
                first = job.pushes[-1][min(job.members)]
                return {k: np.array(v) for k, v in first.items()}
            # a joiner: admitted at the next iteration bound, with the live model of the lowest live DC
            job.members.add(self.node_id)
            boundary = job.iterations
            self.iteration = boundary + 1
            job.joining[boundary] = threading.Event()
            job.cond.notify_all()
            job.cond.wait_for(lambda: boundary in job.results, TIMEOUT)
            result = job.results[boundary]
            assert result is not None
            return {k: np.array(v) for k, v in result[0].items()}

    def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        job = self.job
        with job.cond:
            if self.node_id not in job.members:
                raise NodeGone(f"node {self.node_id} is dead")
            it = self.iteration
            while it in job.joining:  # the boundary: the provider hands the model, every push goes on
                boundary = it
                live = sorted(job.providers)
                if boundary in job.results:
                    pass
                elif live and live[0] == self.node_id:
                    model = job.providers[self.node_id]()
                    job.results[boundary] = ({k: np.array(v) for k, v in model.items()}, tuple(sorted(job.members)))
                    job.iterations = max(job.iterations, boundary + 1)
                    job.cond.notify_all()
                else:
                    job.cond.wait_for(lambda: boundary in job.results, TIMEOUT)  # noqa: B023 (waited here)
                it += 1
            if it not in job.bound:
                job.bound[it] = frozenset(job.members)
                job.iterations = max(job.iterations, it + 1)
            members = job.bound[it]
            job.pushes.setdefault(it, {})[self.node_id] = {k: np.array(v) for k, v in tensors.items()}
            if job.after_push is not None:
                job.after_push(it, self.node_id)
            if set(job.pushes[it]) >= members and it not in job.results:
                total = {k: np.sum([np.asarray(job.pushes[it][dc][k], np.float32 if np.asarray(v).dtype.kind == "f"
                                               else np.int64) for dc in sorted(members)], axis=0,
                                   dtype=np.float32 if np.asarray(v).dtype.kind == "f" else np.int64)
                         for k, v in tensors.items()}
                job.results[it] = (total, tuple(sorted(members)))
                job.cond.notify_all()
            if not job.cond.wait_for(lambda: it in job.results, TIMEOUT):
                raise TimeoutError(f"iteration {it} of DC {self.node_id}")
            self.iteration = it + 1
            result = job.results[it]
            if result is None:
                raise PeerLost(f"iteration {it} failed: a DC is gone")
            self.contributors = result[1]
            return {k: np.array(v) for k, v in result[0].items()}
