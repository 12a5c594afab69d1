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
    config_module.add_arguments(parser)


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
            "edge": {str(node_id): {"mode": mode, "fallback": why} for node_id, (mode, why) in status.edge.items()}}


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
