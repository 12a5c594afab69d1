"""The job's ranks, agreed through the nodes: one torchrun across the job, or one torchrun per DC.

Three small exact sums right after the init round give the job's rank count, each DC's ranks, and a
check that the job ranks are a permutation of 0..N-1; WORLD_SIZE says which launch shape a rank is in
(docs/ARCHITECTURE.md, *PyTorch: job-wide ranks*).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from netstorm.errors import ConfigError


class Reducer(Protocol):
    """The part of ``Stage`` the agreement uses."""

    @property
    def workers(self) -> int: ...

    @property
    def node_id(self) -> int: ...

    def reduce(self, payload: np.ndarray, *, average: bool = False, exact: bool = False) -> np.ndarray: ...

    def contributors(self) -> tuple[int, ...]: ...


class LaunchError(ConfigError):
    """The ranks' launch does not add up to one job (WORLD_SIZE fits neither shape, ranks collide)."""


@dataclasses.dataclass(frozen=True)
class JobRanks:
    """This rank's place in the job, the same picture at every rank."""

    rank: int
    """Unique across the job, 0..world-1."""
    world: int
    """Every rank of every DC."""
    dcs: tuple[int, ...]
    """The DCs' node ids, ascending."""
    counts: tuple[int, ...]
    """Ranks per DC, in ``dcs`` order."""
    dc_of: tuple[int, ...]
    """For each job rank, the node id of its DC."""
    per_dc: bool
    """The launcher's RANK was a rank within the DC (one torchrun per DC)."""

    def ranks_of(self, dc: int) -> tuple[int, ...]:
        return tuple(r for r, d in enumerate(self.dc_of) if d == dc)


def decide(launcher_rank: int, launcher_world: int, node_id: int, dcs: Sequence[int],
           counts: Sequence[int]) -> tuple[int, bool]:
    """The job rank from the launcher's RANK/WORLD_SIZE and every DC's rank count: (rank, per_dc)."""
    total = int(sum(counts))
    mine = dcs.index(node_id)
    own = int(counts[mine])
    if launcher_world == total:
        if not 0 <= launcher_rank < total:
            raise LaunchError(f"RANK {launcher_rank} is outside 0..{total - 1}")
        return launcher_rank, False
    if launcher_world == own:
        if not 0 <= launcher_rank < own:
            raise LaunchError(f"RANK {launcher_rank} is outside this DC's 0..{own - 1}")
        return int(sum(counts[:mine])) + launcher_rank, True
    shares = ", ".join(f"DC {d}: {c}" for d, c in zip(dcs, counts, strict=True))
    raise LaunchError(
        f"WORLD_SIZE is {launcher_world}, but the job has {total} ranks ({shares}) and this rank's DC {node_id} "
        f"has {own}: launch one torchrun across the job with WORLD_SIZE {total}, or one torchrun per DC with "
        f"--nproc-per-node equal to that DC's ranks ({own} here); each DC's node counts the ranks that connect "
        f"to it, its trainers option")


def agree(stage: Reducer, launcher_rank: int, launcher_world: int) -> JobRanks:
    """Run the three sums (see the module docstring) and return this rank's place in the job."""
    total = round(float(stage.reduce(np.ones(1, np.float32), exact=True)[0]))
    if total != stage.workers:
        raise LaunchError(f"{total} ranks took part in the job's first sum, but the nodes count {stage.workers} "
                          f"trainers: every trainer of a netstorm job must be a rank of its process group")
    dcs = tuple(sorted(stage.contributors())) or (stage.node_id,)
    if stage.node_id not in dcs:
        raise LaunchError(f"node {stage.node_id} is not among the DCs of the job's first sum {list(dcs)}")
    slots = np.zeros(len(dcs), np.float32)
    slots[dcs.index(stage.node_id)] = 1.0
    counts = tuple(round(float(c)) for c in stage.reduce(slots, exact=True))
    try:
        rank, per_dc = decide(launcher_rank, launcher_world, stage.node_id, dcs, counts)
        failed = ""
    except LaunchError as exc:  # still take part in the last sum, so no other rank waits for this one
        rank, per_dc, failed = -1, False, str(exc)
    claims = np.zeros(2 * total, np.float32)
    if rank >= 0:
        claims[rank] = 1.0
        claims[total + rank] = float(dcs.index(stage.node_id) + 1)
    summed = np.rint(stage.reduce(claims, exact=True)).astype(np.int64)
    if failed:
        raise LaunchError(failed)
    taken, where = summed[:total], summed[total:]
    if not np.array_equal(taken, np.ones(total, np.int64)):
        twice = [int(r) for r in np.flatnonzero(taken > 1)]
        missing = [int(r) for r in np.flatnonzero(taken == 0)]
        raise LaunchError(f"the job's ranks are no permutation of 0..{total - 1}: ranks {twice} claimed more than "
                          f"once, {missing} by no rank (every DC must launch alike: one torchrun across the job, "
                          f"or one per DC)")
    return JobRanks(rank, total, dcs, counts, tuple(dcs[int(w) - 1] for w in where), per_dc)


def socket_address(template: str, rank: int, environ: Mapping[str, str] | None = None,
                   ranks_per_dc: int = 0) -> str | None:
    """The rank's node address from the ``torch_socket`` template (None: NETSTORM_SOCKET decides).

    Fields: ``{rank}``, ``{local_rank}``, ``{group_rank}`` (torchrun's variables), ``{dc_index}`` (the rank's
    DC counted from 0 in rank order: RANK // ranks per DC, ``torch_ranks_per_dc`` or else torchrun's
    LOCAL_WORLD_SIZE) and ``{dc}`` (``dc_index`` + 1: the DC's id where DCs are numbered from 1, as
    ``netstorm local`` numbers its nodes). So one torchrun across the DCs of one host finds every DC's node
    with ``RUN/node-{dc}.sock``."""
    if not template:
        return None
    env = os.environ if environ is None else environ
    per_dc = ranks_per_dc or int(env.get("LOCAL_WORLD_SIZE", 0) or 0)
    fields: dict[str, int] = {"rank": rank, "local_rank": int(env.get("LOCAL_RANK", rank)),
                              "group_rank": int(env.get("GROUP_RANK", 0))}
    if per_dc > 0:
        fields["dc_index"] = rank // per_dc
        fields["dc"] = rank // per_dc + 1
    try:
        return template.format(**fields)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"torch_socket {template!r}: use the fields {{rank}}, {{local_rank}}, {{group_rank}}, "
                          f"{{dc_index}}, {{dc}} ({{dc}} and {{dc_index}} need torch_ranks_per_dc or "
                          f"LOCAL_WORLD_SIZE): {exc}") from None
