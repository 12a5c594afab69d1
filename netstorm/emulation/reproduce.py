"""``netstorm reproduce``'s engine: run the paper's evaluation (``figures.runs``), resumable, with a
progress view, and write the report.

Each run is one ``netstorm emulate`` process (its own network, torn down when it ends) writing
``<out>/<run>.json``; a run whose JSON is already there is skipped, so an interrupted evaluation goes
on where it stopped. The progress view is plain lines (one per system start and per iteration): the
figure, the run, the system and the time left, estimated from the policy engine's predicted
synchronization time per system (``netstorm.planning.predict``) times a factor learnt from the runs
finished so far, plus a start-up cost per system.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from netstorm.emulation import results, systems
from netstorm.emulation.figures import Profile, Run
from netstorm.progress import Progress
from netstorm.provenance import write_result

Launcher = Callable[[Run, Path, Path, Callable[[str], None]], int]
"""(run, result path, log path, line callback) -> exit code: starts ``netstorm emulate`` for the run,
feeds each line of its progress output to the callback, returns when it has ended."""

START_UP_S = 12.0
"""A system's start-up and tear-down (processes, connections, the first iteration's set-up) before the
first run has measured it."""
FIRST_FACTOR = 1.5
"""Measured over predicted iteration time before the first run has measured it."""
_STARTING = re.compile(r"\[(?P<system>[\w.-]+)\] starting")
_ITERATION = re.compile(r"\[(?P<system>[\w.-]+)\] iteration (?P<k>[0-9]+)/(?P<n>[0-9]+)")


def available(run: Run) -> tuple[Run, list[str]]:
    """``run`` with only the systems this build knows, and the names it dropped."""
    known = [s for s in run.systems if s in systems.SYSTEMS]
    return run.with_systems(known), [s for s in run.systems if s not in systems.SYSTEMS]


def _flag(run: Run, name: str) -> str | None:
    flags = list(run.flags)
    return flags[flags.index(name) + 1] if name in flags[:-1] else None


class Estimator:
    """Predicted seconds per iteration of each system in each run, and the time left."""

    def __init__(self) -> None:
        self.measured_s = 0.0
        self.predicted_s = 0.0
        self.overheads: list[float] = []

    @property
    def factor(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else FIRST_FACTOR

    @property
    def start_up_s(self) -> float:
        return sum(self.overheads) / len(self.overheads) if self.overheads else START_UP_S

    def predicted_iteration_s(self, run: Run, system: str) -> float:
        """The policy engine's synchronization time for ``system``'s first policy in ``run``."""
        spec = systems.SYSTEMS.get(system)
        topology = spec.topology if spec is not None and spec.kind == "netstorm" else "fapt"
        packing = getattr(spec, "design", "netstorm") != "paper"
        roots = int(_flag(run, "--num-root-servers") or 0)
        return _predicted_s(run.scenario, run.bw_scale, run.model, topology, roots, packing)

    def system_s(self, run: Run, system: str, iterations_left: int | None = None) -> float:
        n = run.iterations if iterations_left is None else iterations_left
        start = self.start_up_s if iterations_left is None else 0.0
        return start + n * self.predicted_iteration_s(run, system) * self.factor

    def run_s(self, run: Run) -> float:
        return sum(self.system_s(run, s) for s in run.systems)

    def learn(self, run: Run, result: dict[str, Any]) -> None:
        """Fold a finished run's measured times into the factor and the start-up cost."""
        for name, s in result.get("systems", {}).items():
            times = [float(t) for t in s.get("iteration_s", [])]
            if not times or name not in run.systems:
                continue
            self.measured_s += sum(times)
            self.predicted_s += len(times) * self.predicted_iteration_s(run, name)
            if "wall_s" in s:
                self.overheads.append(max(0.0, float(s["wall_s"]) - sum(times)))


@functools.lru_cache(maxsize=256)
def _predicted_s(scenario: str, bw_scale: float, model: str, topology: str, roots: int, packing: bool) -> float:
    from netstorm.emulation.gloo_trainer import model_parameters
    from netstorm.planning.plan import plan
    from netstorm.planning.predict import predict
    from netstorm.scenario import load

    rates = {k: v * bw_scale for k, v in load(scenario).rates().items()}
    model_bytes = 4 * model_parameters(model)
    policy = plan(rates, topology=topology, num_roots=roots, aux=False, packing=packing)
    return predict(policy, rates, model_bytes, chunk_bytes=model_bytes / 60).total_s


def _clock_text(seconds: float) -> str:
    whole = max(0, round(seconds))
    h, rest = divmod(whole, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


@dataclasses.dataclass
class State:
    """Where the evaluation is, for the progress view."""

    index: int = 0
    total: int = 0
    run: Run | None = None
    system: str = ""
    iteration: int = 0


class ProgressView:
    """Plain progress lines: figure, run, system, iteration, elapsed and estimated time left."""

    def __init__(self, stream: IO[str], estimator: Estimator, pending: list[Run],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.estimator = estimator
        self.pending = pending
        self.clock = clock
        self.t0 = clock()
        self.state = State(total=len(pending))
        self.live = Progress(stream)
        """Bars for the runs and the running system's iterations on a terminal; plain lines elsewhere."""
        self.live.bar("runs", "runs", len(pending))

    def left_s(self) -> float:
        st = self.state
        later = sum(self.estimator.run_s(r) for r in self.pending)
        if st.run is None:
            return later
        names = list(st.run.systems)
        if st.system in names:
            i = names.index(st.system)
            current = self.estimator.system_s(st.run, st.system, max(0, st.run.iterations - st.iteration))
            rest = sum(self.estimator.system_s(st.run, s) for s in names[i + 1:])
        else:
            current, rest = 0.0, self.estimator.run_s(st.run)
        return later + current + rest

    def line(self, text: str) -> None:
        elapsed = self.clock() - self.t0
        self.live.line(f"[{_clock_text(elapsed)} elapsed, about {_clock_text(self.left_s())} left] {text}", stamp=False)
        st = self.state
        self.live.advance("runs", max(0, st.index - (st.run is not None)), f"runs (Fig. {', '.join(st.run.figures)})"
                          if st.run is not None else "runs")
        if st.run is not None and st.system:
            self.live.advance("iterations", st.iteration, f"{st.system} iterations")

    def where(self) -> str:
        st = self.state
        assert st.run is not None
        figures = st.run.figures
        label = f"Fig. {figures[0]}" + (f" (also {', '.join(figures[1:])})" if len(figures) > 1 else "")
        names = list(st.run.systems)
        system = (f" · {st.system} ({names.index(st.system) + 1}/{len(names)})" if st.system in names else "")
        iteration = f" · iteration {st.iteration}/{st.run.iterations}" if st.iteration else ""
        return f"{label} · run {st.run.name} ({st.index}/{st.total}){system}{iteration}"

    def on_output(self, text: str) -> None:
        """A line of the running ``netstorm emulate``: follow its system and iteration."""
        if (m := _STARTING.search(text)) is not None:
            self.state.system, self.state.iteration = m["system"], 0
            if self.state.run is not None:
                self.live.bar("iterations", f"{m['system']} iterations", self.state.run.iterations)
            self.line(self.where())
        elif (m := _ITERATION.search(text)) is not None:
            self.state.system, self.state.iteration = m["system"], int(m["k"])
            self.line(self.where())
        elif "FAILED" in text or "ERROR" in text:
            self.line(f"{self.where()}: {text.strip()}")


def emulate_launcher(run: Run, out: Path, log_path: Path, on_line: Callable[[str], None]) -> int:
    """Run ``python -m netstorm.cli emulate ...`` for ``run``; its output goes to ``log_path``."""
    argv = [sys.executable, "-m", "netstorm.cli", *run.argv(str(out))]
    with log_path.open("w") as log:
        log.write("$ " + run.command(str(out)) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.PIPE, text=True, bufsize=1)
        assert proc.stderr is not None
        try:
            for line in proc.stderr:
                log.write(line)
                log.flush()
                on_line(line)
        finally:
            proc.stderr.close()
            code = proc.wait()
    return code


def load_result(path: Path) -> dict[str, Any] | None:
    """The result document at ``path``, or None when there is none (or not a complete one)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or result.get("format") != results.FORMAT_VERSION or "systems" not in result:
        return None
    return result


BUNDLE = "runs.json"
"""The file one evaluation's run results are folded into for committing (``netstorm reproduce --bundle``):
``{"reproduce": {"profile": ...}, "runs": {name: result}}``; a run's own file, when there, wins."""


def load_run(out_dir: Path, name: str) -> dict[str, Any] | None:
    """Run ``name``'s result in ``out_dir``: its own file, else its entry in the folder's bundle."""
    own = load_result(out_dir / f"{name}.json")
    if own is not None:
        return own
    try:
        bundled = json.loads((out_dir / BUNDLE).read_text()).get("runs", {}).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    ok = isinstance(bundled, dict) and bundled.get("format") == results.FORMAT_VERSION and "systems" in bundled
    return bundled if ok else None


def bundle(out_dir: Path, profile: str) -> Path:
    """Fold every run result file in ``out_dir`` into its bundle (entries already there are kept) and
    remove the files; returns the bundle's path."""
    path = out_dir / BUNDLE
    try:
        runs = json.loads(path.read_text()).get("runs", {})
    except (OSError, ValueError):
        runs = {}
    files = [p for p in sorted(out_dir.glob("*.json")) if p.name != BUNDLE and load_result(p) is not None]
    runs.update({p.stem: load_result(p) for p in files})
    path.write_text(json.dumps({"reproduce": {"profile": profile, "bundle": True}, "runs": dict(sorted(runs.items()))},
                               indent=1) + "\n")
    for p in files:
        p.unlink()
    return path


@dataclasses.dataclass
class Outcome:
    results: dict[str, dict[str, Any]]
    """Result documents by run name."""
    skipped: dict[str, str]
    """Runs not run, and why."""
    dropped: dict[str, list[str]]
    """Systems a run could not include (this build does not know them)."""
    resumed: list[str]
    failed: dict[str, str]


def execute(profile: Profile, all_runs: list[Run], out_dir: Path, *, stream: IO[str] = sys.stderr,
            launcher: Launcher = emulate_launcher, out_label: str | None = None,
            clock: Callable[[], float] = time.monotonic) -> Outcome:
    """Run every run of ``all_runs`` whose result is not in ``out_dir`` yet; return every result there.

    ``out_label`` is how commands name the directory (the ``--out`` the user gave)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / ".partial"
    label = out_label or str(out_dir)
    outcome = Outcome({}, {}, {}, [], {})
    todo: list[Run] = []
    for run in all_runs:
        usable, dropped = available(run)
        if dropped:
            outcome.dropped[run.name] = dropped
        existing = load_run(out_dir, run.name)
        if existing is not None:
            outcome.results[run.name] = existing
            outcome.resumed.append(run.name)
        elif not usable.systems:
            outcome.skipped[run.name] = f"none of its systems ({', '.join(run.systems)}) exists in this build"
        else:
            todo.append(usable)
    estimator = Estimator()
    for name in outcome.resumed:
        run = next(r for r in all_runs if r.name == name)
        estimator.learn(run, outcome.results[name])
    view = ProgressView(stream, estimator, list(todo), clock)
    view.line(f"{profile.name} profile: {len(all_runs)} runs, {len(outcome.resumed)} already in {label}, "
              f"{len(todo)} to run")
    for index, run in enumerate(todo, start=1):
        view.pending.remove(run)
        view.state = State(index, len(todo), run)
        view.line(view.where() + f" · starting: {run.command(f'{label}/{run.name}.json')}")
        partial.mkdir(exist_ok=True)
        (partial / ".gitignore").write_text("*\n")  # logs and unfinished results are not results
        tmp = partial / f"{run.name}.json"
        tmp.unlink(missing_ok=True)
        code = launcher(run, tmp, partial / f"{run.name}.log", view.on_output)
        result = load_result(tmp)
        if result is None:
            outcome.failed[run.name] = f"netstorm emulate exited with {code} and wrote no result (log: " \
                                       f"{label}/.partial/{run.name}.log)"
            view.line(f"run {run.name} FAILED: {outcome.failed[run.name]}")
            continue
        result["command"] = run.command(f"{label}/{run.name}.json")
        result["reproduce"] = {"profile": profile.name, "run": run.name, "figures": list(run.figures)}
        result = write_result(out_dir / f"{run.name}.json", result)
        tmp.unlink()
        outcome.results[run.name] = result
        estimator.learn(run, result)
        failed = [n for n, s in result["systems"].items() if s.get("error")]
        if failed:
            outcome.failed[run.name] = "system(s) failed: " + ", ".join(failed)
        view.state = State(index, len(todo))
        view.line(f"run {run.name} done ({index}/{len(todo)})" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    view.live.close()
    return outcome


def estimate_s(all_runs: list[Run]) -> float:
    """Seconds the whole evaluation is expected to take on this host, before any run has measured it."""
    estimator = Estimator()
    return sum(estimator.run_s(available(r)[0]) for r in all_runs if available(r)[0].systems)


def clock_text(seconds: float) -> str:
    return _clock_text(seconds) if math.isfinite(seconds) else "?"
