"""The systems ``netstorm emulate --trainer diloco --system`` runs, and each one's trainer command line.

Every system trains the same ``--train`` task from the same seeds on the same network. DiLoCo runs with
P=1, τ=0 and no compression; Streaming DiLoCo with the run's ``--fragments``, ``--fragment-delay`` and
``--outer-compression``; the DDP systems all-reduce every step's gradient (the references). A netstorm
runtime is the scheduler plus one node per DC; torchft's is its Lighthouse in the first DC's namespace;
gloo's a TCP store there.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

from netstorm.emulation.errors import EmulationError
from netstorm.trainers.launch import diloco_args, torch_ddp_args

LIGHTHOUSE_PORT = 29510
TORCHFT_MODULE = "netstorm.trainers.torchft_diloco"


@dataclasses.dataclass(frozen=True)
class DilocoSystem:
    name: str
    runtime: str
    """``netstorm`` (scheduler and nodes), ``torchft`` (a Lighthouse) or ``gloo`` (a TCP store)."""
    trainer: str
    """``diloco`` (an outer step every H inner steps) or ``ddp`` (an all-reduce every step)."""
    streaming: bool = False
    """Runs the given P, τ and outer compression (else P=1, τ=0, none)."""

    @property
    def module(self) -> str:
        if self.trainer == "ddp":
            return "netstorm.trainers.torch_ddp"
        return TORCHFT_MODULE if self.runtime == "torchft" else "netstorm.trainers.diloco_run"

    def schedule(self, fragments: int, fragment_delay: int, outer_compression: str) -> dict[str, Any]:
        """The outer schedule this system runs, given the run's: its result entry records it."""
        if self.trainer == "ddp":
            return {"fragments": None, "fragment_delay": None, "outer_compression": None}
        if not self.streaming:
            return {"fragments": 1, "fragment_delay": 0, "outer_compression": "none"}
        return {"fragments": fragments, "fragment_delay": fragment_delay, "outer_compression": outer_compression}

    def check(self) -> None:
        """EmulationError when this system's trainer module is not installed (a missing optional part)."""
        if importlib.util.find_spec(self.module) is None:
            raise EmulationError(f"{self.name}: its trainer module {self.module} is not part of this installation")


SYSTEMS: dict[str, DilocoSystem] = {s.name: s for s in (
    DilocoSystem("netstorm-diloco", "netstorm", "diloco"),
    DilocoSystem("torchft-diloco", "torchft", "diloco"),
    DilocoSystem("netstorm-streaming", "netstorm", "diloco", streaming=True),
    DilocoSystem("torchft-streaming", "torchft", "diloco", streaming=True),
    DilocoSystem("netstorm-ddp", "netstorm", "ddp"),
    DilocoSystem("gloo-ddp", "gloo", "ddp"),
)}
DEFAULT = "netstorm-streaming,netstorm-ddp"
REJOINABLE = ("netstorm-diloco", "netstorm-streaming")
"""Systems ``--chaos`` runs with: their DCs rejoin a running job (DDP cannot; torchft's is its own)."""


def check_chaos(chosen: list[DilocoSystem], chaos: list[Any]) -> None:
    """``--chaos`` runs only with systems whose DCs rejoin (``REJOINABLE``)."""
    other = [s.name for s in chosen if s.name not in REJOINABLE]
    if chaos and other:
        raise EmulationError(f"--chaos runs with {', '.join(REJOINABLE)}; {', '.join(other)} cannot rejoin "
                             f"a running job here")


def parse(text: str) -> list[DilocoSystem]:
    names = [n.strip().lower() for n in text.replace("all", ",".join(SYSTEMS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise EmulationError(f"unknown DiLoCo system(s) {unknown or text!r}; known: {', '.join(SYSTEMS)}, all")
    return [SYSTEMS[n] for n in dict.fromkeys(names)]


@dataclasses.dataclass
class DilocoOptions:
    """The DiLoCo flags of a run (``--steps``, ``--sync-every``, ``--fragments``, ...) and its systems."""

    systems: list[DilocoSystem]
    steps: int
    sync_every: int
    fragments: int = 1
    fragment_delay: int = 0
    outer_compression: str = "none"
    seed: int = 0

    def record(self) -> dict[str, Any]:
        return {"systems": [s.name for s in self.systems], "steps": self.steps, "sync_every": self.sync_every,
                "fragments": self.fragments, "fragment_delay": self.fragment_delay,
                "outer_compression": self.outer_compression, "seed": self.seed}


@dataclasses.dataclass(frozen=True)
class Where:
    """Where one DC's trainer reaches its runtime."""

    socket: str = ""
    """netstorm: its node's trainer socket."""
    rendezvous: str = ""
    """torchft: the Lighthouse's URL; gloo: the store's HOST:PORT."""
    address: str = ""
    """The DC's overlay address (torchft's ``--hostname``, gloo's ``--address``: the others reach it there)."""


def trainer_argv(system: DilocoSystem, opts: Any, *, dc: int, rank: int, world: int, out: Path,
                 where: Where) -> list[str]:
    """DC ``dc``'s trainer command line after the interpreter; ``opts`` the run's (``runner.Options``)."""
    d = opts.diloco
    if system.trainer == "ddp":
        backend = "gloo" if system.runtime == "gloo" else "netstorm"
        store = {"store": where.rendezvous, "address": where.address} if backend == "gloo" else {}
        return torch_ddp_args(backend, opts.train, rank=rank, world=world, dc=dc, iterations=d.steps, out=out,
                              socket=where.socket or None, **store,
                              extra=["--compute-s", str(opts.compute_s), "--eval-every", str(d.sync_every),
                                     "--seed", str(d.seed)])
    schedule = system.schedule(d.fragments, d.fragment_delay, d.outer_compression)
    endpoint = (["--socket", where.socket] if system.runtime == "netstorm" else
                ["--lighthouse", where.rendezvous, "--hostname", where.address, "--replica-id", f"dc{dc}"])
    return diloco_args(system.module, opts.train, dc_index=rank, dcs=world, sync_every=d.sync_every,
                       fragments=schedule["fragments"], fragment_delay=schedule["fragment_delay"],
                       outer_compression=schedule["outer_compression"], compute_s=opts.compute_s, steps=d.steps,
                       seed=d.seed, out=out, endpoint=endpoint)


def lighthouse_argv(world: int, address: str) -> list[str]:
    """torchft's Lighthouse for ``world`` replica groups, bound to ``address`` (its console script beside
    the interpreter, where ``pip install torchft`` puts it)."""
    script = Path(sys.executable).parent / "torchft_lighthouse"
    return [str(script), "--min_replicas", str(world), "--bind", f"{address}:{LIGHTHOUSE_PORT}",
            "--join_timeout_ms", "60000", "--quorum_tick_ms", "100"]
