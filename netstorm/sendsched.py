"""The sender's communication scheduler (paper Fig. 7): primary path first, idle auxiliary paths next.

One ``PathScheduler`` per tree edge ``src -> dst``. Paths are node-id tuples from ``src`` to ``dst``:
the primary (the tree edge itself, or its route) and the auxiliary paths of Algorithm 3, fastest
first. A new chunk goes to the primary unless more than ``busy_bound`` chunks are already in flight
on it; then to the first auxiliary path with fewer than ``aux_queue_length`` chunks in flight whose
first hop is idle; when no auxiliary path qualifies, to the primary again (its queue is where waiting
is cheapest).

"Idle first hop" is the caller's judgement (the node: nothing queued for that neighbour). The paper
offloads onto idle links; counting only this edge's own auxiliary chunks would also offload onto a
link that is saturated by other trees, and when the trees are packed onto every link's capacity (LP
tree packing) that slows the very links the plan relies on.

"In flight" means chosen and not yet handed off the first hop's socket: the node calls ``done``
when the chunk's last byte has left (it then counts against the link, not against this queue).
The scheduler never blocks: back-pressure is the per-neighbour send queue's job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

Path = tuple[int, ...]


class PathScheduler:
    """Chooses the path of each chunk on one tree edge and counts chunks in flight per path."""

    def __init__(self, primary: Path, aux: Sequence[Path], *, busy_bound: int, aux_queue_length: int,
                 enabled: bool) -> None:
        primary = tuple(primary)
        if len(primary) < 2 or len(set(primary)) != len(primary):
            raise ValueError(f"primary path {primary} must join two distinct nodes without repeats")
        if busy_bound < 0 or aux_queue_length < 0:
            raise ValueError(f"busy_bound ({busy_bound}) and aux_queue_length ({aux_queue_length}) "
                             f"must be >= 0")
        aux_paths: list[Path] = []
        for path in aux:
            path = tuple(path)
            if path[:1] != primary[:1] or path[-1:] != primary[-1:] or len(set(path)) != len(path):
                raise ValueError(f"auxiliary path {path} must run from {primary[0]} to {primary[-1]} "
                                 f"without repeats")
            if path != primary and path not in aux_paths:
                aux_paths.append(path)
        self.primary = primary
        self.aux: tuple[Path, ...] = tuple(aux_paths)
        self.busy_bound = busy_bound
        self.aux_queue_length = aux_queue_length
        self.enabled = enabled
        self._in_flight: dict[Path, int] = {primary: 0, **{p: 0 for p in self.aux}}

    @property
    def in_flight(self) -> Mapping[Path, int]:
        """Chunks chosen and not yet done, per path (a copy)."""
        return dict(self._in_flight)

    def choose(self, idle: Callable[[int], bool] | None = None) -> Path:
        """The path for the next chunk; counts it as in flight on that path. ``idle(neighbour)``: whether
        the link to that neighbour has nothing waiting (None: every link counts as idle)."""
        path = self._pick(idle)
        self._in_flight[path] += 1
        return path

    def _pick(self, idle: Callable[[int], bool] | None) -> Path:
        if not self.enabled or self._in_flight[self.primary] <= self.busy_bound:
            return self.primary
        for path in self.aux:
            if self._in_flight[path] < self.aux_queue_length and (idle is None or idle(path[1])):
                return path
        return self.primary

    def done(self, path: Path) -> None:
        """A chunk sent on ``path`` has left the first hop's socket."""
        path = tuple(path)
        count = self._in_flight.get(path)
        if count is None:
            raise ValueError(f"path {path} is not one of this scheduler's paths "
                             f"({self.primary} and {len(self.aux)} auxiliary)")
        if count == 0:
            raise ValueError(f"path {path} has no chunk in flight")
        self._in_flight[path] = count - 1
