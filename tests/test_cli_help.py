"""Every command's ``--help`` renders: argparse formats help text with %, so one stray % breaks it."""

from __future__ import annotations

import pytest

from netstorm.cli import COMMANDS, build_parser, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_prints_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, modules = build_parser(only=command)
    assert command in modules
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: netstorm")
    assert modules[command].HELP.split()[0] in out
