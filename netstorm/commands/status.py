"""``netstorm status``: what a running scheduler knows, for operators.

Members (id, data address, state), the current policy version and the last iteration bound to one,
also before any node has registered. With a job secret the request authenticates as the job's admin
(``--secret-file``, or ``NETSTORM_SECRET_FILE``); a wrong or missing secret fails with the scheduler's
authentication error and a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from netstorm import config as config_module
from netstorm import control
from netstorm.control import format_address, parse_address

NAME = "status"
HELP = "show a running scheduler's members, policy version and last bound iteration (--json for tools)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", required=True, metavar="HOST:PORT", help="the scheduler's control address")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    config_module.add_arguments(parser, (), ("connect_timeout", "secret_file", "wan_tls", "log_format"))


def summary(status: control.Status) -> dict[str, Any]:
    """The status as plain data: what ``--json`` prints and the table shows."""
    states = {node_id: (state, why) for node_id, state, why in status.states}
    members = []
    for node_id in status.expected:
        address = status.addresses.get(node_id)
        state, why = states.get(node_id, ("alive" if node_id in status.alive else
                                          "registered" if node_id in status.registered else "expected", ""))
        members.append({"id": node_id, "address": format_address(address) if address else None,
                        "state": state, "detail": why})
    last = status.bindings[-1] if status.bindings else None
    return {"members": members, "complete": status.complete, "policy_version": status.version,
            "last_bound_iteration": last[0] if last else None, "last_bound_version": last[1] if last else None,
            "edge": {str(node_id): {"mode": mode, "fallback": why} for node_id, (mode, why) in status.edge.items()},
            "links": [{"src": src, "dst": dst, "believed_mbit": believed,
                       "measured_mbit": measured if measured >= 0 else None, "age_s": age if age >= 0 else None}
                      for src, dst, believed, measured, age in status.links],
            "iterations": [{"iteration": it, "version": version if version >= 0 else None, "seconds": seconds,
                            "limit_s": limit if limit >= 0 else None}
                           for it, version, seconds, limit in status.iterations],
            "lan": [{"dc": dc, "mode": mode or None, "plan_version": version if version >= 0 else None,
                     "planner": planner or None, "predicted_gbit": gbit if version >= 0 else None}
                    for dc, mode, version, planner, gbit in status.lan],
            "first_probe": {"seconds": status.probe_s,
                            "links": [{"src": src, "dst": dst, "mbit": mbit if mbit >= 0 else None, "why": why}
                                      for src, dst, mbit, why in status.probed]} if status.probed else None}


RECENT_SHOWN = 8
"""Iterations the table shows (``--json`` has all the scheduler sent)."""


def render(data: dict[str, Any]) -> str:
    lines = [f"{'id':>4}  {'address':<24} {'state':<11} detail"]
    for member in data["members"]:
        lines.append(f"{member['id']:>4}  {member['address'] or '-':<24} {member['state']:<11} {member['detail']}")
    version = data["policy_version"]
    lines.append(f"membership {'complete' if data['complete'] else 'incomplete'}; policy version "
                 f"{version if version >= 0 else 'none yet'}; last bound iteration "
                 f"{data['last_bound_iteration'] if data['last_bound_iteration'] is not None else 'none yet'}"
                 + (f" (version {data['last_bound_version']})" if data['last_bound_version'] is not None else ""))
    for node_id, edge in sorted(data["edge"].items()):
        lines.append(f"node {node_id} aggregates its LAN in {edge['mode']}"
                     + (f" (XDP unavailable: {edge['fallback']})" if edge["fallback"] else ""))
    if data["links"]:
        lines.append(f"{'link':>9}  {'believed Mbit/s':>15}  {'measured Mbit/s':>15}  {'age s':>7}")
        for link in data["links"]:
            measured = f"{link['measured_mbit']:.1f}" if link["measured_mbit"] is not None else "-"
            age = f"{link['age_s']:.1f}" if link["age_s"] is not None else "-"
            lines.append(f"{link['src']:>4}->{link['dst']:<4} {link['believed_mbit']:>15.1f}  {measured:>15}  {age:>7}")
    if data["iterations"]:
        lines.append(f"{'iteration':>9}  {'version':>7}  {'seconds':>8}  {'limit s':>8}  {'x limit':>7}")
        for row in data["iterations"][-RECENT_SHOWN:]:
            limit = row["limit_s"]
            version = row["version"] if row["version"] is not None else "-"
            shown, ratio = (f"{limit:.3f}", f"{row['seconds'] / limit:.2f}") if limit else ("-", "-")
            lines.append(f"{row['iteration']:>9}  {version:>7}  {row['seconds']:>8.3f}  {shown:>8}  {ratio:>7}")
    if data["first_probe"]:
        probed = data["first_probe"]["links"]
        lines.append(f"first probe: {sum(link['mbit'] is not None for link in probed)} of {len(probed)} link(s) "
                     f"with no rate measured in {data['first_probe']['seconds']:.1f} s")
        for link in probed:
            if link["mbit"] is None:
                lines.append(f"  {link['src']}->{link['dst']} starts from the prior: {link['why']}")
    for lan in data["lan"]:
        plan = (f"plan {lan['plan_version']} ({lan['planner']}, predicted {lan['predicted_gbit']:.2f} Gbit/s)"
                if lan["plan_version"] is not None else "no plan yet")
        lines.append(f"DC {lan['dc']} LAN tier: {lan['mode'] or 'not serving yet'}; {plan}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from netstorm.authconn import Credentials
    from scheduler import admin

    config = config_module.from_args(args)
    address = parse_address(args.scheduler, "--scheduler")
    credentials = Credentials.from_config(config)
    status = asyncio.run(admin.status(address, timeout=config.connect_timeout, credentials=credentials))
    data = summary(status)
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0
