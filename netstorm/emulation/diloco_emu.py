"""``netstorm emulate --trainer diloco``: DiLoCo, Streaming DiLoCo and their per-step DDP references on
one emulated WAN, each system from the scenario's initial rates with the dynamics clock reset.

A system's runtime (``diloco_systems``) starts in the namespaces as the synthetic trainer's does, one
trainer process per DC in that DC's namespace; the trainers write ``diloco_run``'s JSON lines, which
``diloco_fold`` turns into the system's entry. The dynamics and a ``--chaos`` schedule start when every
DC's trainer has joined the job (its ``start`` line: connections are up and the initial state agreed).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path
from typing import Any

from netstorm.emulation import diloco_fold, results, systems
from netstorm.emulation.diloco_systems import (
    LIGHTHOUSE_PORT,
    DilocoSystem,
    Where,
    lighthouse_argv,
    trainer_argv,
)
from netstorm.emulation.dynamics import DynamicsPlayer, schedule
from netstorm.emulation.network import EmulatedNetwork
from netstorm.emulation.runner import (
    GLOO_STORE_PORT,
    Options,
    SystemRun,
    _on_rates,
    _warn_cpu,
    options_from_args,
    run_directory,
    with_seed,
)
from netstorm.progress import Progress
from netstorm.scenario import load


class DilocoSystemRun(SystemRun):
    """One DiLoCo system on the network: its runtime, one trainer per DC, the fold of their lines."""

    def __init__(self, net: EmulatedNetwork, scenario: Any, system: DilocoSystem, opts: Options, workdir: Path,
                 model_bytes: int) -> None:
        kind = "netstorm" if system.runtime == "netstorm" else system.runtime
        super().__init__(net, scenario, systems.System(system.name, kind), opts, workdir, model_bytes,
                         lambda rates: 0.0)
        self.dsystem = system
        self.rate_log: list[dict[str, Any]] = []
        self.origin = 0.0
        self._anchored = False
        self._shown = 0

    def _start(self, deadline: float) -> None:
        self.dsystem.check()
        if self.dsystem.runtime == "netstorm":
            self._start_netstorm(deadline)  # its trainers: _start_trainers
        else:
            self._start_trainers()

    def _start_trainers(self) -> None:
        net, ids = self.net, self.net.plan.node_ids
        first = ids[0]
        rendezvous = ""
        if self.dsystem.runtime == "torchft":
            self._spawn("lighthouse", first, lighthouse_argv(len(ids), net.node_address(first)))
            rendezvous = f"http://{net.node_address(first)}:{LIGHTHOUSE_PORT}"
        elif self.dsystem.runtime == "gloo":
            rendezvous = f"{net.plan.mgmt_address(first)}:{GLOO_STORE_PORT}"
        for rank, dc in enumerate(ids):
            where = Where(socket=str(self.dir / f"node-{dc}.sock") if self.dsystem.runtime == "netstorm" else "",
                          rendezvous=rendezvous, address=net.node_address(dc))
            argv = trainer_argv(self.dsystem, self.opts, dc=dc, rank=rank, world=len(ids),
                                out=self.logs[str(dc)].path, where=where)
            self._spawn(f"trainer-{dc}", dc, self._python(*argv), trainer=True)

    def _wan(self, link_bytes: int) -> dict[str, Any]:
        return {}  # diloco_fold counts the WAN bytes of every runtime alike (the links' counters)

    def _note_progress(self, elapsed: float, progress: Progress, cpu_pct: float) -> None:
        records = {dc: self.logs[dc].records for dc in self.logs}
        if not self._anchored and all(any(r.get("kind") == "start" for r in rs) for rs in records.values()):
            self._anchored = True
            if self.on_first_iteration is not None:
                self.on_first_iteration()
        done = min((max((int(r["step"]) for r in rs if r.get("kind") == "eval"), default=0)
                    for rs in records.values()), default=0)
        if done > self._shown:
            self._shown = done
            progress.advance(self.system.name, done)
            syncs = len(diloco_fold.syncs({int(dc): rs for dc, rs in records.items()}))
            progress.line(f"[{self.system.name}] step {done}/{self.opts.diloco.steps}: {syncs} syncs, "
                          f"epoch {self.epoch}, cpu {cpu_pct:.0f}%")

    def _collect(self, wall_s: float) -> dict[str, Any]:
        per_dc = {int(dc): tl.records for dc, tl in self.logs.items()}
        if not any(r.get("kind") == "start" for rs in per_dc.values() for r in rs):
            return {"kind": self.system.kind, "identical": False, "eval": [], "sync_s": [], "sync_limit_s": [],
                    "wall_s": round(wall_s, 2)}
        d = self.opts.diloco
        schedule = self.dsystem.schedule(d.fragments, d.fragment_delay, d.outer_compression)
        out = diloco_fold.system_entry(per_dc, self.rate_log, self.origin, steps=d.steps, link_bytes=self.link_bytes,
                                       fragments=schedule["fragments"] or 1)
        out["kind"] = self.system.kind
        out["runtime"] = self.dsystem.runtime
        out["trainer"] = self.dsystem.trainer
        out["schedule"] = schedule
        out["run_wall_s"] = round(wall_s, 2)
        if self.chaos is not None:
            faults = list(self.chaos.log)
            restarts = [(int(f["target"][0]), float(f["t"])) for f in faults if f["action"] == "restart-dc"]
            out["chaos"] = {"spec": ",".join(str(f) for f in self.opts.chaos), "faults": faults}
            out["rejoined"] = diloco_fold.rejoined(per_dc, restarts)
            counted: dict[int, int] = {}
            for dc, _ in restarts:
                counted[dc] = counted.get(dc, 0) + 1
            out["restarts"] = diloco_fold.job_restarts(per_dc, counted)
        return out


def budget_s(opts: Options, system: DilocoSystem, limit_s: float) -> float:
    """Seconds a system may take: start-up, the padded steps with slack for a busy host, and forty times
    the min-cut limit of every sync it runs."""
    d = opts.diloco
    syncs = d.steps if system.trainer == "ddp" else d.steps // d.sync_every + 1
    return opts.timeout_s or 300.0 + d.steps * (opts.compute_s + 2.0) + syncs * 40.0 * limit_s


def run(opts: Options) -> dict[str, Any]:
    """Build the network, run every DiLoCo system, return the result document."""
    scenario = with_seed(load(opts.scenario), opts.seed)
    parameters = opts.parameters()
    bounds = results.Bounds(4 * parameters, opts.bw_scale)
    progress = Progress(opts.stream)
    result = results.new_result(scenario, opts, parameters, bounds)
    result["trainer"] = "diloco"
    result["train"] = opts.train
    result["diloco"] = opts.diloco.record()
    result["compute_s_note"] = "each inner step (and each DDP step) takes at least compute_s of wall time: the " \
                               "real step, padded"
    with contextlib.ExitStack() as stack:
        stack.callback(progress.close)
        tmp = run_directory(stack, opts.run_dir)
        net = stack.enter_context(EmulatedNetwork(scenario, bw_scale=opts.bw_scale, loss=opts.loss))
        result["run_id"] = net.run_id
        result["features"] = {"applied": list(net.features.applied), "not_applied": dict(net.features.not_applied)}
        for line in net.features.lines():
            progress.line(line)
        for system in opts.diloco.systems:
            net.set_rates(scenario.rates())
            runner = DilocoSystemRun(net, scenario, system, opts, Path(tmp), 4 * parameters)

            def on_change(entry: dict[str, Any], runner: DilocoSystemRun = runner) -> None:
                _on_rates(entry, runner, progress)

            player = DynamicsPlayer(net, schedule(scenario, time_scale=opts.time_scale), on_change=on_change)
            progress.line(f"[{system.name}] starting ({system.runtime}, {system.trainer})")
            progress.bar(system.name, f"{system.name} steps", opts.diloco.steps)

            def joined(runner: DilocoSystemRun = runner, player: DynamicsPlayer = player) -> None:
                player.anchor()
                if runner.chaos is not None:
                    runner.chaos.anchor()

            runner.on_first_iteration = joined
            player.start(scenario.rates(), anchored=True)
            runner.rate_log = player.log
            runner.origin = player.wall_start
            try:
                outcome = runner.run(budget_s(opts, system, bounds.limit_s(scenario.rates())), progress)
            finally:
                player.stop()
            outcome["link_rate_log"] = player.log
            outcome["dynamics_origin_s"] = player.origin_s
            result["systems"][system.name] = outcome
            _warn_cpu(outcome, progress, system.name)
    return diloco_fold.with_targets(result)


def run_from_args(args: argparse.Namespace) -> int:
    """``netstorm emulate --trainer diloco ...``: run, write ``--out``, print the summary; 1 if a system failed."""
    result = run(options_from_args(args))
    result.setdefault("command", "netstorm " + shlex.join(sys.argv[1:]))
    if args.out:
        from netstorm.provenance import write_result

        result = write_result(args.out, result)
        print(f"result written to {args.out}", file=sys.stderr)
    print(diloco_fold.summary(result))
    return 1 if any(s.get("error") for s in result["systems"].values()) else 0
