"""Klonet's topology JSON for a scenario, so the same experiment can run on the Klonet testbed.

One host per DC (``h<id>``) and one link per overlay link; Klonet configures each end of a link with
its own egress parameters, so ``config.source`` carries the a->b direction and ``config.target`` the
b->a one: ``bw_kbit`` (1000 bit/s), ``delay_us`` (one-way) and ``loss_rate`` (per cent, as Klonet hands
it to netem). Dynamics, which Klonet's topology API does not take, are described under ``dynamics``
for the script that drives the experiment.
"""

from __future__ import annotations

from typing import Any

from netstorm.scenario import Scenario


def _end(rate_mbit: float, latency_ms: float, loss: float) -> dict[str, str]:
    return {
        "bw_kbit": str(round(rate_mbit * 1000)),
        "queue_size_byte": "",
        "delay_us": str(round(latency_ms * 1000)),
        "loss_rate": f"{loss * 100:.5f}",
        "jitter_us": "0",
        "correlation": "0",
        "delay_distribution": "normal",
    }


def to_klonet(scenario: Scenario, *, bw_scale: float = 1.0) -> dict[str, Any]:
    nodes = [{"name": f"h{dc.id}", "label": dc.name, "type": "host", "image_name": "host/ubuntu",
              "subtype": "ubuntu", "x": 120 * (i % 5), "y": 120 * (i // 5)}
             for i, dc in enumerate(scenario.nodes)]
    links = []
    for lk in scenario.links:
        links.append({
            "name": f"l{lk.a}_{lk.b}",
            "source": f"h{lk.a}", "sourceType": "host",
            "target": f"h{lk.b}", "targetType": "host",
            "config": {"flag": True,
                       "source": _end(lk.rate_ab_mbit * bw_scale, lk.latency_ms, lk.loss),
                       "target": _end(lk.rate_ba_mbit * bw_scale, lk.latency_ms, lk.loss)},
        })
    out: dict[str, Any] = {"topo": scenario.name, "description": scenario.description.strip(),
                           "nodes": nodes, "links": links}
    if scenario.dynamics is not None:
        dyn = scenario.dynamics
        out["dynamics"] = {
            "period_s": dyn.period_s,
            "bw_kbit_range": [round(dyn.rate_min_mbit * 1000 * bw_scale), round(dyn.rate_max_mbit * 1000 * bw_scale)],
            "seed": dyn.seed,
            "draw": "epoch j >= 1: random.Random(seed * 1000003 + j), links in order, randint a->b then b->a",
        }
    return out
