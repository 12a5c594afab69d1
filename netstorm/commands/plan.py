"""``netstorm plan``: the policy for a scenario or measured rates, and every topology's predicted time."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

from netstorm import config as config_mod
from netstorm import scenario as scenario_mod
from netstorm.allot import allot_chunks
from netstorm.dcplanners import PLANNERS
from netstorm.errors import PolicyError
from netstorm.layout import Layout, TensorSpec
from netstorm.models import FLOAT32_BYTES, ModelLayout, layout
from netstorm.planning.limit import MinCut, min_cut
from netstorm.planning.plan import plan
from netstorm.planning.predict import Prediction, predict
from netstorm.policy import TOPOLOGIES, Policy
from netstorm.scenario import Rates

NAME = "plan"
HELP = "plan trees, chunk shares and auxiliary paths; predict every topology's synchronization time"

PAPER_FAPT = "fapt-paper"
"""Row of the predicted-times table: multi-root FAPT as the paper plans it (tree_packing off)."""
_LINK_KEY = re.compile(r"\s*(-?[0-9]+)\s*->\s*(-?[0-9]+)\s*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", nargs="?", help="scenario name (e.g. internet2-9) or TOML file")
    parser.add_argument("--rates", metavar="FILE",
                        help='measured rates instead of a scenario: JSON {"<a>-><b>": Mbit/s} for every directed link')
    parser.add_argument("--topology", choices=TOPOLOGIES, default="fapt", help="policy to print (default fapt)")
    parser.add_argument("--roots", type=int, metavar="N", default=None,
                        help="FAPT roots, 0 = every node (default: NUM_ROOT_SERVERS)")
    parser.add_argument("--model", default="alexnet", metavar="MODEL",
                        help="alexnet, resnet50 or a float32 parameter count such as 1e6 (default alexnet)")
    parser.add_argument("--bw-scale", type=float, default=1.0, metavar="X", help="multiply every rate by X")
    parser.add_argument("--bkt-k", type=int, default=2, metavar="K", help="fan-out of the BKT baseline (default 2)")
    parser.add_argument("--hub", type=int, default=None, metavar="ID",
                        help="root of STAR and BKT (default: the best-connected node)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dc", type=int, metavar="N", default=None,
                        help="plan the tier inside DC N instead (its LAN as the scenario describes it), with "
                             f"the planner --dc-planner names ({'|'.join(PLANNERS)})")
    parser.add_argument("--workers-only", action="store_true",
                        help="with --dc: aggregate at workers only, as the data plane runs it (racks' ToR "
                             "aggregators unused; their uplinks still count)")
    config_mod.add_arguments(parser, ("Paper, Table II", "DC planning"),
                             ("enable_aux_path", "tree_packing", "planned_offload", "log_format"))


def load_rates_file(path: str) -> Rates:
    """``{"<a>-><b>": Mbit/s}`` from a JSON file, with errors naming the file and the key."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PolicyError(f"{path}: rates file not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PolicyError(f"{path}: cannot read rates: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise PolicyError(f'{path}: expected a non-empty JSON object {{"<a>-><b>": Mbit/s}}')
    rates: Rates = {}
    for key, value in data.items():
        match = _LINK_KEY.fullmatch(key)
        if match is None:
            raise PolicyError(f"{path}: key {key!r} is not '<a>-><b>'")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise PolicyError(f"{path}: {key}: rate must be a positive number of Mbit/s, got {value!r}")
        pair = (int(match[1]), int(match[2]))
        if pair in rates:
            raise PolicyError(f"{path}: {key}: duplicate link")
        rates[pair] = float(value)
    return rates


def _source(args: argparse.Namespace) -> tuple[str, Rates]:
    if (args.scenario is None) == (args.rates is None):
        raise PolicyError("give a scenario or --rates FILE (exactly one)")
    if args.rates is not None:
        return args.rates, load_rates_file(args.rates)
    scenario = scenario_mod.load(args.scenario)
    return scenario.name, scenario.rates()


def run(args: argparse.Namespace) -> int:
    cfg = config_mod.from_args(args)
    if args.dc is not None:
        return _run_dc(args, cfg)
    if not (math.isfinite(args.bw_scale) and args.bw_scale > 0):
        raise PolicyError(f"--bw-scale must be positive, got {args.bw_scale}")
    name, base_rates = _source(args)
    rates = {pair: rate * args.bw_scale for pair, rate in base_rates.items()}
    num_roots = cfg.num_root_servers if args.roots is None else args.roots
    model = layout(args.model)
    chunks = runtime_chunks(model, cfg.chunk_size)
    chunk_bytes = max(chunks) * FLOAT32_BYTES

    policies: dict[str, Policy] = {}
    for topology in TOPOLOGIES:
        policies[topology] = plan(rates, topology=topology, num_roots=num_roots, bkt_k=args.bkt_k, hub=args.hub,
                                  aux=cfg.enable_aux_path and topology == args.topology, packing=cfg.tree_packing,
                                  offload=cfg.enable_aux_path and cfg.planned_offload and topology == args.topology)
    # The paper's Algorithm 2 beside the packed FAPT, for comparison (predicted times only).
    policies[PAPER_FAPT] = plan(rates, topology="fapt", num_roots=num_roots, aux=False, packing=False)
    predictions = {t: predict(p, rates, model.bytes, chunk_bytes=chunk_bytes) for t, p in policies.items()}
    cut = min_cut(rates)
    limit = model.bytes * 8 / (cut.mbit * 1e6)
    chosen = policies[args.topology]
    owners = allot_chunks(chunks, chosen.chunk_share)
    report = _report(name, args.bw_scale, model, cfg.chunk_size, chosen, chunks, owners, predictions, cut, limit)
    report["tree_packing"] = cfg.tree_packing
    report["fallback"] = chosen.fallback
    if args.json:
        print(json.dumps(report))
    else:
        print(_text(report))
    return 0


def runtime_chunks(model: ModelLayout, chunk_size: int) -> list[int]:
    """The chunk sizes (elements) the nodes cut ``model`` into at ``chunk_size``: the runtime's own layout
    (large tensors in near-equal pieces, consecutive small ones sharing a chunk), so the chunk counts per
    root and the pipeline fill this command predicts are the ones a run has."""
    specs = [TensorSpec(name, tuple(shape), "float32") for name, shape in model.tensors]
    return Layout.build(specs, chunk_size).chunk_sizes()
def _run_dc(args: argparse.Namespace, cfg: config_mod.Config) -> int:
    """``--dc N``: the tier inside one DC, planned by ``--dc-planner`` beside every baseline."""
    from netstorm.planning import dcreport
    from netstorm.planning.dcplan import Options

    if args.scenario is None or args.rates is not None:
        raise PolicyError("--dc plans from a scenario's LAN description: give a scenario, not --rates")
    scenario = scenario_mod.load(args.scenario)
    planner = cfg.dc_planner
    report = dcreport.report(scenario, args.dc, planner, Options.from_config(cfg, tor=not args.workers_only))
    print(json.dumps(report) if args.json else dcreport.text(report))
    return 0


def _report(name: str, scale: float, model: ModelLayout, chunk_size: int, policy: Policy, chunks: list[int],
            owners: list[int], predictions: dict[str, Prediction], cut: MinCut, limit: float) -> dict[str, Any]:
    wire = policy.to_wire()
    per_root = {str(r): {"chunks": 0, "elements": 0} for r in policy.roots}
    for size, root in zip(chunks, owners, strict=True):
        per_root[str(root)]["chunks"] += 1
        per_root[str(root)]["elements"] += size
    return {
        "source": name,
        "bw_scale": scale,
        "model": {"name": model.name, "params": model.params, "bytes": model.bytes},
        "chunk_size": chunk_size,
        "topology": policy.topology,
        "roots": wire["roots"],
        "trees": wire["trees"],
        "chunk_share": wire["chunk_share"],
        "quality": wire["quality"],
        "chunks_per_root": per_root,
        "aux_paths": wire["aux_paths"],
        "offload": wire.get("offload", {}),
        "predicted_sync_s": {t: p.total_s for t, p in predictions.items()},
        "predicted_detail": {t: {"bulk_s": p.bulk_s, "fill_s": p.fill_s, "bottleneck": _pair(p.bottleneck),
                                 "phased_s": p.phased_s}
                             for t, p in predictions.items()},
        "limit_s": limit,
        "ratio_to_limit": {t: p.total_s / limit for t, p in predictions.items()},
        "min_cut_mbit": cut.mbit,
        "min_cut_sink_side": sorted(cut.sink_side),
    }


def _pair(pair: tuple[int, int] | None) -> str | None:
    return None if pair is None else f"{pair[0]}->{pair[1]}"


def _text(r: dict[str, Any]) -> str:
    model = r["model"]
    total_chunks = sum(v["chunks"] for v in r["chunks_per_root"].values())
    lines = [
        f"source {r['source']}, rates x{r['bw_scale']:g}",
        f"model {model['name']}: {model['params']:,} parameters, {model['bytes'] / 1e6:.1f} MB float32, "
        f"{total_chunks} chunks of at most {r['chunk_size']:,} elements",
        f"topology {r['topology']}: {len(r['roots'])} root(s), best first",
    ]
    if r.get("fallback"):
        lines.append(f"  {r['fallback']}")
    for root in r["roots"]:
        key = str(root)
        share = r["chunks_per_root"][key]
        edges = " ".join(f"{n}->{p}" for n, p in r["trees"][key].items() if p is not None)
        quality = r["quality"].get(key)
        q_text = f"  q={quality:.4g}" if quality is not None else ""
        lines.append(f"  root {root}: share {r['chunk_share'][key]:.3f} ({share['chunks']} chunks){q_text}")
        lines.append(f"    tree (child->parent): {edges}")
    if r["aux_paths"]:
        lines.append("paths per directed pair (primary | auxiliary ...):")
        for pair, paths in r["aux_paths"].items():
            lines.append(f"  {pair}: " + " | ".join("-".join(map(str, p)) for p in paths))
    if r["offload"]:
        lines.append("planned offload (tree link: detour fraction of its chunks ...):")
        for pair, moves in r["offload"].items():
            lines.append(f"  {pair}: " + ", ".join(f"{'-'.join(map(str, p))} {f:.2f}" for p, f in moves))
    packing = "LP tree packing" if r["tree_packing"] else "paper's Algorithm 2"
    lines.append(f"predicted synchronization time (pipelined fluid model; fapt: {packing}):")
    for topology, seconds in r["predicted_sync_s"].items():
        detail = r["predicted_detail"][topology]
        lines.append(f"  {topology:<10} {seconds:9.1f} s  {r['ratio_to_limit'][topology]:6.2f} x limit  "
                     f"(bottleneck {detail['bottleneck']}, fill {detail['fill_s']:.1f} s; "
                     f"push then pull: {detail['phased_s']:.1f} s)")
    sink = ",".join(map(str, r["min_cut_sink_side"]))
    lines.append(f"limit M/λ: {r['limit_s']:.1f} s (λ = {r['min_cut_mbit']:g} Mbit/s into {{{sink}}})")
    return "\n".join(lines)
