"""The systems ``netstorm emulate --system`` can run, and what each one means.

See docs/ARCHITECTURE.md, *Emulation and results*."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from netstorm import config
from netstorm.emulation.errors import EmulationError

DESIGNS: dict[str, dict[str, Any]] = {
    "netstorm": {name: config.FIELDS[name].default for name in config.DESIGN_SWITCHES},
    "paper": dict(config.PAPER_DESIGN),
}
"""Each design's value of every switch that separates them (``netstorm.config.DESIGN_SWITCHES``)."""

RECORDED: tuple[str, ...] = ("enable_awareness", "enable_aux_path", *config.DESIGN_SWITCHES, "update_time",
                             "primary_busy_bound", "auxiliary_queue_length", "num_root_servers", "chunk_size",
                             "stale_after", "stale_half_life")
"""Options a result records per system (``in_effect``): the switches and the paper's knobs beside them."""


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    kind: str
    """``netstorm`` (scheduler + nodes + synthetic trainers) or ``gloo``."""
    topology: str = "fapt"
    awareness: bool = True
    aux: bool = True
    design: str = "netstorm"
    """``netstorm`` or ``paper``: which values of ``DESIGN_SWITCHES`` the system runs with."""

    def __post_init__(self) -> None:
        if self.design not in DESIGNS:
            raise EmulationError(f"system {self.name}: unknown design {self.design!r} (known: {', '.join(DESIGNS)})")

    @property
    def switches(self) -> dict[str, Any]:
        """Every switch's value for this system: Table I's two, then its design's."""
        return {"enable_awareness": self.awareness, "enable_aux_path": self.aux, **DESIGNS[self.design]}

    def scheduler_flags(self) -> list[str]:
        """The scheduler's flags for this system (the nodes take the scheduler's options): the topology,
        Table I's switches, and every design switch whose value is not the option's default."""
        flags = ["--topology", self.topology,
                 "--enable-awareness", str(self.awareness).lower(),
                 "--enable-aux-path", str(self.aux).lower()]
        for name, value in DESIGNS[self.design].items():
            if value != config.FIELDS[name].default:
                flags += ["--" + name.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
        return flags


SYSTEMS: dict[str, System] = {
    "netstorm": System("netstorm", "netstorm", "fapt", True, True),
    "pro": System("pro", "netstorm", "fapt", True, True),
    "std": System("std", "netstorm", "fapt", True, False),
    "lite": System("lite", "netstorm", "fapt", False, False),
    "paper": System("paper", "netstorm", "fapt", True, True, design="paper"),
    "paper-std": System("paper-std", "netstorm", "fapt", True, False, design="paper"),
    "paper-lite": System("paper-lite", "netstorm", "fapt", False, False, design="paper"),
    "star": System("star", "netstorm", "star", False, False),
    "star-mxnet": System("star-mxnet", "netstorm", "star-mxnet", False, False),
    "bkt": System("bkt", "netstorm", "bkt", False, False),
    "mst": System("mst", "netstorm", "mst", False, False),
    "fapt": System("fapt", "netstorm", "fapt1", True, True),
    "gloo": System("gloo", "gloo"),
}
ALL = "netstorm,lite,std,star,star-mxnet,bkt,mst,fapt,gloo"


def parse(text: str) -> list[System]:
    """``"netstorm,star"`` -> systems in that order; ``all`` expands; unknown names are an error."""
    names = [n.strip().lower() for n in text.replace("all", ALL).split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise EmulationError(f"unknown system(s) {unknown or text!r}; known: {', '.join(SYSTEMS)}, all")
    out: list[System] = []
    for n in names:
        if SYSTEMS[n] not in out:
            out.append(SYSTEMS[n])
    return out


def in_effect(system: System, config_flags: Sequence[str], environ: Mapping[str, str] | None = None
              ) -> dict[str, Any]:
    """The ``RECORDED`` options a run of ``system`` had: its own flags, then the run's ``config_flags``
    (later flags win, as on the scheduler's command line), over the config file and environment they
    name, as the scheduler resolves them."""
    parser = argparse.ArgumentParser(add_help=False)
    config.add_arguments(parser)
    args = parser.parse_args([*system.scheduler_flags()[2:], *config_flags])
    resolved = config.from_args(args, environ)
    return {name: getattr(resolved, name) for name in RECORDED}
