"""The installs stay split: a node's install pulls in no solver, numba or plotting; the extras and the
constraints cover the rest; a command whose extra is missing says which one to install."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

import pytest

from netstorm import cli

ROOT = Path(__file__).resolve().parent.parent
HEAVY = {"scipy", "numba", "highspy", "networkx", "matplotlib", "torch", "llvmlite"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_core_install_is_a_nodes_and_holds_no_heavy_package() -> None:
    core = {_name(r) for r in _project()["dependencies"]}
    assert not core & HEAVY, core & HEAVY
    assert {"msgspec", "numpy", "uvloop"} <= core


def test_every_heavy_package_is_in_an_extra_and_the_cli_knows_which() -> None:
    extras = _project()["optional-dependencies"]
    assert {"scheduler", "emulate", "torch", "dev"} <= set(extras)
    for module, extra in cli.EXTRAS.items():
        named = {_name(r) for r in extras[extra]}
        assert module in named or any(_name(r) == "netstorm" for r in extras[extra]), (module, extra)


def test_constraints_pin_every_declared_requirement() -> None:
    pinned = {line.split("==")[0] for line in (ROOT / "constraints.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    project = _project()
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    assert declared - {"netstorm"} <= pinned, declared - pinned
    assert "-c constraints.txt" in (ROOT / "scripts" / "setup.sh").read_text()


def test_a_command_missing_its_extra_says_which_to_install(capsys: pytest.CaptureFixture[str]) -> None:
    stub = cli.needs_extra("plan", ModuleNotFoundError("No module named 'scipy'", name="scipy"))
    parser = argparse.ArgumentParser()
    stub.add_arguments(parser)
    assert "netstorm[scheduler]" in stub.HELP
    assert stub.run(parser.parse_args(["internet2-9", "--model", "1M"])) == 2
    assert "pip install 'netstorm[scheduler]'" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError):   # what no extra brings is a real error
        cli.needs_extra("plan", ModuleNotFoundError("No module named 'nonesuch'", name="nonesuch"))
