"""The global state every DC must hold bit for bit: its digest, and its transfer to a DC that rejoins.

The digest (BLAKE2b, 16 bytes) covers the global parameters, the outer optimizer's state and the
count of outer steps. It rides with every sync as bytes d and their squares d*d (integers the nodes
sum exactly): for n contributors, sum(d) = n m and sum(d*d) = n m*m for every byte hold only when
every contributor's byte is m, so equal sums prove equal digests, not merely a likely match.

A snapshot is the state as float32 values (a header of small integers, the parameters, the optimizer's
state), which a node sums with the other DCs' zeros exactly (x + 0 = x; the state never holds -0.0,
see ``canonical``). In a float16 job, whose nodes would round float chunks, it travels instead as the
values' 32-bit words cut in 16-bit halves in an int32 tensor, twice the elements.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from netstorm.errors import DigestMismatch, TrainerProtocolError

DIGEST_BYTES = 16
META_WORDS = 2 + 2 * DIGEST_BYTES
"""The meta tensor: [weight, digests counted, d_0..d_15, d_0^2..d_15^2]."""
HEADER_WORDS = 6
VERSION = 1


def digest(params: np.ndarray, outer_state: list[np.ndarray], outer_steps: int) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(np.ascontiguousarray(params, "<f4").tobytes())
    for array in outer_state:
        h.update(np.ascontiguousarray(array, "<f4").tobytes())
    h.update(int(outer_steps).to_bytes(8, "little"))
    return h.digest()


def meta(weight: int, mine: bytes) -> np.ndarray:
    d = np.frombuffer(mine, np.uint8).astype(np.int32)
    return np.concatenate([np.array([weight, 1], np.int32), d, d * d])


def check_meta(total: np.ndarray, mine: bytes, sync: int, contributors: tuple[int, ...]) -> tuple[int, int]:
    """(weight, n) from the summed meta; DigestMismatch unless every contributor's digest is ``mine``."""
    total = np.asarray(total, np.int64)
    weight, count = int(total[0]), int(total[1])
    d = np.frombuffer(mine, np.uint8).astype(np.int64)
    sums, squares = total[2:2 + DIGEST_BYTES], total[2 + DIGEST_BYTES:]
    if count < 1 or np.any(sums != count * d) or np.any(squares != count * d * d):
        raise DigestMismatch(f"sync {sync}: the global state differs between DCs {list(contributors)} "
                             f"({count} digests summed; this DC's is {mine.hex()})")
    return weight, count


@dataclasses.dataclass
class Snapshot:
    """The global state and this DC's place in the schedule, as a joiner takes it over."""

    params: np.ndarray
    outer_state: list[np.ndarray]
    step: int = 0
    """Inner steps done."""
    next_sync: int = 0
    """The sync index sent next (or the one in progress, when ``in_sync``)."""
    outer_steps: int = 0
    in_sync: bool = False
    """Handed over while sync ``next_sync`` runs: the joiner takes part in it from round ``round``."""
    round: int = 0

    def words(self) -> int:
        return HEADER_WORDS + self.params.size + sum(a.size for a in self.outer_state)

    def encode(self, halves: bool = False) -> np.ndarray:
        if not halves:
            header_f = np.array([VERSION, self.step, self.next_sync, self.outer_steps, int(self.in_sync), self.round],
                                np.float32)
            return np.concatenate([header_f, *(np.asarray(a, np.float32).reshape(-1)
                                               for a in (self.params, *self.outer_state))])
        header = np.array([VERSION, self.step, self.next_sync, self.outer_steps, int(self.in_sync), self.round],
                          np.uint32)
        floats = [np.ascontiguousarray(a, "<f4").reshape(-1).view("<u4") for a in (self.params, *self.outer_state)]
        words = np.concatenate([header, *floats])
        cut = np.empty(2 * words.size, np.int32)
        cut[0::2] = words & 0xFFFF
        cut[1::2] = words >> 16
        return cut

    @classmethod
    def decode(cls, values: np.ndarray, params_size: int, state_sizes: list[int]) -> Snapshot:
        if np.asarray(values).dtype.kind == "f":  # float32 values
            array = np.asarray(values, np.float32)
            if array.size != HEADER_WORDS + params_size + sum(state_sizes) or array[0] != VERSION:
                raise TrainerProtocolError(f"DiLoCo snapshot of {array.size} values, version {array[:1]}; expected "
                                           f"{HEADER_WORDS + params_size + sum(state_sizes)}, version {VERSION}")
            return cls._of(array[:HEADER_WORDS].astype(np.int64), array[HEADER_WORDS:], params_size, state_sizes)
        halves = np.asarray(values, np.int64)
        if np.any((halves < 0) | (halves > 0xFFFF)) or halves.size % 2:
            raise TrainerProtocolError("a DiLoCo snapshot holds values beyond 16-bit halves: not one DC's state")
        words = (halves[0::2] | (halves[1::2] << 16)).astype("<u4")
        if int(words[0]) != VERSION or words.size != HEADER_WORDS + params_size + sum(state_sizes):
            raise TrainerProtocolError(f"DiLoCo snapshot version {int(words[0])} of {words.size} words; expected "
                                       f"version {VERSION}, {HEADER_WORDS + params_size + sum(state_sizes)}")
        return cls._of(words[:HEADER_WORDS].astype(np.int64), words[HEADER_WORDS:].view("<f4"), params_size,
                       state_sizes)

    @classmethod
    def _of(cls, header: np.ndarray, floats: np.ndarray, params_size: int, state_sizes: list[int]) -> Snapshot:
        step, next_sync, outer_steps, in_sync, round_ = (int(w) for w in header[1:HEADER_WORDS])
        params = floats[:params_size].copy()
        states, at = [], params_size
        for size in state_sizes:
            states.append(floats[at:at + size].copy())
            at += size
        return cls(params, states, step, next_sync, outer_steps, bool(in_sync), round_)


def canonical(values: np.ndarray) -> None:
    """-0.0 becomes +0.0 in place (every other value is unchanged): a snapshot summed with zeros by the
    nodes must come back bit for bit."""
    np.add(values, np.float32(0.0), out=values)
