"""The ``netstorm`` command line: one sub-command per module in ``netstorm/commands``.

Each command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their command runs, so ``netstorm plan`` never pays for torch or bcc.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from netstorm import logjson
from netstorm.errors import NetStormError

# command name -> module under netstorm.commands
COMMANDS: dict[str, str] = {
    "plan": "plan",
    "scheduler": "scheduler",
    "node": "node",
    "local": "local",
    "emulate": "emulate",
    "demo": "demo",
    "report": "report",
    "reproduce": "reproduce",
    "export-klonet": "export_klonet",
    "bench": "bench",
    "secret": "secret",
    "status": "status",
    "lan-aggregator": "lan_aggregator",
}


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"netstorm.commands.{module}")
    except ModuleNotFoundError as exc:
        if exc.name == f"netstorm.commands.{module}":
            return None
        raise


def build_parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    """The parser with every command, or with just ``only`` (child processes start faster)."""
    parser = argparse.ArgumentParser(
        prog="netstorm",
        description="Geo-distributed parameter synchronization over multi-root FAPT trees.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules: dict[str, ModuleType] = {}
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        module = _load(module_name)
        if module is None:
            continue
        modules[name] = module
        command_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command_parser)
    return parser, modules


def _log_format(args: argparse.Namespace) -> str:
    """``log_format`` as the command line, environment or config file says (before the full Config exists,
    so the first lines already follow it); a bad value is reported by the Config later."""
    given = getattr(args, "opt_log_format", None) or os.environ.get("NETSTORM_LOG_FORMAT")
    if given is None and getattr(args, "config", None):
        from netstorm.config import load_file

        given = load_file(args.config).get("log_format")
    return "json" if str(given).strip().lower() == "json" else "text"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    named = next((arg for arg in argv if not arg.startswith("-")), None)
    parser, modules = build_parser(only=named if named in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    try:
        logjson.configure(level, _log_format(args), role=args.command, dc=getattr(args, "id", None))
        return int(modules[args.command].run(args))
    except NetStormError as exc:
        print(f"netstorm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
