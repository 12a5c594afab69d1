"""A quiet CLI: each command's help holds its own options only, an error is one line and a hint, the
shared flags mean one thing everywhere, a mistyped option name gets a "did you mean", progress is
bars on a terminal and plain lines elsewhere."""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from netstorm import config
from netstorm.cli import COMMANDS, build_parser, main
from netstorm.errors import ConfigError
from netstorm.progress import Progress


def parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser, and every benchmark's under ``bench``."""
    parser, _ = build_parser()
    for name, command in parser.commands.items():
        yield name, command
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield f"{name} {sub_name}", sub


def shown(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS and a.option_strings]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_is_bounded_by_the_commands_own_options(command: str) -> None:
    parser, _ = build_parser(only=command)
    sub = parser.commands[command]
    lines = sub.format_help().count("\n")
    entries = sum(len(a.choices) if isinstance(a, argparse._SubParsersAction) else 1
                  for a in sub._actions if a.help != argparse.SUPPRESS)
    # usage, description and group titles, then at most a few lines per option or sub-command it shows
    assert lines <= 15 + 5 * entries, (command, lines, entries)


def test_status_shows_only_what_it_uses() -> None:
    parser, _ = build_parser(only="status")
    text = parser.commands["status"].format_help()
    assert text.count("\n") < 60
    assert "--connect-timeout" in text and "--secret-file" in text and "(default 20.0)" in text
    assert "--update-time" not in text and "--edge-mtu" not in text
    # what it does not show it still accepts (a supervisor hands every child the same flags)
    args = parser.parse_args(["status", "--scheduler", "h:1", "--update-time", "3"])
    assert args.opt_update_time == "3"


def test_the_scheduler_groups_its_options_by_concern() -> None:
    parser, _ = build_parser(only="scheduler")
    titles = [g.title for g in parser.commands["scheduler"]._action_groups]
    for section in ("Paper, Table I options", "Runtime options", "Trust options", "LAN tier options"):
        assert section in titles
    assert "Emulation options" not in titles


def test_an_error_is_one_line_and_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["scheduler", "internet2-9", "--updat-time", "3"])
    assert done.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["netstorm scheduler: error: unrecognized arguments: --updat-time 3; did you mean --update-time?",
                   "  (see 'netstorm scheduler --help')"]
    with pytest.raises(SystemExit):
        main(["stauts"])
    first, hint = capsys.readouterr().err.splitlines()
    assert first.endswith("did you mean 'status'?") and "netstorm --help" in hint


def test_json_out_and_system_mean_one_thing_on_every_command() -> None:
    seen = set()
    for name, parser in parsers():
        for action in shown(parser):
            if "--json" in action.option_strings:
                assert action.nargs == 0, f"{name}: --json prints one JSON object on stdout (a flag)"
                seen.add("json")
            if "--out" in action.option_strings:
                assert action.nargs is None and action.metavar == "FILE", f"{name}: --out FILE is the result JSON"
                seen.add("out")
            if "--system" in action.option_strings:
                assert action.nargs is None and "comma-separated" in str(action.help), name
                seen.add("system")
            assert "--systems" not in action.option_strings and "--json-out" not in action.option_strings, name
    assert seen == {"json", "out", "system"}


def test_a_mistyped_option_in_a_toml_file_gets_a_did_you_mean(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("[netstorm]\nupdate_tiem = 3\n")
    with pytest.raises(ConfigError, match=r"unknown option 'update_tiem'; did you mean 'update_time'\?"):
        config.load_file(path)
    path.write_text("completely_unrelated = 3\n")
    with pytest.raises(ConfigError) as exc:
        config.load_file(path)
    assert "did you mean" not in str(exc.value)


def test_a_mistyped_netstorm_variable_gets_a_did_you_mean() -> None:
    with pytest.warns(UserWarning, match=r"NETSTORM_UPDAT_TIME is not an option; did you mean NETSTORM_UPDATE_TIME\?"):
        assert config.load_env({"NETSTORM_UPDAT_TIME": "3", "NETSTORM_CHUNK_SIZE": "5"}) == {"chunk_size": 5}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # variables that are not options, and unrelated ones, pass quietly
        config.load_env({"NETSTORM_SOCKET": "/tmp/x", "NETSTORM_LOCAL_RUN_DIR": "/tmp", "NETSTORM_ZZZ": "1"})


def test_progress_is_plain_lines_off_a_terminal_and_bars_on_one() -> None:
    plain = io.StringIO()
    progress = Progress(plain)
    progress.bar("netstorm", "netstorm iterations", 5)
    progress.advance("netstorm", 2)
    progress.line("[netstorm] iteration 2/5: 1.00 s")
    progress.close()
    lines = plain.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith("s [netstorm] iteration 2/5: 1.00 s")

    terminal = io.StringIO()
    live = Progress(terminal, live=True)
    assert live.live
    live.bar("netstorm", "netstorm iterations", 5)
    live.advance("netstorm", 2)
    live.line("[netstorm] iteration 2/5: 1.00 s")
    live.close()
    text = terminal.getvalue()
    assert "netstorm iterations" in text and "2/5" in text and "left" in text
