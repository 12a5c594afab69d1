"""Print the markdown table of torch-ddp emulation results (results/README.md's DDP section) from their JSON.

    python scripts/torch_results.py results/internet2-9-torch-ddp.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: Path) -> list[str]:
    result = json.loads(path.read_text())
    label = "dynamic" if result.get("dynamic") else "static"
    out = []
    for name, system in result["systems"].items():
        steady = system["iteration_s"][1:] or system["iteration_s"]
        cost = system.get("integration_cost")
        reached = system.get("time_to_accuracy_s")
        to_target = f"{reached:.1f} ({system['iterations_to_accuracy']})" if reached is not None else "not reached"
        out.append(f"| {label} | {name} | {sum(steady) / len(steady):.2f} | {to_target} | "
                   f"{system['accuracy'][-1]:.3f} | {system['loss'][-1]:.4f} | "
                   f"{'-' if cost is None else f'{100 * cost:.1f} %'} | "
                   f"{system['cpu']['mean_pct']:.0f} / {system['cpu']['run_pct']:.0f} |")
    return out


def main(argv: list[str]) -> int:
    target = json.loads(Path(argv[0]).read_text())["systems"]
    accuracy = next(iter(target.values())).get("target_accuracy")
    print(f"| run | system | step s (2..N) | s to {accuracy:.2f} accuracy (steps) | final accuracy | final loss | "
          "integration cost | host / own CPU % |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in argv:
        print("\n".join(rows(Path(name))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
