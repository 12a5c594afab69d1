"""The topology-consistency protocol (paper §VII-A) as a sans-I/O core.

Every node asks for iteration k's policy before its PUSH. The first request for k binds k to the
scheduler's current policy version; every later request for k, from any node, gets that same version,
so all nodes run iteration k on one set of trees. A new policy from the planner becomes current only
for iterations not yet bound, so an iteration in flight never changes under the nodes' feet, and a
node may ask for k+1 while k runs (the round trip stays off the critical path).

A DC admitted into the running job joins at a boundary: the policy that includes it is published with
``joining``, and the first iteration bound after that (``boundary`` binds it at once if no node has
asked yet) carries the joiners in its answers. Every node then runs that iteration as the hand-over of
the live model rather than as a gradient sum.

Memory stays bounded: only the last ``window`` bound iterations are remembered, and a request for an
older iteration is refused rather than silently bound to a possibly different version.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from netstorm.errors import NetStormError

log = logging.getLogger(__name__)


class ConsistencyError(NetStormError):
    """A policy request cannot be answered consistently (no policy yet, iteration too old)."""


class WirePolicy(Protocol):
    """What the core needs of a policy: a version and a wire form (netstorm.policy.Policy has both)."""

    @property
    def version(self) -> int: ...

    def to_wire(self) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class Answer:
    """The reply to one policy request: ``policy`` is None when the node already holds ``version``."""

    iteration: int
    version: int
    policy: dict[str, Any] | None
    newly_bound: bool
    """This request bound the iteration (the shell logs which version each iteration got)."""
    joining: tuple[int, ...] = ()
    """DCs admitted at this iteration (it hands them the model)."""


class Consistency:
    """Policy versions and the iteration -> version bindings."""

    def __init__(self, *, window: int = 4096) -> None:
        if window < 2:
            raise ValueError("window must hold at least two iterations")
        self._window = window
        self._policies: dict[int, WirePolicy] = {}
        self._wire: dict[int, dict[str, Any]] = {}
        self._current: int | None = None
        self._bindings: dict[int, int] = {}
        self._forgotten_below = 0
        """Iterations below this were bound once and forgotten; they can no longer be answered."""
        self._joiners: set[int] = set()
        """Admitted DCs whose boundary iteration is not bound yet."""
        self._joining: dict[int, tuple[int, ...]] = {}
        """Boundary iteration -> the DCs it admits (within the remembered window)."""

    @property
    def current_version(self) -> int | None:
        return self._current

    @property
    def bindings(self) -> dict[int, int]:
        """iteration -> version, for the remembered window (a copy)."""
        return dict(self._bindings)

    def bound_version(self, iteration: int) -> int | None:
        """The version bound to ``iteration`` (None when unbound or forgotten)."""
        return self._bindings.get(iteration)

    @property
    def last_bound(self) -> int:
        """The newest bound iteration (-1 before any)."""
        return max(self._bindings, default=self._forgotten_below - 1)

    @property
    def joining(self) -> dict[int, tuple[int, ...]]:
        """Boundary iteration -> the DCs it admitted (a copy)."""
        return dict(self._joining)

    def policy(self, version: int) -> WirePolicy:
        return self._policies[version]

    def publish(self, policy: WirePolicy, *, joining: tuple[int, ...] = ()) -> None:
        """Make ``policy`` current for every iteration not yet bound. Versions must increase. ``joining``:
        the DCs it admits, handed the model at the next iteration bound."""
        self._joiners.update(joining)
        version = policy.version
        if self._current is not None and version <= self._current:
            raise ConsistencyError(f"policy version {version} is not newer than the current {self._current}")
        self._policies[version] = policy
        self._wire[version] = policy.to_wire()
        self._current = version
        self._drop_unreferenced()

    def next_version(self) -> int:
        return 0 if self._current is None else self._current + 1

    def request(self, iteration: int, known_version: int) -> Answer:
        """Answer a node's request for ``iteration``'s policy, binding the iteration if it is new."""
        if iteration < 0:
            raise ConsistencyError(f"iteration must be >= 0, got {iteration}")
        newly_bound = False
        version = self._bindings.get(iteration)
        if version is None:
            if iteration < self._forgotten_below:
                raise ConsistencyError(
                    f"iteration {iteration} is too old: bindings below {self._forgotten_below} are forgotten")
            if self._current is None:
                raise ConsistencyError(f"no policy has been planned yet for iteration {iteration}")
            version = self._current
            self._bindings[iteration] = version
            newly_bound = True
            if self._joiners:
                self._joining[iteration] = tuple(sorted(self._joiners))
                self._joiners.clear()
            self._forget_old()
        policy = None if known_version == version else self._wire[version]
        return Answer(iteration, version, policy, newly_bound, self._joining.get(iteration, ()))

    def boundary(self, node_id: int) -> Answer:
        """The iteration that admits ``node_id``: bound now (the one after the newest bound) if no node
        has asked for it yet."""
        if node_id in self._joiners:
            return self.request(self.last_bound + 1, -1)
        for iteration, joiners in sorted(self._joining.items(), reverse=True):
            if node_id in joiners:
                return self.request(iteration, -1)
        raise ConsistencyError(f"node {node_id} was not admitted by any published policy")

    def restore(self, policies: Sequence[WirePolicy], bindings: dict[int, int],
                joining: dict[int, tuple[int, ...]]) -> None:
        """A restarted scheduler's persisted versions (oldest first) and bindings: answers stay the same."""
        for policy in policies:
            self._policies[policy.version] = policy
            self._wire[policy.version] = policy.to_wire()
        self._current = max(self._policies, default=None)
        self._bindings = {k: v for k, v in bindings.items() if v in self._policies}
        self._joining = {k: j for k, j in joining.items() if k in self._bindings}
        if len(self._bindings) > self._window:
            self._forget_old()
        else:
            self._drop_unreferenced()

    def _forget_old(self) -> None:
        if len(self._bindings) <= self._window:
            return
        for iteration in sorted(self._bindings)[: len(self._bindings) - self._window]:
            del self._bindings[iteration]
            self._joining.pop(iteration, None)
            self._forgotten_below = max(self._forgotten_below, iteration + 1)
        self._drop_unreferenced()

    def _drop_unreferenced(self) -> None:
        keep = set(self._bindings.values())
        if self._current is not None:
            keep.add(self._current)
        for version in [v for v in self._policies if v not in keep]:
            del self._policies[version]
            del self._wire[version]
