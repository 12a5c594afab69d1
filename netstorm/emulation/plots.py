"""PNG plots of a result document: iteration time per system, link rates over time, trees on the overlay.

Everything is drawn from the result JSON alone, so ``netstorm report RESULT.json`` redraws them.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_all(result: dict[str, Any], directory: Path, stem: str | None = None) -> list[Path]:
    """Every plot of ``result`` as ``DIRECTORY/STEM-<kind>.png``; the stem is the result file's name (so
    several runs of one scenario can share a directory), else the scenario's."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = stem or str(result["scenario"])
    out = [iteration_times(result, directory / f"{stem}-iterations.png"),
           link_rates(result, directory / f"{stem}-rates.png")]
    if any(s.get("trees") for s in result["systems"].values()):
        out.append(trees(result, directory / f"{stem}-trees.png"))
    if any(s.get("accuracy") for s in result["systems"].values()):
        out.append(time_to_accuracy(result, directory / f"{stem}-accuracy.png"))
    return out


def iteration_times(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, s in result["systems"].items():
        xs = list(range(1, len(s["iteration_s"]) + 1))
        ax.plot(xs, s["iteration_s"], marker="o", label=name)
    first_name, first = next(iter(result["systems"].items()), ("", None))
    if first and first.get("limit_s"):
        xs = list(range(1, len(first["limit_s"]) + 1))
        label = f"limit M/λ (at {first_name}'s iterations)" if result.get("dynamic") else "limit M/λ"
        ax.step(xs, first["limit_s"], where="mid", color="black", linestyle="--", label=label)
    else:
        ax.axhline(result["limit_s"], color="black", linestyle="--", label="limit M/λ")
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds per iteration (log scale)")
    ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"{result['scenario']}: rates x{result['bw_scale']}, {result['model']['bytes'] / 1e6:.1f} MB model")
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def link_rates(result: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 5))
    log = next((s["link_rate_log"] for s in result["systems"].values() if s.get("link_rate_log")), None)
    if not log:
        log = [{"t": 0.0, "rates_mbit": result["initial_rates_mbit"]}]
    end = max([1.0, *(s.get("wall_s", 0.0) for s in result["systems"].values())])
    for key in log[0]["rates_mbit"]:
        ts = [e["t"] for e in log if e["t"] <= end] + [end]
        rs = [e["rates_mbit"][key] for e in log if e["t"] <= end]
        rs.append(rs[-1])
        ax.step(ts, rs, where="post", label=key, linewidth=1)
    ax.set_xlabel("seconds since the system started")
    ax.set_ylabel("shaped rate (Mbit/s)")
    ax.set_title(f"{result['scenario']}: link rates (each direction), as applied with tc")
    ax.legend(fontsize="x-small", ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _positions(nodes: list[int]) -> dict[int, tuple[float, float]]:
    n = len(nodes)
    return {node: (math.cos(2 * math.pi * i / n + math.pi / 2), math.sin(2 * math.pi * i / n + math.pi / 2))
            for i, node in enumerate(nodes)}


MAX_TREES_SHOWN = 5


def trees(result: dict[str, Any], path: Path) -> Path:
    """One row per system, one panel per tree (the first few roots): overlay in grey, tree edges as arrows.

    Systems planning identical trees (netstorm, std and lite start from the same plan) share a row.
    """
    plt = _pyplot()
    rows_by_trees: dict[str, tuple[list[str], dict[str, dict[str, int | None]]]] = {}
    for name, s in result["systems"].items():
        if s.get("trees"):
            key = repr(sorted(s["trees"].items()))
            rows_by_trees.setdefault(key, ([], s["trees"]))[0].append(name)
    rows = list(rows_by_trees.values())
    cols = min(MAX_TREES_SHOWN, max(len(t) for _, t in rows))
    fig, axes = plt.subplots(len(rows), cols, figsize=(3.2 * cols, 3.4 * len(rows)), squeeze=False)
    pos = _positions(result["nodes"])
    for ax in axes.flat:
        ax.axis("off")
    for r, (names, system_trees) in enumerate(rows):
        ordered = list(system_trees.items())
        for c, (root, parents) in enumerate(ordered[:cols]):
            ax = axes[r][c]
            for a, b in result["links"]:
                ax.plot([pos[a][0], pos[b][0]], [pos[a][1], pos[b][1]], color="0.85", linewidth=4, zorder=1)
            for child, parent in parents.items():
                if parent is None:
                    continue
                (x0, y0), (x1, y1) = pos[int(child)], pos[int(parent)]
                ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=2,
                            arrowprops={"arrowstyle": "-|>", "color": "tab:blue", "lw": 1.4,
                                        "shrinkA": 9, "shrinkB": 9})
            for node, (x, y) in pos.items():
                is_root = str(node) == str(root)
                ax.scatter([x], [y], s=230, color="gold" if is_root else "white", edgecolors="black", zorder=4)
                ax.text(x, y, str(node), ha="center", va="center", fontsize=8, zorder=5)
            title = f"{'/'.join(names)}: root {root}"
            if c == cols - 1 and len(ordered) > cols:
                title += f" (+{len(ordered) - cols} more)"
            ax.set_title(title, fontsize=8)
            ax.set_xlim(-1.25, 1.25)
            ax.set_ylim(-1.25, 1.25)
            ax.set_aspect("equal")
    fig.suptitle(f"{result['scenario']}: trees planned at the initial rates (child -> parent; grey: overlay links)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure_chart(chart: Any, path: Path) -> Path | None:
    """Draw a ``figures.Chart`` (bar, line, grid heat map, or panels of lines) as a PNG; None when it has
    no data yet."""
    if not chart_has_data(chart):
        return None
    panels = chart.panels if chart.kind == "panels" else [chart]
    plt = _pyplot()
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.0 * rows), squeeze=False)
    for ax, panel in zip([a for row in axes for a in row], panels, strict=False):
        _draw_panel(ax, panel)
    for ax in [a for row in axes for a in row][len(panels):]:
        ax.axis("off")
    fig.suptitle(chart.title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def chart_has_data(chart: Any) -> bool:
    """Whether ``figure_chart`` would draw ``chart`` (some panel has a value)."""
    panels = chart.panels if chart.kind == "panels" else [chart]
    return any(_has_data(p) for p in panels)


def _has_data(panel: Any) -> bool:
    if panel.kind == "grid":
        return any(v is not None for row in panel.cells for v in row)
    return any(v is not None for values in panel.series.values() for v in values)


def _draw_panel(ax: Any, panel: Any) -> None:
    if panel.kind == "grid":
        data = [[math.nan if v is None else 100 * v for v in row] for row in panel.cells]
        image = ax.imshow(data, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(panel.x)), panel.x)
        ax.set_yticks(range(len(panel.rows)), panel.rows)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel("PRIMARY_BUSY_BOUND")
        for i, row in enumerate(data):
            for j, v in enumerate(row):
                if v == v:
                    ax.text(j, i, f"{v:+.0f} %", ha="center", va="center", color="white")
        ax.figure.colorbar(image, ax=ax, label=f"{panel.ylabel} (%)")
        return
    if panel.kind == "bar":
        n = max(1, len(panel.series))
        width = 0.8 / n
        for i, (name, values) in enumerate(panel.series.items()):
            xs = [k + (i - (n - 1) / 2) * width for k in range(len(panel.x))]
            ax.bar(xs, [math.nan if v is None else v for v in values], width, label=name)
        ax.set_xticks(range(len(panel.x)), panel.x, rotation=20)
    else:
        for name, values in panel.series.items():
            ax.plot(range(len(panel.x)), [math.nan if v is None else v for v in values], marker="o", label=name)
        ax.set_xticks(range(len(panel.x)), panel.x)
    ax.set_title(panel.title if panel.kind != "bar" else "")
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    if panel.series:
        ax.legend(fontsize=8)
def time_to_accuracy(result: dict[str, Any], path: Path) -> Path:
    """Held-out accuracy against training time (the iterations' seconds) per system, with the target."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    target = None
    for name, s in result["systems"].items():
        if not s.get("accuracy"):
            continue
        target = s.get("target_accuracy", target)
        elapsed = list(itertools.accumulate(s["iteration_s"]))
        points = [(t, a) for t, a in zip(elapsed, s["accuracy"], strict=False) if a is not None]
        reached = s.get("time_to_accuracy_s")
        label = f"{name} ({reached:.0f} s to target)" if reached is not None else f"{name} (target not reached)"
        ax.plot([t for t, _ in points], [a for _, a in points], marker=".", label=label)
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", label=f"target {target:.2f}")
    ax.set_xlabel("training time, s (sum of iteration times)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"{result['scenario']}: {result['model']['spec']}, rates x{result['bw_scale']}")
    ax.legend(fontsize="small", loc="lower right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
