"""``netstorm bench codec``: encode + decode time of every wire's typical messages.

What a node pays per message on each wire: a data-plane chunk header and Hello (prefix and header,
the raw payload excluded), the control messages of a running job (a policy reply carrying a 9-node
policy is decoded and turned into a ``Policy``, as a node does), and the trainer wire's requests and
replies. The module uses only the codecs' public calls, so the same file times any checkout of the
project: ``--baseline TREE`` runs it first against another checkout (a process with ``PYTHONPATH=TREE``)
and then against this one, one right after the other (``results/README.md`` has the command).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HELP = "time encode + decode of data-plane headers, control messages and trainer-wire messages"

Case = tuple[str, str, Callable[[], bytes], Callable[[bytes], object]]
"""(wire, message, encode, decode): ``decode`` takes what ``encode`` returned."""


def _policy_wire() -> dict[str, Any]:
    """The wire form of a 9-node FAPT policy with auxiliary paths, planned on internet2-9's rates."""
    from netstorm import scenario
    # Where the planner lives depends on the checkout measured.
    planning = importlib.import_module("netstorm.policy")
    if not hasattr(planning, "plan"):
        planning = importlib.import_module("netstorm.planning.plan")
    rates = scenario.load("internet2-9").rates()
    return dict(planning.plan(rates, version=3).to_wire())


def _frame_cases() -> list[Case]:
    from netstorm import frames

    limit = 1 << 30

    def decoder(data: bytes) -> object:
        prefix = frames.decode_prefix(data, max_frame_bytes=limit)
        return frames.decode_header(prefix, memoryview(data)[frames.PREFIX_SIZE:])

    primary = frames.ChunkHeader(iteration=1234, chunk=57, root=3, phase=frames.Phase.UP, src=5, dst=3, origin=5,
                                 final=3, version=12, t_send=1_700_000_000.125, is_aux=False, path=(5, 3),
                                 count=65536)
    aux = frames.ChunkHeader(iteration=1234, chunk=57, root=3, phase=frames.Phase.DOWN, src=5, dst=7, origin=5,
                             final=3, version=12, t_send=1_700_000_000.125, is_aux=True, path=(5, 7, 3),
                             count=65536)
    hello = frames.Hello(node_id=4, layout_hash="9f86d081884c7d65")
    return [("frames", "ChunkHeader", primary.encode, decoder),
            ("frames", "ChunkHeader (aux)", aux.encode, decoder),
            ("frames", "Hello", hello.encode, decoder)]


def _control_cases(policy: dict[str, Any]) -> list[Case]:
    from netstorm import control
    from netstorm.policy import Policy

    def body(message: Any) -> Callable[[], bytes]:
        return lambda: control.encode(message)[control.LENGTH.size:]

    def with_policy(data: bytes) -> object:
        reply = control.decode(data)
        return Policy.from_wire(reply.policy)  # type: ignore[attr-defined]

    members = {n: (f"10.0.0.{n}", 40000 + n) for n in range(1, 10)}
    config: dict[str, bool | int | float | str | None] = {
        "chunk_size": 65536, "iteration_timeout": 60.0, "heartbeat_interval": 1.0, "topology": "fapt",
        "enable_awareness": True, "probe_chunk_num": 4}
    return [
        ("control", "Heartbeat", body(control.Heartbeat(node_id=4, t=1_700_000_000.5)), control.decode),
        ("control", "LinkReport", body(control.LinkReport(src=4, dst=7, mbit_s=123.25, t=1_700_000_000.5,
                                                          samples=4)), control.decode),
        ("control", "PolicyRequest", body(control.PolicyRequest(node_id=4, iteration=1234, known_version=11)),
         control.decode),
        ("control", "PolicyReply (none)", body(control.PolicyReply(iteration=1234, version=12, policy=None)),
         control.decode),
        ("control", "PolicyReply (9 nodes)", body(control.PolicyReply(iteration=1234, version=12, policy=policy)),
         with_policy),
        ("control", "RegisterAck (9 nodes)", body(control.RegisterAck(members=members, config=config,
                                                                      scheduler_time=1_700_000_000.5)),
         control.decode),
    ]


def _trainer_cases() -> list[Case]:
    from netstorm import trainer_wire as tw

    names = tuple(f"layer{i}.weight" for i in range(16))

    def framed(message: Any) -> Callable[[], bytes]:
        return lambda: tw.encode(message, 0)[tw.PREFIX.size:]

    # One request pushes and pulls: a flag of PullRequest, or a message of its own in older checkouts.
    push_pull: Any = (tw.PullRequest(names, True, push=True)  # type: ignore[call-arg,unused-ignore]
                      if "push" in getattr(tw.PullRequest, "__struct_fields__", ()) else
                      getattr(tw, "PushPullRequest")(names, True))  # noqa: B009
    return [
        ("trainer", "PushRequest (16 names)", framed(tw.PushRequest(names)), tw.decode),
        ("trainer", "PullRequest (16 names)", framed(tw.PullRequest(names, True)), tw.decode),
        ("trainer", "push-pull request (16 names)", framed(push_pull), tw.decode),
        ("trainer", "PullReply (16 names)", framed(tw.PullReply(1234, names, 9)), tw.decode),
        ("trainer", "PushReply", framed(tw.PushReply(1234)), tw.decode),
    ]


def _best_ns(fn: Callable[[], object], number: int, repeats: int) -> float:
    """Least time per call over ``repeats`` runs of ``number`` calls (timeit's convention)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / number)
    return best


def measure(number: int = 2000, repeats: int = 7) -> list[dict[str, Any]]:
    """One row per message: bytes, encode, decode and encode + decode in microseconds."""
    rows = []
    cases = [*_frame_cases(), *_control_cases(_policy_wire()), *_trainer_cases()]
    for wire, name, encode, decode in cases:
        data = encode()
        decode(data)  # fail before timing if the pair does not round-trip
        scale = max(1, number // max(1, len(data) // 256))  # fewer calls for large messages
        enc = _best_ns(encode, scale, repeats)
        dec = _best_ns(lambda d=data, f=decode: f(d), scale, repeats)  # type: ignore[misc]
        rows.append({"wire": wire, "message": name, "bytes": len(data), "encode_us": enc / 1e3,
                     "decode_us": dec / 1e3, "total_us": (enc + dec) / 1e3})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--number", type=int, default=2000, help="calls per timed run (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; the best counts (default %(default)s)")
    parser.add_argument("--baseline", metavar="TREE",
                        help="first time the checkout at TREE (this file run with PYTHONPATH=TREE), then this one")
    parser.add_argument("--out", dest="json_out", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--json", dest="json_out", help=argparse.SUPPRESS)  # the former name of --out


def _baseline(tree: str, number: int, repeats: int) -> list[dict[str, Any]]:
    """The rows of this same file run against the checkout at ``tree``, in a process of its own."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rows.json"
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--number", str(number), "--repeats",
                        str(repeats), "--out", str(out)], env=env, check=True, stdout=subprocess.DEVNULL)
        rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    return rows


def run(args: argparse.Namespace) -> int:
    before = _baseline(args.baseline, args.number, args.repeats) if args.baseline else None
    rows = measure(args.number, args.repeats)
    report: dict[str, Any] = {"python": sys.version.split()[0], "machine": platform.machine(),
                              "number": args.number, "repeats": args.repeats, "rows": rows}
    if before is None:
        print(f"{'wire':8} {'message':30} {'bytes':>6} {'encode us':>10} {'decode us':>10} {'total us':>10}")
        for row in rows:
            print(f"{row['wire']:8} {row['message']:30} {row['bytes']:6d} {row['encode_us']:10.2f} "
                  f"{row['decode_us']:10.2f} {row['total_us']:10.2f}")
    else:
        old = {(row["wire"], row["message"]): row for row in before}
        report["baseline"] = {"tree": args.baseline, "rows": before}
        print(f"{'wire':8} {'message':30} {'bytes':>11} {'encode us':>13} {'decode us':>13} {'total us':>15} "
              f"{'x':>5}")
        for row in rows:
            was = old.get((row["wire"], row["message"]))
            if was is None:
                continue
            print(f"{row['wire']:8} {row['message']:30} {was['bytes']:5d}/{row['bytes']:<5d} "
                  f"{was['encode_us']:6.2f}/{row['encode_us']:<6.2f} {was['decode_us']:6.2f}/{row['decode_us']:<6.2f} "
                  f"{was['total_us']:7.2f}/{row['total_us']:<7.2f} {was['total_us'] / row['total_us']:5.2f}")
        print("(before/after; x = before total / after total)")
    if args.json_out:
        from netstorm.provenance import write_result

        write_result(args.json_out, report)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=HELP)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
