"""A DC restarted into a running job: its ranks take the live state from the survivors at a step boundary.

The runtime admits a restarted DC's node at a boundary node iteration, which hands the joiner's ``init``
what a live rank offers: for the torch backend, zeros with the round's control word set (``HANDOVER``).
From then on the joiner's nodes take part in every node iteration, wherever the survivors are in their
step. So the joiner's ranks push zeros, which change no survivor's sum (the survivors' means leave their
ranks out of the count), until the survivors reach a step boundary (``netstorm.torch.step_boundary``),
and the survivors, who saw the new DC among a sum's contributors, run this protocol there with them:

1. the announcement, one iteration: every survivor sets the control word to 1, which is how a joiner
   tells it from the survivors' collectives, and fills its job rank's slot of ``SLOT`` elements: 1,
   then the length of the serialized state and the step, each as four 16-bit pieces;
2. the job's ranks agreed again (``jobranks.agree``): the survivors' must come out as they were, the
   joiner learns its own;
3. the state, as 16-bit pieces from the lowest surviving rank (every survivor holds the same bytes).

Survivors pay nothing at a step boundary without a joiner: they look at what the nodes already told
them. Every sum is of whole 16-bit pieces or small integers, exact in float32.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

import numpy as np

from netstorm.errors import ConfigError, TrainerTimeout
from netstorm.torch.jobranks import JobRanks, LaunchError, Reducer, agree

SLOT = 9
"""Elements per job rank in the announcement: the survivor's 1, the state's length and the step."""
PIECES = 4
"""16-bit pieces of each 64-bit number."""
MAX_STATE_BYTES = 1 << 36
"""The largest state a joiner accepts (64 GiB): a larger announced length is a protocol error."""


class Exchanger(Reducer, Protocol):
    """The part of ``Stage`` the protocol uses."""

    @property
    def round(self) -> int: ...

    def exchange(self, payload: np.ndarray, control: float = 0.0) -> tuple[np.ndarray, float]: ...

    def admit_joiners(self) -> None: ...


class RejoinError(ConfigError):
    """The rejoin protocol found the job inconsistent: the survivors disagree, or the ranks came back
    otherwise than they were."""


@dataclasses.dataclass(frozen=True)
class Joined:
    """What a joiner's ranks take from the protocol."""

    job: JobRanks
    step: int
    state: bytes
    source: int
    """The job rank whose state it is."""


def _split(value: int) -> list[float]:
    return [float((value >> (16 * i)) & 0xFFFF) for i in range(PIECES)]


def _join(pieces: np.ndarray) -> int:
    return sum(round(float(p)) << (16 * i) for i, p in enumerate(pieces))


def announcement(rank: int, world: int, length: int, step: int) -> np.ndarray:
    """A survivor's announcement: its job rank's slot filled."""
    if length < 0 or step < 0:
        raise ValueError(f"the state's length ({length}) and the step ({step}) are counts")
    out = np.zeros(SLOT * world, np.float32)
    out[SLOT * rank:SLOT * (rank + 1)] = [1.0, *_split(length), *_split(step)]
    return out


def read_announcement(summed: np.ndarray, world: int) -> tuple[int, int, int]:
    """(source rank, state length, step) from the announcement's sum; every survivor must announce the same."""
    if SLOT * world > summed.size:
        raise RejoinError(f"an announcement for {world} ranks needs {SLOT * world} elements, the round has "
                          f"{summed.size}")
    slots = np.rint(summed[:SLOT * world]).reshape(world, SLOT)
    survivors = [r for r in range(world) if slots[r, 0] == 1.0]
    if not survivors or any(slots[r, 0] not in (0.0, 1.0) for r in range(world)):
        raise RejoinError(f"the announcement names the survivors {slots[:, 0].tolist()}: each job rank once")
    told = {(_join(slots[r, 1:1 + PIECES]), _join(slots[r, 1 + PIECES:])) for r in survivors}
    if len(told) != 1:
        raise RejoinError(f"the surviving ranks {survivors} announce different states (length, step): "
                          f"{sorted(told)}; their models diverged")
    length, step = told.pop()
    if length > MAX_STATE_BYTES:
        raise RejoinError(f"the announced state of {length} bytes exceeds {MAX_STATE_BYTES}")
    return survivors[0], length, step


def _transfer(stage: Reducer, state: bytes | None, length: int) -> bytes:
    """The source's ``state`` (None at every other rank) to every rank, as exact 16-bit pieces."""
    count = (length + 1) // 2
    payload = np.zeros(count, np.float32)
    if state is not None:
        raw = np.frombuffer(state, np.uint8)
        if raw.size % 2:
            raw = np.concatenate([raw, np.zeros(1, np.uint8)])
        payload[:] = raw.view("<u2")
    summed = np.rint(stage.reduce(payload, exact=True)) if count else np.zeros(0)
    if summed.size and (summed.max() > 0xFFFF or summed.min() < 0):
        raise RejoinError("a piece of the state exceeds 16 bits: more than one rank sent it")
    return summed.astype("<u2").view(np.uint8)[:length].tobytes()


def survive(stage: Exchanger, launcher_rank: int, launcher_world: int, job: JobRanks, state: bytes,
            step: int) -> int:
    """A survivor's side at the step boundary where it found joiners; returns the rank that sent the state."""
    stage.admit_joiners()
    summed, _ = stage.exchange(announcement(job.rank, job.world, len(state), step), control=1.0)
    source, _, _ = read_announcement(summed, job.world)
    again = agree(stage, launcher_rank, launcher_world)
    if again != job:
        raise RejoinError(f"the job's ranks came back otherwise than they were ({again} instead of {job}): a "
                          f"restarted DC must launch as many ranks as it had, the same way")
    _transfer(stage, state if job.rank == source else None, len(state))
    return source


def join(stage: Exchanger, launcher_rank: int, launcher_world: int, timeout: float) -> Joined:
    """A joiner's side: zeros into every node iteration until the survivors' announcement (within
    ``timeout`` seconds), then the agreement and the state."""
    stage.admit_joiners()
    deadline = time.monotonic() + timeout
    while True:
        summed, control = stage.exchange(np.zeros(0, np.float32))
        if control > 0:
            break
        if time.monotonic() > deadline:
            raise TrainerTimeout(f"no step boundary of the running job within {timeout:g} s: its ranks call "
                                 f"netstorm.torch.step_boundary between steps, which admits a restarted DC")
    try:
        job = agree(stage, launcher_rank, launcher_world)
    except LaunchError as exc:
        raise RejoinError(f"rejoining the running job: {exc}") from exc
    source, length, step = read_announcement(summed, job.world)
    return Joined(job, step, _transfer(stage, None, length), source)
