"""The systems ``netstorm emulate --system`` can run, and what each one means.

netstorm/pro: multi-root FAPT, awareness and auxiliary paths on (the paper's full system, "Pro").
std: awareness on, auxiliary paths off. lite: MR-FAPT planned once, awareness and auxiliary paths off.
star/bkt/mst: the paper's baselines as policies of the same runtime (static: planned once); star runs
at the hub whose physical bound is smallest, star-mxnet at the best-connected hub an MXNet user would pick.
fapt: single-root FAPT with awareness and auxiliary paths, to isolate what multiple roots buy.
gloo: torch.distributed all_reduce (gloo backend), the tool a user would reach for today.
"""

from __future__ import annotations

import dataclasses

from netstorm.emulation.errors import EmulationError


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    kind: str
    """``netstorm`` (scheduler + nodes + synthetic trainers) or ``gloo``."""
    topology: str = "fapt"
    awareness: bool = True
    aux: bool = True

    def scheduler_flags(self) -> list[str]:
        return ["--topology", self.topology,
                "--enable-awareness", str(self.awareness).lower(),
                "--enable-aux-path", str(self.aux).lower()]


SYSTEMS: dict[str, System] = {
    "netstorm": System("netstorm", "netstorm", "fapt", True, True),
    "pro": System("pro", "netstorm", "fapt", True, True),
    "std": System("std", "netstorm", "fapt", True, False),
    "lite": System("lite", "netstorm", "fapt", False, False),
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
