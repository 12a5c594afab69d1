"""``netstorm emulate``'s runner: every requested system, one after another, on one emulated network.

Each system starts from the scenario's initial rates with the dynamics clock reset, so all systems see
the same seeded rate sequence. NetStorm systems run the scheduler in the management namespace and node
i plus the synthetic trainer i in DC i's namespace; gloo runs one process per DC namespace. Trainers
write one JSON line per iteration, which the runner follows for its progress display and its result.

A DC with LAN workers (the scenario's ``lan_workers``, or ``--lan-workers N`` for every DC) runs its node
in the gateway role on its LAN interface, and one synthetic trainer in edge mode per LAN worker in that
worker's namespace, beside the DC's own trainer; every contributor checks the whole job's sum exactly
(``contributors``). gloo has no LAN tier: it runs one rank per DC and the result says so.

With ``--chaos SPEC`` (``chaos.py``) NetStorm systems run with a persisted scheduler (``--state-dir`` in
the run directory) and rejoinable trainers, and the schedule kills and restarts DCs (node and trainer,
same command lines) and the scheduler and takes links down and up, timed from the first iteration's end;
the result's ``chaos`` section has, per step, who contributed and whether the sum was exact, and per
fault the time to recover (``recovery.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import resource
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from netstorm.authconn import Credentials
from netstorm.config import LOCAL, resolve
from netstorm.emulation import compressed, netns, recovery, results, systems, wancount
from netstorm.emulation.chaos import ChaosPlayer, Fault
from netstorm.emulation.chaos import parse as parse_chaos
from netstorm.emulation.contributors import Contributor, contributors, edge_scale
from netstorm.emulation.cpu import CPU_BOUND_PCT, CpuMeter
from netstorm.emulation.dynamics import DynamicsPlayer, schedule
from netstorm.emulation.errors import EmulationError
from netstorm.emulation.lantier import DcTier, planned_tiers, run_config
from netstorm.emulation.network import EmulatedNetwork
from netstorm.emulation.schedrecord import SchedulerRecord, SchedulerWatch
from netstorm.lan_scenario import lan_toml, uniform_lan
from netstorm.progress import Progress
from netstorm.scenario import Rates, Scenario, load
from netstorm.trainers.launch import TRAINS, torch_ddp_args
from netstorm.trainers.tasks import TASKS

log = logging.getLogger(__name__)

SCHEDULER_PORT = 7000
PROBE_BY = ("scheduler", "emulator")
"""Who probes a ``--plan-scenario``'s links: the job itself, or the emulator on its behalf."""
DATA_PORT = 7100
EDGE_PORT = 9700
EDGE_MODES = ("auto", "xdp", "userspace", "tcp")
GLOO_STORE_PORT = 29500
CHUNKS_PER_MODEL = 60
"""Chunks a model is cut into when the user does not set CHUNK_SIZE: the paper's AlexNet (61 M
parameters, CHUNK_SIZE 1 M) had about 61, enough for every root to own several and for chunks to
pipeline down the trees. A model scaled down for emulation keeps that count rather than the size."""
CHUNKS_PER_ROOT = 16
"""...and never fewer than this many chunks per tree root, so the trees of a larger overlay still
pipeline. Filling and draining the pipeline costs one chunk's trip down the deepest tree and back, so
smaller chunks shorten it, until the per-chunk CPU cost takes over (the measurements behind this count
are in ``results/DECISIONS.md``)."""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    from netstorm import config
    from netstorm.emulation import diloco_systems

    parser.add_argument("--system", default=None,
                        help=f"comma-separated systems to run in order: {', '.join(systems.SYSTEMS)} or all "
                             f"(default netstorm,star); with --trainer diloco: {', '.join(diloco_systems.SYSTEMS)} "
                             f"or all (default {diloco_systems.DEFAULT})")
    parser.add_argument("--iterations", type=int, default=5, help="synchronization iterations per system")
    parser.add_argument("--model", default="alexnet",
                        help="alexnet, resnet50, a parameter count (25M) or COUNT/LAYERS (0.5M/8: near-equal layers)")
    parser.add_argument("--seed", type=int, default=None, help="dynamics seed (default: the scenario's)")
    parser.add_argument("--compute-s", type=float, default=0.0, help="trainer compute time per iteration")
    parser.add_argument("--overlap", action="store_true",
                        help="trainers overlap synchronization with the backward part of the compute time, as DDP "
                             "does (each layer pushed as backward yields it; use a layered model: alexnet, "
                             "resnet50 or COUNT/LAYERS)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply the scenario's dynamics period (0.1 = rates change 10x as often)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a system may take in all (default: from the min-cut limit)")
    parser.add_argument("--out", metavar="FILE", help="write the result JSON here")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    parser.add_argument("--lan-workers", type=int, default=None, metavar="N",
                        help="LAN workers behind every DC's gateway (default: the scenario's lan_workers)")
    parser.add_argument("--edge-mode", choices=EDGE_MODES, default="auto",
                        help="LAN aggregation at the gateways: xdp, the userspace fallback, tcp, or auto (each "
                             "path measured once per distinct LAN before the run, the faster taken; default)")
    parser.add_argument("--chaos", metavar="SPEC",
                        help="kill and restart DCs and the scheduler, take links down and up, from the first "
                             "iteration's end: e.g. kill-dc:3@20s,restart-dc:3@35s,kill-scheduler@50s,"
                             "restart-scheduler@60s,link-down:2-5@70s,link-up:2-5@80s (NetStorm systems only)")
    parser.add_argument("--plan-scenario", metavar="SCENARIO",
                        help="what the scheduler is told (the same DCs and links; rates may be missing): links "
                             "without a rate are measured by a bulk probe from each DC before the first policy, "
                             "and checked against the applied rates "
                             "(default: the emulated scenario, rates and all)")
    parser.add_argument("--probe-bytes", type=int, default=4_000_000, metavar="N",
                        help="bytes of each link's bulk probe, with --plan-scenario (default 4000000)")
    parser.add_argument("--probe-by", choices=PROBE_BY, default="scheduler",
                        help="with --plan-scenario, who probes: the scheduler, through its nodes, as on real hosts "
                             "(default), or the emulator before it starts the job, which then tells the "
                             "scheduler the measured rates")
    parser.add_argument("--run-dir", metavar="DIR",
                        help="keep every process's log and trainer output here (default: a temporary directory)")
    from netstorm.trainers.launch import TRAINERS, TRAINS

    parser.add_argument("--trainer", choices=TRAINERS, default=TRAINERS[0],
                        help="what trains in each DC: the synthetic trainer (exact sums of a --model-sized pattern), "
                             "torch-ddp (a real model, --train, with DDP on backend netstorm, or gloo for the "
                             "gloo system; loss and accuracy per iteration in the result) or diloco (DiLoCo, "
                             "Streaming DiLoCo and per-step DDP references on real data, --train)")
    tasks = list(dict.fromkeys(t for names in TRAINS.values() for t in names))
    parser.add_argument("--train", choices=tasks, default=None,
                        help="the task of torch-ddp (" + ", ".join(TRAINS["torch-ddp"]) + ": generated data) or "
                             "diloco (" + ", ".join(TRAINS["diloco"]) + ": real data); default each one's first "
                             "(replaces --model)")
    parser.add_argument("--steps", type=int, default=None, help="diloco: inner steps per DC")
    parser.add_argument("--sync-every", type=int, default=None, metavar="H", help="diloco: inner steps per outer step")
    parser.add_argument("--fragments", type=int, default=1, metavar="P",
                        help="diloco: Streaming DiLoCo's fragments (the streaming systems; default 1)")
    parser.add_argument("--fragment-delay", type=int, default=0, metavar="T",
                        help="diloco: inner steps a fragment's sync overlaps before it is applied (τ; default 0)")
    from netstorm.diloco.codec import METHODS

    parser.add_argument("--outer-compression", choices=METHODS, default="none",
                        help="diloco: the streaming systems' outer compression (default none)")
    config.add_arguments(parser, listed=("compression",))  # one row per listed compression


@dataclasses.dataclass
class Options:
    scenario: str
    systems: list[systems.System]
    iterations: int
    model: str
    bw_scale: float = 1.0
    seed: int | None = None
    compute_s: float = 0.0
    time_scale: float = 1.0
    timeout_s: float | None = None
    loss: bool = True
    config_flags: list[str] = dataclasses.field(default_factory=list)
    run_dir: str | None = None
    stream: IO[str] = sys.stderr
    lan_workers: int | None = None
    edge_mode: str = "auto"
    lan_bw_scale: float = 1.0
    lan_uplink: str = "veth"
    lan_tier: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The LAN tier's options the user gave (``edge_*``), for the ``--edge-mode auto`` calibration."""
    overlap: bool = False
    credentials: Credentials | None = None
    """The job secret (and certificate) the run's processes share, for following the scheduler."""
    chaos: list[Fault] = dataclasses.field(default_factory=list)
    trainer: str = "synthetic"
    """One of ``netstorm/trainers/launch.py``'s TRAINERS."""
    train: str = "blobs"
    """torch-ddp's task (``netstorm/trainers/tasks.py``) or diloco's (``netstorm/trainers/realdata.py``)."""
    diloco: Any = None
    """``--trainer diloco``'s schedule and systems (``diloco_systems.DilocoOptions``)."""
    plan_lans: bool = False
    """``dc_planner`` was given: every DC with LAN workers gets a described LAN to plan (``resize_lans``)."""
    plan_scenario: str | None = None
    """The scenario the scheduler is given instead of the emulated one (links without rates are probed)."""
    probe_bytes: int = 4_000_000
    probe_by: str = "scheduler"
    """``scheduler``: it is given the plan scenario and has its nodes probe (``scheduler.proberound``);
    ``emulator``: the emulator probes and gives it the measured rates (``_probe_first``)."""
    scheduler_scenario: str | None = None
    """The file the scheduler loads (set by ``run``: the plan scenario, with the emulator's probed rates
    filled in under ``probe_by = "emulator"``)."""

    def parameters(self) -> int:
        """Float32 elements synchronized per iteration: the task's model, or ``--model``."""
        from netstorm.emulation.gloo_trainer import model_parameters
        from netstorm.trainers.tasks import TASKS

        if self.trainer == "diloco":
            from netstorm.trainers.ddp_realdata import parameters

            return parameters(self.train)
        return TASKS[self.train].parameters if self.trainer == "torch-ddp" else model_parameters(self.model)
    compressions: list[str] = dataclasses.field(default_factory=lambda: ["none"])
    """Each NetStorm system runs once per compression entry (``--compression none,fediac,topk,fp16``; an
    entry may set its row's options, ``fediac:gia_reuse=4``)."""
    compression_flags: list[str] = dataclasses.field(default_factory=list)
    """The trainers' FediAC options (fediac_k, fediac_bits, fediac_votes, fediac_gia_reuse) as the user
    gave them."""


def _config_flags(args: argparse.Namespace) -> list[str]:
    """The config flags the user gave, forwarded verbatim to the scheduler and nodes."""
    from netstorm.config import FIELDS

    flags: list[str] = []
    if getattr(args, "config", None):
        flags += ["--config", str(Path(args.config).resolve())]
    for name in FIELDS:
        value = getattr(args, f"opt_{name}", None)
        if value is not None and name != "compression":  # one row per compression: set per row
            if name == "secret_file" and value:
                value = str(Path(value).resolve())
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def chunk_flags(parameters: int, given: Mapping[str, Any], *, roots: int = 1) -> list[str]:
    """CHUNK_SIZE (and PROBE_CHUNK_SIZE with it) for a model of ``parameters``, unless the user set them.

    The defaults are sized for AlexNet; a 2.5 M-parameter model at CHUNK_SIZE 1 M has 3 chunks, so 9
    roots cannot share it and nothing pipelines. The chunk keeps CHUNKS_PER_MODEL chunks, or
    CHUNKS_PER_ROOT for each of ``roots`` tree roots when that is more (never above the default size),
    and the probe threshold keeps the default's ratio to the chunk (half a chunk's
    bytes), or no chunk would ever be large enough to be a throughput sample; it follows a CHUNK_SIZE
    the user gave too.
    """
    from netstorm.config import Config

    default = Config()
    flags: list[str] = []
    chunk = int(given.get("chunk_size", default.chunk_size))
    if "chunk_size" not in given:
        chunks = max(CHUNKS_PER_MODEL, CHUNKS_PER_ROOT * roots)
        chunk = max(1, min(default.chunk_size, -(-parameters // chunks)))
        flags += ["--chunk-size", str(chunk)]
    if "probe_chunk_size" not in given:
        ratio = default.probe_chunk_size / (4 * default.chunk_size)
        flags += ["--probe-chunk-size", str(max(1, min(default.probe_chunk_size, round(4 * chunk * ratio))))]
    return flags


def _given_options(args: argparse.Namespace) -> dict[str, Any]:
    """Options the user set by config file, NETSTORM_<NAME> variable or flag (later ones win)."""
    import os

    from netstorm.config import FIELDS, load_env, load_file

    given: dict[str, Any] = dict(load_file(args.config)) if getattr(args, "config", None) else {}
    given.update(load_env(os.environ))
    given.update({name: getattr(args, f"opt_{name}") for name in FIELDS
                  if getattr(args, f"opt_{name}", None) is not None})
    return given


def options_from_args(args: argparse.Namespace) -> Options:
    from netstorm.emulation.gloo_trainer import model_parameters
    from netstorm.trainers.synthetic import model_layers
    from netstorm.trainers.tasks import TASKS

    if args.iterations < 1:
        raise EmulationError(f"--iterations must be at least 1, got {args.iterations}")
    if args.compute_s < 0:
        raise EmulationError(f"--compute-s must be >= 0, got {args.compute_s}")
    trainer = getattr(args, "trainer", "synthetic")
    train_choices = TRAINS.get(trainer, ())
    if getattr(args, "train", None) is None:
        args.train = train_choices[0] if train_choices else next(iter(TASKS))
    elif args.train not in train_choices:
        raise EmulationError(f"--trainer {trainer} trains " + (", ".join(train_choices) or "--model, not --train")
                             + f"; got --train {args.train}")
    if trainer == "diloco":
        return diloco_options(args)
    if getattr(args, "system", None) is None:
        args.system = "netstorm,star"
    if trainer == "torch-ddp":
        args.model = f"torch-ddp:{args.train}"
        if getattr(args, "overlap", False) or args.compute_s or getattr(args, "lan_workers", None) or \
                getattr(args, "chaos", None):
            raise EmulationError("--trainer torch-ddp computes for real and overlaps as DDP does: --overlap, "
                                 "--compute-s, --lan-workers and --chaos are for the synthetic trainer")
    elif getattr(args, "overlap", False) and len(model_layers(args.model)) < 2:
        raise EmulationError(f"--overlap needs a model of several layers (alexnet, resnet50 or COUNT/LAYERS such as "
                             f"{args.model}/8): {args.model!r} is one tensor, there is nothing to overlap")
    given = _given_options(args)
    roots = int(given.get("num_root_servers", 0)) or len(load(args.scenario).nodes)
    parameters = TASKS[args.train].parameters if trainer == "torch-ddp" else model_parameters(args.model)
    flags = _config_flags(args) + chunk_flags(parameters, given, roots=roots)
    lan_workers = getattr(args, "lan_workers", None)
    chaos: list[Fault] = []
    if getattr(args, "chaos", None):
        scenario = load(args.scenario)
        chaos = parse_chaos(args.chaos, dcs=[dc.id for dc in scenario.nodes],
                            links=[(link.a, link.b) for link in scenario.links])
        gloo = [s.name for s in systems.parse(args.system) if s.kind != "netstorm"]
        if gloo:
            raise EmulationError(f"--chaos needs NetStorm systems; {', '.join(gloo)} cannot rejoin")
    compression_list = compressed.parse(given.get("compression"))
    if compression_list != ["none"] and chaos:
        raise EmulationError("--compression runs without --chaos")
    if lan_workers and "fp16" in compression_list:
        raise EmulationError("--compression fp16 runs without LAN workers (their lanes are fixed point already)")
    compression_flags = [flag for name in ("fediac_k", "fediac_bits", "fediac_votes", "fediac_gia_reuse")
                         if name in given
                         for flag in ("--" + name.replace("_", "-"), str(given[name]))]
    return Options(args.scenario, systems.parse(args.system), args.iterations, args.model, args.bw_scale,
                   args.seed, args.compute_s, args.time_scale, args.timeout, not args.no_loss,
                   flags, args.run_dir, lan_workers=lan_workers,
                   edge_mode=getattr(args, "edge_mode", "auto"),
                   lan_bw_scale=lan_options(given).lan_bw_scale,
                   lan_uplink=lan_options(given).lan_uplink_shaping,
                   lan_tier={k: v for k, v in given.items() if k.startswith("edge_")},
                   overlap=bool(getattr(args, "overlap", False)),
                   chaos=chaos, trainer=trainer, train=getattr(args, "train", "blobs"),
                   compressions=compression_list, compression_flags=compression_flags,
                   plan_lans="dc_planner" in given, plan_scenario=getattr(args, "plan_scenario", None),
                   probe_bytes=getattr(args, "probe_bytes", 4_000_000),
                   probe_by=getattr(args, "probe_by", "scheduler"),
                   credentials=Credentials.from_config(resolve(overrides={k: v for k, v in given.items()
                                                                          if k in LOCAL})))


def diloco_options(args: argparse.Namespace) -> Options:
    """``--trainer diloco``'s run: its systems (``diloco_systems``), schedule flags and checks."""
    from netstorm.emulation import diloco_systems

    if args.steps is None or args.sync_every is None:
        raise EmulationError("--trainer diloco needs --steps N and --sync-every H")
    if args.steps < 1 or args.sync_every < 1 or args.fragments < 1 or args.fragment_delay < 0:
        raise EmulationError("--steps, --sync-every and --fragments must be >= 1 and --fragment-delay >= 0")
    if getattr(args, "overlap", False) or getattr(args, "lan_workers", None) or getattr(args, "plan_scenario", None):
        raise EmulationError("--trainer diloco runs without --overlap, --lan-workers and --plan-scenario")
    from netstorm.diloco.schedule import Schedule

    Schedule(args.sync_every, args.fragments, args.fragment_delay)  # a ConfigError names a schedule that cannot run
    chosen = diloco_systems.parse(args.system or diloco_systems.DEFAULT)
    d = diloco_systems.DilocoOptions(chosen, args.steps, args.sync_every, args.fragments, args.fragment_delay,
                                     args.outer_compression, seed=0)
    scenario = load(args.scenario)
    chaos = parse_chaos(args.chaos, dcs=[dc.id for dc in scenario.nodes],
                        links=[(link.a, link.b) for link in scenario.links]) if getattr(args, "chaos", None) else []
    given = _given_options(args)
    from netstorm.trainers.ddp_realdata import parameters as task_parameters

    parameters = task_parameters(args.train)
    roots = int(given.get("num_root_servers", 0)) or len(scenario.nodes)
    opts = Options(args.scenario, [], args.steps, f"diloco:{args.train}", args.bw_scale, args.seed, args.compute_s,
                   args.time_scale, args.timeout, not args.no_loss,
                   _config_flags(args) + chunk_flags(parameters, given, roots=roots), args.run_dir, chaos=chaos,
                   trainer="diloco", train=args.train, diloco=d,
                   credentials=Credentials.from_config(resolve(overrides={k: v for k, v in given.items()
                                                                          if k in LOCAL})))
    diloco_systems.check_chaos(chosen, chaos)
    return opts


def lan_options(given: Mapping[str, Any]) -> Any:
    """The options the user gave for shaping LANs (``lan_bw_scale``, ``lan_uplink_shaping``), validated,
    over the defaults."""
    return resolve(overrides={k: v for k, v in given.items() if k in ("lan_bw_scale", "lan_uplink_shaping")})


def with_seed(scenario: Scenario, seed: int | None) -> Scenario:
    if seed is None or scenario.dynamics is None:
        return scenario
    return dataclasses.replace(scenario, dynamics=dataclasses.replace(scenario.dynamics, seed=seed))


def with_lan_workers(scenario: Scenario, workers: int | None, *, planned: bool = False) -> Scenario:
    """``scenario`` with ``workers`` LAN workers behind every DC (None keeps the scenario's own).

    A DC whose LAN the scenario describes keeps that description when the count matches. Otherwise, on a
    run that plans the tier (``planned``: ``dc_planner`` given), every DC with LAN workers gets a described
    LAN of that count (``lan_scenario.uniform_lan``: the description resized to its means, or the format's
    default workers), so each DC's planner has a LAN to plan and the emulator shapes what was planned; on
    a run that does not, the count wins and the LAN is unshaped (the description was of other workers)."""
    return resize_lans(scenario, workers, planned=planned)[0]


def resize_lans(scenario: Scenario, workers: int | None, *, planned: bool = False) -> tuple[Scenario, dict[int, str]]:
    """``with_lan_workers`` and, per DC with LAN workers, where its LAN's description came from:
    ``described`` (the scenario's), ``resized`` (the scenario's, to another count), ``default`` (the
    format's default workers) or ``none`` (unshaped, not planned)."""
    if workers is not None and workers < 0:
        raise EmulationError(f"--lan-workers must be >= 0, got {workers}")
    nodes = []
    sources: dict[int, str] = {}
    for dc in scenario.nodes:
        count = dc.lan_workers if workers is None else workers
        lan = dc.lan if dc.lan is not None and len(dc.lan.workers) == count else None
        source = "described" if lan is not None else "none"
        if lan is None and planned and count > 0:
            lan = uniform_lan(count, dc.lan)
            source = "resized" if dc.lan is not None else "default"
        if count > 0:
            sources[dc.id] = source
        nodes.append(dataclasses.replace(dc, lan_workers=count, lan=lan if count > 0 else None))
    return dataclasses.replace(scenario, nodes=tuple(nodes)), sources


def compute_of(scenario: Scenario, contributor: Contributor, compute_s: float) -> float:
    """Seconds of emulated compute per iteration before ``contributor`` pushes: a LAN worker its DC's LAN
    describes spends its own ``compute_s`` (the description's, which is more specific than the run's);
    every other trainer the run's ``--compute-s``."""
    lan = scenario.node(contributor.dc).lan
    if contributor.worker is None or lan is None:
        return compute_s
    return lan.workers[contributor.worker].compute_s


def run_from_args(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    result = run(opts)
    result.setdefault("command", "netstorm " + shlex.join(sys.argv[1:]))
    if args.out:
        from netstorm.provenance import write_result

        result = write_result(args.out, result)
        print(f"result written to {args.out}", file=sys.stderr)
    print(results.summary(result))
    for line in compressed.summary_lines(result):
        print(line)
    if args.plots:
        from netstorm.emulation import plots

        for path in plots.draw_all(result, Path(args.plots), Path(args.out).stem if args.out else None):
            print(f"plot: {path}", file=sys.stderr)
    failed = [name for name, s in result["systems"].items() if s.get("error")]
    return 1 if failed else 0


class TrainerLog:
    """Follows one trainer's JSON-lines output file."""

    def __init__(self, path: Path, who: str) -> None:
        self.path = path
        self.who = who
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if line.strip():
                try:
                    self.records.append(json.loads(line))
                except ValueError:
                    self.records.append({"who": self.who, "exact": False, "error": f"unreadable line {line[:80]!r}"})


class SystemRun:
    """One system on the network: start its processes, follow progress, collect the result."""

    def __init__(self, net: EmulatedNetwork, scenario: Scenario, system: systems.System, opts: Options,
                 workdir: Path, model_bytes: int, limit_for: Any, compression: str = "none") -> None:
        self.compression = compressed.method_of(compression)
        self.trainer_compression = ["--compression", self.compression, *opts.compression_flags,
                                    *compressed.row_flags(compression)]
        self.net = net
        self.scenario = scenario
        self.system = system
        self.opts = opts
        self.dir = workdir / system.name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model_bytes = model_bytes
        self.limit_for = limit_for
        self.contributors = [c for c in contributors(net.plan) if system.kind == "netstorm" or c.worker is None]
        self.lan_tiers: dict[int, DcTier] = {}
        """Per DC with a described LAN, the plan of its tier (``dc_planner``) the scheduler pushes."""
        self.logs = {c.label: TrainerLog(self.dir / f"trainer-{c.label}.jsonl", c.label) for c in self.contributors}
        for tlog in self.logs.values():  # a reused --run-dir must not feed a previous run's lines in
            tlog.path.unlink(missing_ok=True)
        self.trainers: dict[str, subprocess.Popen[bytes]] = {}
        self.services: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[IO[bytes]] = []
        self.completed_at: list[float] = []
        self.on_first_iteration: Callable[[], None] | None = None
        """Called once, when every trainer has completed its first iteration (the dynamics start)."""
        self.current_rates: Rates = scenario.rates()
        self.epoch = 0
        self.record = SchedulerRecord()
        """Bindings, policy versions and gateway modes, from the scheduler's admin interface."""
        self.watch: SchedulerWatch | None = None
        self.argv: dict[str, tuple[int | str | tuple[int, int], list[str]]] = {}
        """Where and how each service and trainer was started (a chaos restart runs it again)."""
        self.killed: set[str] = set()
        """Services and trainers a chaos fault killed and no repair has restarted yet."""
        self.chaos: ChaosPlayer | None = None
        self.started_wall = time.time()
        self.edge_picks: dict[int, str] = {}
        """The LAN path each gateway runs where ``--edge-mode auto`` measured them (``calibrate_edges``)."""
        self.link_bytes = 0
        """Bytes the overlay links carried during the run (set when it ends)."""

    def _spawn(self, name: str, where: int | str | tuple[int, int], argv: list[str], *, trainer: bool = False,
               append: bool = False) -> subprocess.Popen[bytes]:
        self.argv[name] = (where, argv)
        fh = (self.dir / f"{name}.log").open("ab" if append else "wb")
        self._files.append(fh)
        if trainer:
            proc = self.net.spawn(where, argv, stdout=subprocess.DEVNULL, stderr=fh)
            self.trainers[name.removeprefix("trainer-")] = proc
        else:
            proc = self.net.spawn(where, argv, stdout=fh, stderr=subprocess.STDOUT)
            self.services[name] = proc
        return proc

    def apply_fault(self, fault: Fault) -> None:
        """Carry out one chaos fault or repair (in the chaos thread)."""
        if fault.action == "kill-dc":
            dc = fault.target[0]
            for name, proc in ((f"node-{dc}", self.services[f"node-{dc}"]), (f"trainer-{dc}", self.trainers[str(dc)])):
                self.killed.add(name)
                proc.kill()
                proc.wait()
        elif fault.action == "restart-dc":
            dc = fault.target[0]
            sock = self.dir / f"node-{dc}.sock"
            sock.unlink(missing_ok=True)
            where, argv = self.argv[f"node-{dc}"]
            self._spawn(f"node-{dc}", where, argv, append=True)
            self.killed.discard(f"node-{dc}")
            deadline = time.monotonic() + 60.0
            while not sock.exists():
                if time.monotonic() > deadline:
                    raise EmulationError(f"restarted node {dc} did not open its trainer socket within 60 s")
                time.sleep(0.05)
            where, argv = self.argv[f"trainer-{dc}"]
            self._spawn(f"trainer-{dc}", where, argv, trainer=True, append=True)
            self.killed.discard(f"trainer-{dc}")
        elif fault.action == "kill-scheduler":
            self.killed.add("scheduler")
            self.services["scheduler"].kill()
            self.services["scheduler"].wait()
        elif fault.action == "restart-scheduler":
            where, argv = self.argv["scheduler"]
            self._spawn("scheduler", where, argv, append=True)
            self.killed.discard("scheduler")
        else:
            a, b = fault.target
            self.net.set_link(a, b, up=fault.action == "link-up")

    def _logfile(self, name: str) -> IO[bytes]:
        fh = (self.dir / f"{name}.log").open("wb")
        self._files.append(fh)
        return fh

    def _python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def _start_netstorm(self, deadline: float) -> None:
        net, opts = self.net, self.opts
        scheduler = f"{net.scheduler_host}:{SCHEDULER_PORT}"
        scenario_path = opts.scheduler_scenario or str(Path(self.scenario.source).resolve())
        nodes = ",".join(str(dc) for dc in net.plan.node_ids)
        persisted = ["--state-dir", str(self.dir / "scheduler-state")] if opts.chaos else []
        probing = ["--probe-bytes", str(opts.probe_bytes)] if opts.plan_scenario and opts.probe_by == "scheduler" \
            else []
        self._spawn("scheduler", "mgmt", self._python(
            "-m", "netstorm.cli", "-v", "scheduler", scenario_path, "--listen", scheduler, "--nodes", nodes,
            "--bw-scale", str(net.bw_scale), *probing, *self.system.scheduler_flags(), *opts.config_flags,
            *persisted, "--compression", self.compression))
        _wait_listening(net.plan.mgmt_namespace, SCHEDULER_PORT, deadline, self.services["scheduler"])
        self.watch = SchedulerWatch((net.scheduler_host, SCHEDULER_PORT), self.record,
                                    namespace=net.plan.mgmt_namespace, credentials=opts.credentials)
        self.watch.start()
        self.lan_tiers = planned_tiers(self.scenario, run_config(opts.config_flags)) if net.plan.lans else {}
        for dc in net.plan.node_ids:
            gateway = self._gateway_flags(dc)
            if dc in self.lan_tiers:  # the gateway announces its LAN; the scheduler plans and pushes the tier
                lan = self.scenario.node(dc).lan
                assert lan is not None
                described = self.dir / f"lan-{dc}.toml"   # the run's LAN, which may not be the file's own
                described.write_text(lan_toml(lan))
                gateway += ["--edge-lan", str(described)]
            # -v: the log names each link's load per iteration
            self._spawn(f"node-{dc}", dc, self._python(
                "-m", "netstorm.cli", "-v", "node", "--id", str(dc), "--scheduler", scheduler,
                "--listen", f"{net.node_address(dc)}:{DATA_PORT}", "--socket", str(self.dir / f"node-{dc}.sock"),
                *gateway, *opts.config_flags, "--compression", self.compression))
        for dc in net.plan.node_ids:
            sock = self.dir / f"node-{dc}.sock"
            while not sock.exists():
                self._check_services()
                if time.monotonic() > deadline:
                    raise EmulationError(f"node {dc} did not open its trainer socket {sock} in time")
                time.sleep(0.1)
        self._start_lan_aggregators()
        self._start_trainers()

    def _start(self, deadline: float) -> None:
        """Start the system's services and trainers (``run`` then follows them)."""
        if self.system.kind == "gloo":
            self._start_gloo()
        else:
            self._start_netstorm(deadline)

    def _start_trainers(self) -> None:
        """One trainer per contributor, against its node's socket or its gateway's LAN port."""
        net, opts = self.net, self.opts
        # With LAN workers nobody sees the whole job, so every contributor is told its size and id sum.
        job = ["--contributors", str(len(self.contributors)),
               "--contributor-sum", str(sum(c.id for c in self.contributors))] if net.plan.lans else []
        if self.compression != "none":  # the known exact sum lets a compressed trainer report its error
            job = ["--contributor-sum", str(sum(c.id for c in self.contributors)), *self.trainer_compression]
        for c in self.contributors:
            if c.worker is None:
                where: int | tuple[int, int] = c.dc
                endpoint = ["--socket", str(self.dir / f"node-{c.dc}.sock")]
            else:
                where = (c.dc, c.worker)
                address = net.plan.lans[c.dc].gateway_address
                endpoint = ["--edge", f"edge://{address}:{EDGE_PORT}?worker={c.worker}"]
            if opts.trainer == "torch-ddp":
                self._spawn(f"trainer-{c.label}", where, self._python(*torch_ddp_args(
                    "netstorm", opts.train, rank=net.plan.node_ids.index(c.dc), world=len(net.plan.node_ids),
                    dc=c.dc, iterations=opts.iterations, out=self.logs[c.label].path,
                    socket=str(self.dir / f"node-{c.dc}.sock"),
                    compression=self.trainer_compression)), trainer=True)
                continue
            # a chaos run's trainers carry their step in the model and ride out failed iterations
            chaos = ["--rejoinable", "--max-failures", "1000", "--retry-s", "0.2"] if opts.chaos else []
            self._spawn(f"trainer-{c.label}", where, self._python(
                "-m", "netstorm.trainers.synthetic", *endpoint, "--dc", str(c.id), *job, "--model", opts.model,
                "--iterations", str(opts.iterations), "--compute-s", str(compute_of(self.scenario, c, opts.compute_s)),
                *(["--overlap"] if opts.overlap else []), *chaos, *self._secret_flags(),
                "--out", str(self.logs[c.label].path)),
                trainer=True)

    def _start_lan_aggregators(self) -> None:
        """``netstorm lan-aggregator`` on the host of each aggregator worker the planned tiers name, and, where a
        re-plan may name others (a planner other than flat, on a UDP path), on every worker's host: a service
        whose worker aggregates nothing stands by, so a deployment changed mid-run finds it."""
        for dc, tier in self.lan_tiers.items():
            lan = self.net.plan.lans[dc]
            tcp = self.edge_picks.get(dc, self.opts.edge_mode) == "tcp"
            if tier.aggregators and tcp:
                raise EmulationError(f"DC {dc}: --edge-mode tcp is one level, and the {tier.plan.planner} plan of its "
                                     f"LAN has aggregators; use xdp, userspace or auto")
            mode = "userspace" if self.opts.edge_mode == "userspace" else "xdp"
            standby = tier.plan.planner != "flat" and not tcp
            for worker in range(lan.workers) if standby else tier.aggregators:
                self._spawn(f"lan-aggregator-{dc}-{worker}", (dc, worker), self._python(
                    "-m", "netstorm.cli", "-v", "lan-aggregator", "--gateway", f"{lan.gateway_address}:{EDGE_PORT}",
                    "--worker", str(worker), "--listen", lan.worker_addresses[worker],
                    "--interface", lan.worker_ifaces[worker], "--mode", mode,
                    "--attach", "generic",      # a veth: see netstorm lan-aggregator --attach
                    *self.opts.config_flags))

    def _secret_flags(self) -> list[str]:
        """``--secret-file`` as the scheduler and nodes got it, for the trainers (LAN workers' tokens)."""
        flags = self.opts.config_flags
        return [flag for i, flag in enumerate(flags) if flag == "--secret-file" or
                (i > 0 and flags[i - 1] == "--secret-file")]

    def _gateway_flags(self, dc: int) -> list[str]:
        """The gateway role's flags of DC ``dc``'s node; [] for a DC without LAN workers."""
        lan = self.net.plan.lans.get(dc)
        if lan is None:
            return []
        lan_ids = [c.id for c in self.contributors if c.dc == dc and c.worker is not None]
        return ["--edge-workers", str(lan.workers), "--edge-listen", f"{lan.gateway_address}:{EDGE_PORT}",
                "--edge-interface", lan.gateway_iface, "--edge-mode", self.edge_picks.get(dc, self.opts.edge_mode),
                "--edge-scale", str(edge_scale(lan_ids))]

    def dc_planners(self) -> dict[str, dict[str, str | None]]:
        """Per DC with LAN workers, the planner its tier ran (its plan's own name), or None and why not."""
        out: dict[str, dict[str, str | None]] = {}
        for dc in sorted(self.net.plan.lans):
            tier = self.lan_tiers.get(dc)
            out[str(dc)] = ({"planner": tier.plan.planner} if tier is not None else
                            {"planner": None, "why": "the scenario describes no LAN for this DC and no dc_planner was "
                                                     "given: the flat gateway, unplanned and unshaped"})
        return out

    def edge_modes(self) -> dict[str, str]:
        """How each gateway aggregated its LAN (``xdp (native)``, ``xdp (generic)``, ``userspace``), as its
        node told the scheduler; ``"not started"`` when the node never served its LAN."""
        return self.record.edge_modes(self.net.plan.lans)

    def _start_gloo(self) -> None:
        net, opts = self.net, self.opts
        ids = net.plan.node_ids
        store = f"{net.plan.mgmt_address(ids[0])}:{GLOO_STORE_PORT}"
        for rank, dc in enumerate(ids):
            if opts.trainer == "torch-ddp":
                self.trainers[str(dc)] = net.spawn(dc, self._python(*torch_ddp_args(
                    "gloo", opts.train, rank=rank, world=len(ids), dc=dc, iterations=opts.iterations,
                    out=self.logs[str(dc)].path, store=store, address=net.node_address(dc))),
                    stdout=subprocess.DEVNULL, stderr=self._logfile(f"trainer-{dc}"))
                continue
            self.trainers[str(dc)] = net.spawn(dc, self._python(
                "-m", "netstorm.emulation.gloo_trainer", "--rank", str(rank), "--world", str(len(ids)),
                "--dc", str(dc), "--store", store, "--address", net.node_address(dc), "--model", opts.model,
                "--iterations", str(opts.iterations), "--compute-s", str(opts.compute_s),
                *(["--overlap"] if opts.overlap else []), "--out", str(self.logs[str(dc)].path)),
                stdout=subprocess.DEVNULL, stderr=self._logfile(f"trainer-{dc}"))

    def _check_services(self) -> None:
        for name, proc in list(self.services.items()):
            if name not in self.killed and proc.poll() is not None:
                tail = (self.dir / f"{name}.log").read_text(errors="replace")[-600:]
                raise EmulationError(f"{self.system.name}: {name} exited with {proc.returncode}: {tail.strip()}")

    def policy_versions(self) -> dict[str, Any]:
        """The policy version the scheduler bound each of its iterations to, and every version it published.

        Followed on the scheduler's admin interface while the run goes; iteration numbers are the
        scheduler's (the runtime's own count, which need not equal the trainer's), so the result keeps
        them as they are.
        """
        return self.record.policy_versions()

    def scheduler_probe(self) -> dict[str, Any]:
        """The scheduler's first probe round as its status told it, each measured link against the rate
        the emulator applied (scenario units: measured over bw_scale); links it could not measure planned
        from the prior, and are listed as failed."""
        from netstorm.emulation.linkprobe import comparison

        probed, seconds = self.record.probe()
        measured = {(a, b): mbit / self.net.bw_scale for a, b, mbit, _ in probed if mbit >= 0}
        rows = comparison(measured, self.scenario.rates())
        return {"by": "scheduler", "seconds": round(seconds, 3) if seconds >= 0 else None, "links": rows,
                "failed": [{"src": a, "dst": b, "why": why} for a, b, mbit, why in probed if mbit < 0],
                "worst_relative_error": round(max((abs(r["ratio"] - 1) for r in rows), default=0.0), 4)
                if rows else None}

    def on_rates(self, entry: dict[str, Any]) -> None:
        self.epoch = int(entry["epoch"])

    def run(self, budget_s: float, progress: Progress) -> dict[str, Any]:
        start = time.monotonic()
        deadline = start + budget_s
        cpu = CpuMeter()
        usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        link_bytes0 = wancount.overlay_tx_bytes(self.net.plan)
        error = ""
        stop = threading.Event()
        self.started_wall = time.time()
        if self.opts.chaos:
            self.chaos = ChaosPlayer(self.opts.chaos, self.apply_fault)
        try:
            self._start(deadline)
            while not stop.wait(0.5):
                for tlog in self.logs.values():
                    tlog.poll()
                self._note_progress(time.monotonic() - start, progress, cpu.sample())
                trainers = {dc: p for dc, p in list(self.trainers.items()) if f"trainer-{dc}" not in self.killed}
                if self.chaos is not None:  # failed steps are expected: the table judges the run
                    if all(p.poll() is not None for p in trainers.values()) and len(self.chaos.log) == len(
                            self.opts.chaos):
                        break
                else:
                    failed = {dc: p.returncode for dc, p in trainers.items() if p.poll() not in (None, 0)}
                    if failed:
                        raise EmulationError(f"trainer(s) failed: {failed}; see {self.dir}")
                    if all(p.poll() == 0 for p in trainers.values()):
                        break
                self._check_services()
                if time.monotonic() > deadline:
                    raise EmulationError(f"not finished after {budget_s:.0f} s (raise --timeout)")
        except EmulationError as exc:
            error = str(exc)
            progress.line(f"[{self.system.name}] FAILED: {error}")
        finally:
            if self.watch is not None:
                self.watch.stop()  # its last poll, while the scheduler still runs
                if self.watch.error:
                    progress.line(f"[{self.system.name}] the scheduler's admin interface: {self.watch.error}")
            if self.chaos is not None:  # after the watch: a restarted scheduler ends with the chaos thread
                self.chaos.stop()
            self.net.stop_processes()
            for fh in self._files:
                fh.close()
        for tlog in self.logs.values():
            tlog.poll()
        usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        link_bytes = wancount.overlay_tx_bytes(self.net.plan) - link_bytes0
        self.link_bytes = link_bytes
        out = self._collect(time.monotonic() - start)
        if self.system.kind == "netstorm":
            out.update(self._wan(link_bytes))
            if "dcs_agree" in out:  # compressed sums: exact means every DC decoded the same sum
                out["exact"] = out["exact"] and out["dcs_agree"]
        out["cpu"] = cpu.summary()
        run_cpu_s = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
        out["cpu"]["run_cpu_s"] = round(run_cpu_s, 2)
        out["cpu"]["run_pct"] = round(100.0 * run_cpu_s / max(out["wall_s"], 1e-9) / out["cpu"]["cpus"], 1)
        if error:
            out["error"] = error
        return out

    def iteration_starts(self, origin: float) -> list[float] | None:
        """When each completed iteration began at the earliest DC, in seconds after the wall-clock time
        ``origin`` (the rate log's zero), from the trainers' own stamps; None when a trainer did not stamp."""
        out: list[float] = []
        for k in range(self._complete()):
            began = [float(r["began"]) for tl in self.logs.values() for r in tl.records
                     if r.get("iteration") == k and "began" in r]
            if not began:
                return None
            out.append(round(min(began) - origin, 4))
        return out
    def _wan(self, link_bytes: int) -> dict[str, Any]:
        """WAN bytes per iteration as the nodes counted them, checked against the links' counters."""
        records = {c.label: self.logs[c.label].records for c in self.contributors if c.worker is None}
        stats = compressed.collect(records, self.opts.iterations)
        stats.update(compression=self.compression, compression_flags=self.trainer_compression[2:],
                     link_tx_bytes=link_bytes,
                     link_over_node_bytes=round(link_bytes / stats["wan_bytes_total"], 4)
                     if stats["wan_bytes_total"] else None)
        stats.update(compressed.latency_note(stats, planned_trees(self.system, self.scenario.rates()),
                                             self.scenario))
        return stats

    def _complete(self) -> int:
        return min(sum(1 for r in tl.records if "iteration" in r) for tl in self.logs.values())

    def _note_progress(self, elapsed: float, progress: Progress, cpu_pct: float) -> None:
        done = self._complete()
        while len(self.completed_at) < done:
            k = len(self.completed_at)
            self.completed_at.append(elapsed)
            if k == 0 and self.on_first_iteration is not None:
                self.on_first_iteration()
            secs = max(r["seconds"] for tl in self.logs.values() for r in tl.records if r.get("iteration") == k)
            rates = " ".join(f"{a}>{b}:{r * self.net.bw_scale:.0f}" for (a, b), r in sorted(self.net.rates.items()))
            version = ""
            if self.system.kind == "netstorm":
                versions = self.policy_versions()
                latest = max(versions["bound"].items(), key=lambda kv: int(kv[0]), default=(None, "?"))[1]
                version = f"policy v{latest} (of {len(versions['policies'])} published) "
            progress.advance(self.system.name, k + 1)
            progress.line(f"[{self.system.name}] iteration {k + 1}/{self.opts.iterations}: {secs:.2f} s "
                          f"(limit {self.limit_for(self.net.rates):.2f} s) {version}epoch {self.epoch} "
                          f"cpu {cpu_pct:.0f}% rates(Mbit/s) {rates}")

    def _collect(self, wall_s: float) -> dict[str, Any]:
        iterations: list[float] = []
        sync: list[float] = []
        per_dc: dict[str, list[float]] = {c.label: [] for c in self.contributors if c.worker is None}
        per_lan: dict[str, list[float]] = {c.label: [] for c in self.contributors if c.worker is not None}
        exact = True
        errors: list[str] = []
        for tl in self.logs.values():
            for r in tl.records:
                if "iteration" in r:
                    (per_lan if tl.who in per_lan else per_dc)[tl.who].append(float(r["seconds"]))
                # a compressed sum is not exact by design (null); the DCs' agreement is checked instead
                exact &= bool(r.get("exact", False)) or (r.get("exact", False) is None and "iteration" in r)
                if r.get("error"):
                    errors.append(f"{'DC ' if tl.who in per_dc else 'LAN worker '}{tl.who}: {r['error']}")
        done = self._complete()
        for k in range(done):
            recs = [r for tl in self.logs.values() for r in tl.records if r.get("iteration") == k]
            iterations.append(round(max(float(r["seconds"]) for r in recs), 4))
            sync.append(round(max(float(r.get("sync_s", r["seconds"])) for r in recs), 4))
        out: dict[str, Any] = {"kind": self.system.kind, "iteration_s": iterations, "sync_s": sync,
                               "per_dc_iteration_s": per_dc, "exact": exact and done == self.opts.iterations,
                               "iterations_completed": done, "wall_s": round(wall_s, 2),
                               "completed_at_s": [round(t, 2) for t in self.completed_at]}
        if self.opts.trainer == "torch-ddp":
            out.update(training(list(self.logs.values()), done, TASKS[self.opts.train].target_accuracy))
        if self.system.kind == "netstorm":
            out.update(topology=self.system.topology, awareness=self.system.awareness, aux=self.system.aux,
                       policy_versions=self.policy_versions(), policy_trees=self.record.policy_trees())
            if self.opts.plan_scenario and self.opts.probe_by == "scheduler":
                out["probe"] = self.scheduler_probe()
        if self.chaos is not None:
            records = {c.dc: self.logs[c.label].records for c in self.contributors if c.worker is None}
            table = recovery.steps(records, self.started_wall)
            faults = list(self.chaos.log)
            completed = [row for row in table if row["contributors"]]
            out["chaos"] = {"spec": ",".join(str(f) for f in self.opts.chaos), "faults": faults,
                            "steps": table, "recoveries": recovery.recoveries(faults, table, records,
                                                                             self.started_wall),
                            "all_exact": bool(completed) and all(row["exact"] for row in completed)}
            for entry in faults:
                entry["t_s"] = round(entry["t"] - self.started_wall, 2)
            out["exact"] = out["chaos"]["all_exact"]
        if self.net.plan.lans:
            out["lan_workers"] = {str(dc): len([c for c in self.contributors if c.dc == dc and c.worker is not None])
                                  for dc in self.net.plan.lans}
            if per_lan:
                out["per_lan_worker_iteration_s"] = per_lan
                out["lan_tier"] = {str(dc): tier.record() for dc, tier in sorted(self.lan_tiers.items())}
                out["dc_planners"] = self.dc_planners()
                out["edge_mode"] = self.edge_modes()
            else:
                out["lan_note"] = "gloo has no LAN tier: one rank per DC, the LAN workers did not take part"
        if errors:
            out["trainer_errors"] = errors[:20]
        return out


def _wait_listening(namespace: str, port: int, deadline: float, proc: subprocess.Popen[bytes]) -> None:
    """Wait until something listens on TCP ``port`` inside ``namespace`` (the scheduler is up)."""
    while True:
        out = netns.run(["ip", "netns", "exec", namespace, "ss", "-Htln", f"sport = :{port}"],
                        what=f"check port {port} in {namespace}", check=False)
        if out.strip():
            return
        if proc.poll() is not None:
            raise EmulationError(f"the scheduler exited with {proc.returncode} before listening on {port}")
        if time.monotonic() > deadline:
            raise EmulationError(f"the scheduler did not listen on port {port} in time")
        time.sleep(0.2)



def run_directory(stack: contextlib.ExitStack, run_dir: str | None) -> str:
    """Where a run's processes keep their logs and sockets: ``run_dir`` (kept), else a temporary
    directory that ``stack`` removes."""
    if run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return run_dir
    return str(stack.enter_context(tempfile.TemporaryDirectory(prefix="netstorm-emu-")))

def run(opts: Options) -> dict[str, Any]:
    """Build the network, run every system, return the result document (see ``results``)."""
    scenario, lan_sources = resize_lans(with_seed(load(opts.scenario), opts.seed), opts.lan_workers,
                                        planned=opts.plan_lans)
    parameters = opts.parameters()
    model_bytes = 4 * parameters
    bounds = results.Bounds(model_bytes, opts.bw_scale)
    progress = Progress(opts.stream)
    result = results.new_result(scenario, opts, parameters, bounds)
    with contextlib.ExitStack() as stack:
        stack.callback(progress.close)
        tmp = run_directory(stack, opts.run_dir)
        net = stack.enter_context(EmulatedNetwork(scenario, bw_scale=opts.bw_scale, loss=opts.loss,
                                                     lan_bw_scale=opts.lan_bw_scale, lan_uplink=opts.lan_uplink))
        result["run_id"] = net.run_id
        result["features"] = {"applied": list(net.features.applied), "not_applied": dict(net.features.not_applied)}
        if net.plan.lans:
            result["features"]["lan_workers"] = {str(dc): lan.workers for dc, lan in sorted(net.plan.lans.items())}
            result["features"]["edge_mode"] = {"requested": opts.edge_mode}
            result["features"]["dc_planner"] = run_config(opts.config_flags).dc_planner
            result["features"]["dc_pace_rates"] = run_config(opts.config_flags).dc_pace_rates
            result["features"]["lan_description"] = {str(dc): src for dc, src in sorted(lan_sources.items())}
            if any(lan.racks for lan in net.plan.lans.values()):
                result["features"]["lan_racks"] = net.rack_record()
        for line in net.features.lines():
            progress.line(line)
        if opts.plan_scenario:
            result["probe"] = _plan_scenario(net, scenario, opts, Path(tmp), progress)
        picks: dict[int, str] = {}
        if net.plan.lans and opts.edge_mode == "auto" and any(s.kind == "netstorm" for s in opts.systems):
            from netstorm.lan.pathpick import candidates

            paths = candidates(clustered=run_config(opts.config_flags).dc_planner != "flat"   # two levels
                               or bool(opts.lan_tier.get("edge_clusters")),
                               compressed=any(c != "none" for c in opts.compressions))
            picks, calibrations = calibrate_edges(net.plan, opts.lan_bw_scale, parameters, progress, opts.lan_tier,
                                                  paths=paths)
            result["features"]["edge_calibration"] = calibrations
        rows = [(dataclasses.replace(system, name=compressed.row_name(system.name, c)) if c != "none" else system, c)
                for system in opts.systems for c in opts.compressions if system.kind == "netstorm" or c == "none"]
        for system, compression in rows:
            net.set_rates(scenario.rates())
            lan_compute = max((w.compute_s for dc in scenario.nodes if dc.lan is not None for w in dc.lan.workers),
                              default=0.0)
            per_iteration = max(opts.compute_s, lan_compute) + 40.0 * bounds.limit_s(scenario.rates())
            budget = opts.timeout_s or 120.0 + opts.iterations * per_iteration
            runner = SystemRun(net, scenario, system, opts, Path(tmp), model_bytes, bounds.limit_s, compression)
            runner.edge_picks = picks

            def on_change(entry: dict[str, Any], runner: SystemRun = runner) -> None:
                _on_rates(entry, runner, progress)

            player = DynamicsPlayer(net, schedule(scenario, time_scale=opts.time_scale), on_change=on_change)
            progress.line(f"[{system.name}] starting ({system.kind})")
            progress.bar(system.name, f"{system.name} iterations", opts.iterations)
            # The schedule starts with training, when the first iteration (which also sets up every
            # connection) completes: start-up time varies from run to run, and timing the schedule from the
            # launch gave each system a different number of iterations on each epoch's rates.
            def first_iteration(runner: SystemRun = runner, player: DynamicsPlayer = player) -> None:
                player.anchor()
                if runner.chaos is not None:
                    runner.chaos.anchor()

            runner.on_first_iteration = first_iteration
            player.start(scenario.rates(), anchored=True)
            try:
                outcome = runner.run(budget, progress)
            finally:
                player.stop()
            outcome["link_rate_log"] = player.log
            outcome["dynamics_origin_s"] = player.origin_s
            outcome["started_at_s"] = runner.iteration_starts(player.wall_start)
            outcome["limit_s"] = results.iteration_limits(outcome, player.log, bounds, scenario, result)
            outcome["limit_errors"] = results.limit_errors(outcome, result)
            for e in outcome["limit_errors"]:
                progress.line(f"[{system.name}] ERROR: iteration {e['iteration'] + 1} took {e['iteration_s']:.2f} s, "
                              f"below its limit {e['limit_s']:.2f} s")
            if "probe" in outcome:
                _note_probe(outcome["probe"], progress, system.name)
            if system.kind == "netstorm":
                outcome["switches"] = systems.in_effect(system, opts.config_flags)
                outcome["trees"] = planned_trees(system, bounds.scaled(scenario.rates()),
                                                 packing=outcome["switches"]["tree_packing"],
                                                 num_roots=outcome["switches"]["num_root_servers"])
            result["systems"][system.name] = outcome
            if "edge_mode" in outcome:
                result["features"]["edge_mode"][system.name] = outcome["edge_mode"]
                progress.line(f"[{system.name}] LAN aggregation: " + ", ".join(
                    f"DC {dc} {mode}" for dc, mode in outcome["edge_mode"].items()))
            _warn_cpu(outcome, progress, system.name)
    return result


def _plan_scenario(net: EmulatedNetwork, truth: Scenario, opts: Options, where: Path,
                   progress: Progress) -> dict[str, Any]:
    """The scheduler is to be told ``--plan-scenario``: checked against the emulated one, then given as it
    is (its nodes probe, each system's result records what they measured: ``scheduler_probe``) or with
    the emulator's probes filled in (``_probe_first``); the run's record of it."""
    assert opts.plan_scenario is not None
    told = load(opts.plan_scenario)
    pairs = {(lk.a, lk.b) for lk in told.links} | {(lk.b, lk.a) for lk in told.links}
    if set(told.node_ids) != set(truth.node_ids) or not pairs <= set(truth.rates()):
        raise EmulationError(f"--plan-scenario {told.name} must have the DCs and links of {truth.name}")
    record = {"by": opts.probe_by, "plan_scenario": told.name, "probe_bytes": opts.probe_bytes,
              "prior_mbit": told.prior_mbit, "unrated_links": len(told.unknown)}
    if opts.probe_by == "emulator":
        return {**record, **_probe_first(net, told, truth, opts, where, progress)}
    if told.source == "<memory>":
        raise EmulationError(f"--plan-scenario {told.name}: the scheduler loads it from a file")
    opts.scheduler_scenario = str(Path(told.source).resolve())
    progress.line(f"the scheduler is told {told.name} ({len(told.unknown)} directed link(s) without a rate) and "
                  f"probes them through its nodes before the first policy")
    return record


def _note_probe(probe: dict[str, Any], progress: Progress, name: str) -> None:
    failed = "; ".join(f"{f['src']}->{f['dst']}: {f['why']}" for f in probe["failed"])
    if probe["worst_relative_error"] is None:
        progress.line(f"[{name}] the scheduler measured no link" + (f" ({failed})" if failed else ""))
        return
    progress.line(f"[{name}] the scheduler probed {len(probe['links'])} directed link(s) in {probe['seconds']} s; "
                  f"measured/applied within {probe['worst_relative_error']:.1%}"
                  + (f"; from the prior: {failed}" if failed else ""))


def _probe_first(net: EmulatedNetwork, told: Scenario, truth: Scenario, opts: Options, where: Path,
                 progress: Progress) -> dict[str, Any]:
    """Give the scheduler ``told`` with its missing rates measured by bulk probes from the DCs, each
    against the rate the emulator applied; the record of what was probed."""
    from netstorm.emulation.linkprobe import comparison, probe_links
    from netstorm.scenario import to_toml

    started = time.monotonic()
    measured = probe_links(net, sorted(told.unknown), opts.probe_bytes) if told.unknown else {}
    rows = comparison(measured, truth.rates())
    filled = told.with_rates(measured)
    path = where / "scheduler-scenario.toml"
    path.write_text(to_toml(filled, f"{told.description.strip()}\nRates probed before the first policy."))
    opts.scheduler_scenario = str(path)
    worst = max((abs(r["ratio"] - 1) for r in rows), default=0.0)
    progress.line(f"probed {len(rows)} directed links in {time.monotonic() - started:.1f} s; measured/applied "
                  f"within {worst:.1%}; the scheduler plans from {path}")
    return {"seconds": round(time.monotonic() - started, 3), "links": rows, "worst_relative_error": round(worst, 4)}


def calibrate_edges(plan: Any, lan_bw_scale: float, parameters: int, progress: Progress,
                    options: dict[str, Any] | None = None,
                    paths: tuple[str, ...] = ("xdp", "userspace", "tcp")) -> tuple[dict[int, str], dict[str, Any]]:
    """``--edge-mode auto``: measure the LAN ``paths`` once per distinct LAN (worker count, shaped rates, racks)
    on a namespace LAN like it (``netstorm.bench.edge.calibrate``) and give each gateway the pick
    (``netstorm.lan.pathpick``); the calibrations go into the result. A gateway whose XDP then fails to
    load still falls back by itself."""
    from netstorm.bench.edge import calibrate

    done: dict[tuple[Any, ...], dict[str, Any]] = {}
    picks: dict[int, str] = {}
    out: dict[str, Any] = {}
    for dc, lan in sorted(plan.lans.items()):
        rates = tuple((up * lan_bw_scale, down * lan_bw_scale) for up, down in lan.rates)
        racks = tuple((r.rack, r.gbit * lan_bw_scale, r.workers) for r in lan.racks)
        key = (lan.workers, rates, racks)
        if key not in done:
            worker_racks = [next((r.rack for r in lan.racks if i in r.workers), None) for i in range(lan.workers)]
            done[key] = calibrate(lan.workers, elements=parameters, rates=list(rates) or None, options=options,
                                  paths=paths, racks=[(rid, gbit) for rid, gbit, _ in racks] or None,
                                  worker_racks=worker_racks)
            c = done[key]
            measured = ", ".join(f"{p} {c[p]:.3g} Gbit/s" if c[p] is not None else f"{p} failed ({c[p + '_error']})"
                                 for p in paths)
            shaped = " shaped" if rates else ""
            progress.line(f"edge_mode auto: {lan.workers} workers{shaped}: {measured} -> {c['pick']}")
        picks[dc] = done[key]["pick"]
        out[str(dc)] = done[key]
    return picks, out


def planned_trees(system: systems.System, rates: Rates, *, packing: bool = True, num_roots: int = 0
                  ) -> dict[str, dict[str, int | None]]:
    """The trees the policy engine plans for ``system`` at ``rates`` (what the scheduler starts from);
    ``packing`` and ``num_roots`` are the run's TREE_PACKING (false: Algorithm 2's trees) and
    NUM_ROOT_SERVERS."""
    from netstorm.planning.plan import plan

    policy = plan(rates, topology=system.topology, aux=False, packing=packing, num_roots=num_roots)
    return {str(root): {str(child): parent for child, parent in sorted(tree.parent.items())}
            for root, tree in sorted(policy.trees.items())}


def _on_rates(entry: dict[str, Any], runner: SystemRun, progress: Progress) -> None:
    runner.on_rates(entry)
    if entry["epoch"] > 0:
        progress.line(f"[{runner.system.name}] rates re-drawn (epoch {entry['epoch']}) at t={entry['t']:.1f} s")


def _warn_cpu(outcome: dict[str, Any], progress: Progress, name: str) -> None:
    if outcome["cpu"]["mean_pct"] >= CPU_BOUND_PCT:
        progress.line(f"[{name}] WARNING: host CPU averaged {outcome['cpu']['mean_pct']:.0f}% (this run's own "
                      f"processes {outcome['cpu']['run_pct']:.0f}%): this result is "
                      "CPU-bound, not a network result; scale --bw-scale and --model down together")


def training(logs: Any, done: int, target: float) -> dict[str, Any]:
    """A torch-ddp system's learning curve and the backend's own cost, for its result entry.

    ``loss`` and ``accuracy`` (held-out, a fraction 0-1) per completed iteration come from the rank that
    evaluates (every rank holds the same model under DDP). On netstorm, ``overhead_s`` per iteration is
    the slowest rank's integration cost (encoding, copies, decoding: not the node's synchronization), and
    ``integration_cost`` its sum over the iterations' sum (iterations after the first: the first also
    builds DDP's buckets and connections). ``time_to_accuracy_s`` is the training time (the iterations'
    seconds, evaluation excluded) until held-out accuracy first reaches ``target_accuracy`` (None: never).
    """
    records = [r for tl in logs for r in tl.records if "iteration" in r]
    curve = {int(r["iteration"]): r for r in records if "accuracy" in r}
    out: dict[str, Any] = {
        "loss": [round(float(curve[k]["loss"]), 5) if k in curve else None for k in range(done)],
        "accuracy": [round(float(curve[k]["accuracy"]), 4) if k in curve else None for k in range(done)],
        "target_accuracy": target,
    }
    seconds_per = [max((float(r["seconds"]) for r in records if r["iteration"] == k), default=0.0) for k in range(done)]
    reached = [k for k in range(done) if k in curve and float(curve[k]["accuracy"]) >= target]
    out["time_to_accuracy_s"] = round(sum(seconds_per[:reached[0] + 1]), 3) if reached else None
    out["iterations_to_accuracy"] = reached[0] + 1 if reached else None
    if any("overhead_s" in r for r in records):
        overhead = [max(float(r.get("overhead_s", 0.0)) for r in records if r["iteration"] == k) for k in range(done)]
        seconds = seconds_per
        out["overhead_s"] = [round(v, 5) for v in overhead]
        steady = slice(1, None) if done > 1 else slice(None)
        out["integration_cost"] = round(sum(overhead[steady]) / max(sum(seconds[steady]), 1e-9), 4)
        out["node_iterations"] = [max(int(r.get("node_iterations", 0)) for r in records if r["iteration"] == k)
                                  for k in range(done)]
    return out
