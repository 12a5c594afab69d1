"""A trainer that pushes model-shaped, integer-valued gradients and checks every sum exactly.

See docs/ARCHITECTURE.md, *Emulation and results*."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

import netstorm
from netstorm import config, models
from netstorm.auth import load_secret
from netstorm.compression.options import METHODS, CompressionOptions
from netstorm.compression.session import CompressedClient, RoundStats
from netstorm.errors import IterationError, NetStormError, NodeGone, PolicyError

Layers = list[tuple[str, tuple[int, ...]]]

# Pattern periods: distinct primes, so a chunk landing at another offset is caught unless the offsets
# differ by a multiple of both (about 4.3e9 elements, beyond any model here).
_PERIOD_A = 65521
_PERIOD_B = 65519
_A_MAX = 8
_B_MAX = 5
_BLOCK = 1 << 20
_MIN_EDGE_RCVBUF = 4 << 20  # elements per numpy pass: bounds temporaries, stays in cache-friendly sizes


def model_layers(spec: str) -> Layers:
    """Layer names and shapes: ``alexnet``, ``resnet50`` or a parameter count (``netstorm.models``)."""
    try:
        return list(models.layout(spec).tensors)
    except PolicyError as exc:
        raise ValueError(str(exc)) from None


def coefficients(iteration: int) -> tuple[int, int]:
    """(c1, c2) of iteration ``k``: they vary with k, so a result of another iteration is caught."""
    return 1 + iteration % 5, iteration % 3


def sum_bound(ids: Sequence[int]) -> int:
    """An upper bound of |any element| of the sum of the gradients of contributors ``ids``, any iteration
    (what a fixed-point edge sum of them must hold without overflow)."""
    c1_max, c2_max = 5, 2
    return sum(_A_MAX * c1_max + _B_MAX * (abs(i) + c2_max) for i in ids)


def _blocks(size: int) -> Iterator[slice]:
    for start in range(0, size, _BLOCK):
        yield slice(start, min(start + _BLOCK, size))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of checking one iteration's result."""

    exact: bool
    members_sum: float
    """S, the sum of the contributing DCs' ids, as read from the first element."""
    error: str = ""


class GradientPattern:
    """The integer patterns A and B over a model's flattened layers (int8: two bytes per parameter)."""

    def __init__(self, layers: Layers) -> None:
        if not layers:
            raise ValueError("a model needs at least one layer")
        self.layers = list(layers)
        self.sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape in self.layers]
        if any(size <= 0 for size in self.sizes):
            raise ValueError(f"layers must be non-empty: {self.layers}")
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        total = int(self.offsets[-1])
        rng = np.random.default_rng(20240229)
        self.a = np.resize(rng.integers(-_A_MAX, _A_MAX + 1, _PERIOD_A, dtype=np.int8), total)
        self.b = np.resize(rng.integers(-_B_MAX, _B_MAX + 1, _PERIOD_B, dtype=np.int8), total)
        self.a[0] = 0
        self.b[0] = 1

    @property
    def parameters(self) -> int:
        return int(self.offsets[-1])

    def allocate(self) -> dict[str, np.ndarray]:
        """One float32 array per layer, views into a single flat buffer."""
        flat = np.zeros(self.parameters, dtype=np.float32)
        return {
            name: flat[self.offsets[i]:self.offsets[i + 1]].reshape(shape)
            for i, (name, shape) in enumerate(self.layers)
        }

    def fill(self, dc: int, iteration: int, out: dict[str, np.ndarray]) -> None:
        """Write DC ``dc``'s gradient of ``iteration`` into ``out`` (arrays from ``allocate``)."""
        c1, c2 = coefficients(iteration)
        self._combine(np.float32(c1), np.float32(dc + c2), out)

    def expected(self, iteration: int, workers: int, members_sum: int) -> dict[str, np.ndarray]:
        """The exact sum over ``workers`` DCs whose ids add up to ``members_sum`` (for tests and tools)."""
        c1, c2 = coefficients(iteration)
        out = self.allocate()
        self._combine(np.float32(c1 * workers), np.float32(members_sum + workers * c2), out)
        return out

    def expected_layers(self, iteration: int, workers: int, members_sum: int) -> Iterator[tuple[str, np.ndarray]]:
        """``expected``'s layers one at a time, each a fresh array: a check needs no model-sized sum."""
        c1, c2 = coefficients(iteration)
        ka, kb = np.float32(c1 * workers), np.float32(members_sum + workers * c2)
        for i, (name, shape) in enumerate(self.layers):
            layer = np.empty(shape, dtype=np.float32)
            self._combine_layer(i, ka, kb, layer.reshape(-1))
            yield name, layer

    def integer_layer(self, i: int, ka: float, kb: float) -> np.ndarray:
        """Layer ``i`` of A ka + B kb in float64, for integer ka and kb: exact, as is any sum of
        ``expected`` results in float64 (small integers), so such a sum need not be kept."""
        window = slice(int(self.offsets[i]), int(self.offsets[i + 1]))
        out = self.a[window].astype(np.float64)
        out *= ka
        out += self.b[window].astype(np.float64) * kb
        return out.reshape(self.layers[i][1])

    def _combine(self, ka: np.float32, kb: np.float32, out: dict[str, np.ndarray]) -> None:
        for i, (name, _) in enumerate(self.layers):
            self._combine_layer(i, ka, kb, out[name].reshape(-1))

    def _combine_layer(self, i: int, ka: np.float32, kb: np.float32, target: np.ndarray) -> None:
        base = int(self.offsets[i])
        scratch = np.empty(min(_BLOCK, target.size), dtype=np.float32)
        for part in _blocks(target.size):
            window = slice(base + part.start, base + part.stop)
            np.multiply(self.a[window], ka, out=target[part])
            np.multiply(self.b[window], kb, out=scratch[: part.stop - part.start])
            target[part] += scratch[: part.stop - part.start]

    def check(self, iteration: int, workers: int, result: dict[str, np.ndarray],
              members_sum: float | None = None) -> Verdict:
        """Whether ``result`` is exactly the sum of ``workers`` DCs' gradients of ``iteration``.

        ``members_sum`` is S as seen before (None on the first check: S is then read from the result).
        """
        missing = [name for name, _ in self.layers if name not in result]
        if missing:
            return Verdict(False, float("nan"), f"result lacks layers {missing[:3]}")
        for (name, shape) in self.layers:
            got = result[name]
            if tuple(got.shape) != shape or got.dtype != np.float32:
                return Verdict(False, float("nan"),
                               f"{name}: got {got.dtype}{tuple(got.shape)}, expected float32{shape}")
        c1, c2 = coefficients(iteration)
        first = float(result[self.layers[0][0]].reshape(-1)[0])
        seen = first - workers * c2
        if members_sum is not None and seen != members_sum:
            return Verdict(False, seen, f"sum of DC ids changed from {members_sum:g} to {seen:g}")
        if not seen.is_integer() or seen < 0:
            return Verdict(False, seen, f"sum of DC ids read as {seen!r}, not a non-negative integer")
        ka = np.float32(c1 * workers)
        kb = np.float32(seen + workers * c2)
        for i, (name, _) in enumerate(self.layers):
            got = result[name].reshape(-1)
            base = int(self.offsets[i])
            want = np.empty(min(_BLOCK, got.size), dtype=np.float32)
            scratch = np.empty_like(want)
            for part in _blocks(got.size):
                n = part.stop - part.start
                window = slice(base + part.start, base + part.stop)
                np.multiply(self.a[window], ka, out=want[:n])
                np.multiply(self.b[window], kb, out=scratch[:n])
                want[:n] += scratch[:n]
                bad = np.flatnonzero(got[part] != want[:n])
                if bad.size:
                    j = int(bad[0])
                    return Verdict(False, seen, f"{name}[{part.start + j}] = {float(got[part][j])!r}, "
                                                f"expected {float(want[j])!r} ({bad.size} wrong in this block)")
        return Verdict(True, seen)


STEP_TENSOR = "netstorm.step"
"""The step tensor of ``--rejoinable`` trainers."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="the node's trainer endpoint: a unix socket path or tcp://host:port")
    where.add_argument("--edge", metavar="ADDRESS",
                       help="edge mode, a LAN worker of a DC gateway: edge://GATEWAY:PORT?worker=I "
                            "(needs --dc)")
    parser.add_argument("--model", default="alexnet",
                        help="alexnet, resnet50 or a parameter count (25000000, 25M); default alexnet")
    parser.add_argument("--iterations", type=int, default=10, help="iterations to run (default 10)")
    parser.add_argument("--compute-s", type=float, default=0.0,
                        help="seconds of stand-in compute per iteration before the push (default 0)")
    parser.add_argument("--overlap", action="store_true",
                        help="overlap synchronization with the backward pass: push each layer as soon as its share "
                             "of the compute time (a forward third, then a backward two thirds by layer size, last "
                             "layer first) has passed, then pull every layer")
    parser.add_argument("--dc", type=int, default=None,
                        help="this DC's id in the gradients (default: the node's id)")
    parser.add_argument("--contributors", type=int, default=None,
                        help="contributors to every sum, LAN workers included (default: the count the node or "
                             "gateway reports with each result)")
    parser.add_argument("--contributor-sum", type=int, default=None,
                        help="the sum of every contributor's --dc id (default: read from the first result)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the node")
    parser.add_argument("--secret-file", default=None, metavar="FILE",
                        help="the job secret: a LAN worker's datagrams carry tokens keyed by it, and a trainer "
                             "on a node's TCP endpoint proves it (default: none)")
    parser.add_argument("--max-failures", type=int, default=10,
                        help="consecutive failed iterations after which the trainer stops (default 10)")
    parser.add_argument("--retry-s", type=float, default=1.0,
                        help="seconds to wait after a failed iteration before the next one (default 1)")
    parser.add_argument("--rejoinable", action="store_true",
                        help="carry the step in the model, so a restarted DC continues at the live DCs' step")
    parser.add_argument("--out", default=None, help="JSON lines file, appended to (default stdout)")
    parser.add_argument("--compression", default=None, choices=METHODS,
                        help="gradient compression (default: NETSTORM_COMPRESSION, else none)")
    parser.add_argument("--fediac-k", type=float, default=None, help="votes per contributor (share or count)")
    parser.add_argument("--fediac-bits", type=int, default=None, help="bits b of a value (0: derived)")
    parser.add_argument("--fediac-votes", type=int, default=None, help="threshold a (0: derived)")
    parser.add_argument("--fediac-gia-reuse", type=int, default=None,
                        help="iterations one FediAC GIA serves (ours; 1: vote every iteration)")


def _connect_edge(address: str, parameters: int, *, timeout: float, secret: bytes | None = None) -> Any:
    """An edge-mode client whose socket can queue a whole model of results: the gateway sends them in one
    burst, and a default-sized buffer (about 200 KB) would drop most of them and leave the worker pulling
    the rest back in rounds. The kernel caps the request at net.core.rmem_max."""
    from netstorm.lan.client import connect_edge

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, max(_MIN_EDGE_RCVBUF, 2 * 4 * parameters))
        return connect_edge(address, timeout=timeout, sock=sock, secret=secret)
    except BaseException:
        sock.close()
        raise


def _connect_compressed_edge(address: str, options: CompressionOptions, parameters: int, *, contributor: int,
                             timeout: float, secret: bytes | None) -> Any:
    """A LAN worker of a compressed job, its socket sized like ``_connect_edge``'s."""
    from netstorm.lan.compressed import connect_compressed_edge

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, max(_MIN_EDGE_RCVBUF, 2 * 4 * parameters))
        return connect_compressed_edge(address, options, contributor=contributor, timeout=timeout, sock=sock,
                                       secret=secret)
    except BaseException:
        sock.close()
        raise


def _emit(stream: IO[str], record: dict[str, Any]) -> None:
    stream.write(json.dumps(record) + "\n")
    stream.flush()


@dataclasses.dataclass
class _Clock:
    """One iteration's start, and the time its trainer spent blocked on the node (``sync_s``)."""

    start: float
    blocked: float = 0.0
    _since: float | None = None

    def block(self) -> None:
        self._since = time.perf_counter()

    def unblock(self) -> None:
        if self._since is not None:
            self.blocked += time.perf_counter() - self._since
            self._since = None


def _sleep_until(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.perf_counter()))


def _serial_iteration(kv: Any, pattern: GradientPattern, grads: dict[str, np.ndarray], dc: int, k: int,
                      compute_s: float, clock: _Clock) -> dict[str, np.ndarray]:
    """Compute, then one push_pull of every layer."""
    pattern.fill(dc, k, {name: grads[name] for name, _ in pattern.layers})
    _sleep_until(clock.start + compute_s)
    clock.block()
    result: dict[str, np.ndarray] = kv.push_pull(grads, average=False)
    clock.unblock()
    return result


def _overlapped_iteration(kv: Any, pattern: GradientPattern, grads: dict[str, np.ndarray], dc: int, k: int,
                          compute_s: float, clock: _Clock) -> dict[str, np.ndarray]:
    """A forward third of the compute time, then a backward two thirds that yields the layers last first,
    each after its share by size and pushed at once (as DDP launches a bucket's all-reduce the moment
    backward fills it); then one pull per layer. Only the pushes and the pulls count as blocked."""
    pattern.fill(dc, k, {name: grads[name] for name, _ in pattern.layers})
    if STEP_TENSOR in grads:
        kv.push(STEP_TENSOR, grads[STEP_TENSOR])
    for i, due in models.backward_yields(pattern.sizes, compute_s):
        _sleep_until(clock.start + due)
        name = pattern.layers[i][0]
        clock.block()
        kv.push(name, grads[name])
        clock.unblock()
    clock.block()
    result = {name: kv.pull(name, average=False) for name in grads}
    clock.unblock()
    return result


def compression_options(args: argparse.Namespace) -> CompressionOptions:
    """The flags over NETSTORM_<NAME> over the Config defaults, as every other option resolves."""
    overrides = {"compression": args.compression, "fediac_k": args.fediac_k, "fediac_bits": args.fediac_bits,
                 "fediac_votes": args.fediac_votes, "fediac_gia_reuse": args.fediac_gia_reuse}
    return CompressionOptions.of(config.resolve(environ=os.environ, overrides=overrides))


@dataclasses.dataclass
class _Cumulative:
    """Running sums of the decoded and the exact results: with error feedback, what has not arrived yet
    is what the DCs' residuals hold, so the cumulative error shrinks where one iteration's need not.
    The exact sum is A (sum of ka) + B (sum of kb), exact in float64: only its coefficients are kept."""

    decoded: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    ka: int = 0
    kb: int = 0

    def add(self, pattern: GradientPattern, decoded: dict[str, np.ndarray], iteration: int, workers: int,
            members_sum: int) -> float:
        c1, c2 = coefficients(iteration)
        self.ka += c1 * workers
        self.kb += members_sum + workers * c2
        error = norm = 0.0
        for i, (name, _) in enumerate(pattern.layers):
            self.decoded[name] = self.decoded.get(name, 0.0) + decoded[name].astype(np.float64)
            exact = pattern.integer_layer(i, self.ka, self.kb)
            error += float(np.sum((self.decoded[name] - exact) ** 2))
            norm += float(np.sum(exact ** 2))
        return math.sqrt(error / norm) if norm else 0.0


def _compressed_record(kv: Any, pattern: GradientPattern, k: int, workers: int, members_sum: float | None,
                       result: dict[str, np.ndarray], cumulative: _Cumulative) -> dict[str, Any]:
    """What a compressed iteration reports instead of an exact verdict (a layer at a time)."""
    stats: RoundStats = kv.last
    record: dict[str, Any] = {"exact": None, "round_trips": stats.round_trips, "gia": stats.gia,
                              "bits": stats.bits, "dense": stats.dense, "wan_bytes": stats.wan_bytes,
                              "round_s": list(stats.round_s)}
    if members_sum is not None:
        error = norm = 0.0
        for name, want in pattern.expected_layers(k, workers, int(members_sum)):
            error += float(np.sum((result[name].astype(np.float64) - want) ** 2))
            norm += float(np.sum(want.astype(np.float64) ** 2))
        record["rel_error"] = math.sqrt(error / norm) if norm else 0.0
        record["cum_rel_error"] = cumulative.add(pattern, result, k, workers, int(members_sum))
    return record


def run(args: argparse.Namespace, stream: IO[str]) -> int:
    """Connect, register the layers, run the iterations; 0 when every result was exact."""
    if args.dc is not None and args.dc < 0:
        print(f"synthetic trainer: --dc must be >= 0, got {args.dc}", file=sys.stderr)
        return 2
    if args.iterations < 0 or args.compute_s < 0 or args.retry_s < 0 or args.max_failures < 1:
        print("synthetic trainer: --iterations, --compute-s and --retry-s must be >= 0, --max-failures >= 1",
              file=sys.stderr)
        return 2
    if args.edge is not None and args.dc is None:
        print("synthetic trainer: --edge needs --dc (this worker's id)", file=sys.stderr)
        return 2
    if args.contributors is not None and args.contributors < 1:
        print(f"synthetic trainer: --contributors must be >= 1, got {args.contributors}", file=sys.stderr)
        return 2
    try:
        pattern = GradientPattern(model_layers(args.model))
    except ValueError as exc:
        print(f"synthetic trainer: {exc}", file=sys.stderr)
        return 2
    try:
        options = compression_options(args)
    except NetStormError as exc:
        print(f"synthetic trainer: {exc}", file=sys.stderr)
        return 2
    if options.method != "none" and ((args.edge is not None and not options.sparse) or args.rejoinable or
                                     (args.overlap and options.sparse)):
        print("synthetic trainer: --compression runs without --rejoinable, fediac/topk without --overlap (their "
              "rounds need the whole gradient), and on a LAN worker (--edge) only fediac/topk", file=sys.stderr)
        return 2
    grads = pattern.allocate()
    cumulative = _Cumulative()
    step = [0]
    """The next step (what a rejoining DC's init hands over)."""
    if args.rejoinable:
        grads[STEP_TENSOR] = np.zeros(1, dtype=np.float32)
    all_exact = True
    dc = args.dc
    try:
        # the job secret, when this command was given one: the LAN datagrams' tokens, or the proof a
        # node's TCP endpoint asks for (a Unix socket is guarded by its file permissions instead)
        secret = load_secret(args.secret_file) if args.secret_file else None
        kv: Any
        if args.edge is not None and options.sparse:
            # a LAN worker of a compressed job: the rounds on their own wires, seeded with its contributor id
            kv = _connect_compressed_edge(args.edge, options, pattern.parameters, contributor=dc,
                                          timeout=args.timeout, secret=secret)
        elif args.edge is not None:
            kv = _connect_edge(args.edge, pattern.parameters, timeout=args.timeout, secret=secret)
        else:
            kv = netstorm.connect(args.socket, timeout=args.timeout, secret_file=args.secret_file)
        raw = kv
        if options.sparse and args.edge is None:
            kv = CompressedClient(raw, options)
        try:
            initial = (kv.init(grads, compression=options.method) if options.spec.float16
                       else kv.init(grads))
            if args.rejoinable:
                step[0] = int(initial[STEP_TENSOR][0])
                kv.set_model_provider(lambda: {**grads, STEP_TENSOR: np.array([step[0]], dtype=np.float32)})
            del initial   # a model-sized copy that no iteration reads
            fixed = args.contributors is not None
            workers = args.contributors if fixed else kv.num_workers
            dc = kv.node_id if dc is None else dc
            members_sum: float | None = None if args.contributor_sum is None else float(args.contributor_sum)
            failures = 0
            result: dict[str, np.ndarray] = {}
            for k in range(step[0], args.iterations):
                step[0] = k
                result = {}   # the last result, not held through this iteration's rounds
                clock = _Clock(time.perf_counter())
                began = time.time()  # wall clock: the runner places the iteration in the rate log
                try:
                    if args.overlap:
                        result = _overlapped_iteration(kv, pattern, grads, dc, k, args.compute_s, clock)
                    else:
                        result = _serial_iteration(kv, pattern, grads, dc, k, args.compute_s, clock)
                except (IterationError, NodeGone) as exc:
                    # A DC died: this iteration is lost everywhere; the survivors carry on without it once
                    # the scheduler has re-planned. If failures persist (this DC's own node is gone), stop.
                    all_exact = False
                    failures += 1
                    clock.unblock()
                    end = time.perf_counter()
                    _emit(stream, {"iteration": k, "seconds": end - clock.start, "sync_s": clock.blocked,
                                   "exact": False, "failed": True, "dc": dc, "t": time.time(), "began": began,
                                   "error": f"{type(exc).__name__}: {exc}"})
                    if failures >= args.max_failures:
                        print(f"synthetic trainer (DC {dc}): giving up after {failures} failed iterations: {exc}",
                              file=sys.stderr)
                        return 1
                    time.sleep(args.retry_s)
                    continue
                failures = 0
                end = time.perf_counter()
                if options.sparse:
                    _emit(stream, {"iteration": k, "seconds": end - clock.start, "sync_s": clock.blocked, "dc": dc,
                                   "workers": workers, "cpu_s": time.process_time(), "compression": options.method,
                                   **_compressed_record(kv, pattern, k, workers, members_sum, result,
                                                        cumulative)})
                    continue
                if not fixed and kv.num_workers != workers:  # membership changed: S is read afresh
                    workers, members_sum = kv.num_workers, None
                verdict = pattern.check(k, workers, result, members_sum)
                if fixed and kv.num_workers != workers:  # the count average=True would divide by is wrong
                    miscount = f"the sum holds {workers} workers' gradients, the node or gateway says {kv.num_workers}"
                    verdict = dataclasses.replace(verdict, exact=False,
                                                  error="; ".join(e for e in (verdict.error, miscount) if e))
                members_sum = verdict.members_sum if verdict.exact else members_sum
                all_exact &= verdict.exact
                record: dict[str, Any] = {"iteration": k, "seconds": end - clock.start, "sync_s": clock.blocked,
                                          "check_s": time.perf_counter() - end, "exact": verdict.exact, "dc": dc,
                                          "workers": workers, "cpu_s": time.process_time(), "began": began,
                                          "wan_bytes": getattr(raw, "wan_bytes", 0), "compute_s": args.compute_s}
                if options.method != "none":
                    record.update(compression=options.method, round_trips=1)
                if args.rejoinable:
                    record.update(t=time.time(), node_iteration=kv.iteration, id_sum=verdict.members_sum)
                if verdict.error:
                    record["error"] = verdict.error
                _emit(stream, record)
        finally:
            raw.close()
    except NetStormError as exc:
        _emit(stream, {"dc": dc, "exact": False, "error": f"{type(exc).__name__}: {exc}"})
        print(f"synthetic trainer (DC {dc}): {exc}", file=sys.stderr)
        return 1
    return 0 if all_exact else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netstorm.trainers.synthetic", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.out is None:
        return run(args, sys.stdout)
    with Path(args.out).open("a") as stream:
        return run(args, stream)


if __name__ == "__main__":
    sys.exit(main())
