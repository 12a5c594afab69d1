"""The size matrix's rows are runs ``netstorm emulate`` accepts: every flag parses, every system and
compression is registered, and the largest models the README names are in it."""

from __future__ import annotations

import argparse

from netstorm.bench.sizes import LARGEST, matrix
from netstorm.commands import emulate
from netstorm.emulation.systems import SYSTEMS


def test_every_row_is_an_emulate_command_line() -> None:
    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    rows = matrix()
    assert {r.model for r in rows} >= set(LARGEST) and len({r.name for r in rows}) == len(rows)
    for row in rows:
        args = parser.parse_args(["internet2-9", "--system", row.system, "--model", row.model, *row.flags])
        assert row.system in SYSTEMS and args.model == row.model
