"""The ``netstorm`` command line: one sub-command per module in ``netstorm/commands``.

Each command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their command runs, so ``netstorm plan`` never pays for torch or bcc.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

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
    "layout-hash": "layout_hash",
    "status": "status",
    "probe": "probe",
    "lan-aggregator": "lan_aggregator",
}


EXTRAS: dict[str, str] = {"networkx": "scheduler", "scipy": "scheduler", "numba": "scheduler",
                          "highspy": "scheduler", "matplotlib": "emulate", "torch": "torch"}
"""Optional dependency -> the install extra that brings it (pyproject.toml); the core install is a node's."""


def _load(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"netstorm.commands.{module}")
    except ModuleNotFoundError as exc:
        if exc.name == f"netstorm.commands.{module}":
            return None
        return needs_extra(module, exc)


def needs_extra(module: str, exc: ModuleNotFoundError) -> ModuleType:
    """A stand-in for a command whose optional dependencies are not installed: listed, and run, it says
    which extra to install (``exc`` is raised again when what is missing is no optional dependency)."""
    missing = str(exc.name)
    extra = EXTRAS.get(missing.split(".")[0])
    if extra is None:
        raise exc
    stub = ModuleType(f"netstorm.commands.{module}")
    stub.HELP = f"(not installed: needs {missing}; pip install 'netstorm[{extra}]')"  # type: ignore[attr-defined]
    stub.add_arguments = lambda parser: parser.add_argument("rest", nargs=argparse.REMAINDER)  # type: ignore[attr-defined]

    def run(args: argparse.Namespace) -> int:
        print(f"netstorm {module.replace('_', '-')}: needs {missing}, which this install lacks: "
              f"pip install 'netstorm[{extra}]'", file=sys.stderr)
        return 2

    stub.run = run  # type: ignore[attr-defined]
    return stub


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: the problem, a "did you mean" for a mistyped flag, and where the
    help is, instead of the whole usage before the one line that matters."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, Parser] = {}
        """Sub-command -> its parser (the top parser's; an unknown flag is reported by its command's)."""

    def error(self, message: str) -> NoReturn:
        hint = ""
        if message.startswith("unrecognized arguments:"):
            flags = [o for a in self._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
            for given in message.split(":", 1)[1].split():
                match = difflib.get_close_matches(given.split("=", 1)[0], flags, n=1, cutoff=0.7)
                if match:
                    hint = f"; did you mean {match[0]}?"
                    break
        elif "invalid choice: " in message and "(choose from " in message:
            given = message.split("invalid choice: ", 1)[1].split(" (choose from ", 1)[0].strip("'")
            choices = [c.strip(" '") for c in message.rsplit("(choose from ", 1)[1].rstrip(")").split(",")]
            match = difflib.get_close_matches(given, choices, n=1, cutoff=0.6)
            if match:
                hint = f"; did you mean {match[0]!r}?"
        self.exit(2, f"{self.prog}: error: {message}{hint}\n  (see '{self.prog} --help')\n")


def build_parser(only: str | None = None) -> tuple[Parser, dict[str, ModuleType]]:
    """The parser with every command, or with just ``only`` (child processes start faster)."""
    parser = Parser(
        prog="netstorm",
        description="Geo-distributed parameter synchronization over multi-root FAPT trees.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    modules: dict[str, ModuleType] = {}
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        module = _load(module_name)
        if module is None:
            continue
        command_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        try:
            module.add_arguments(command_parser)
        except ModuleNotFoundError as exc:   # a command whose options come from an optional module
            module = needs_extra(module_name, exc)
            command_parser.description = module.HELP
            module.add_arguments(command_parser)
        modules[name] = module
        parser.commands[name] = command_parser
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
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands.get(args.command or "", parser).error(f"unrecognized arguments: {' '.join(extra)}")
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
    except ModuleNotFoundError as exc:
        needed = EXTRAS.get((exc.name or "").split(".")[0])
        if needed is None:
            raise
        print(f"netstorm {args.command}: needs {exc.name}, which this install lacks: pip install "
              f"'netstorm[{needed}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
