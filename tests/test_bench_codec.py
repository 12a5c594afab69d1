"""``netstorm bench codec``: one row per message of every wire, each pair round-tripping."""

from __future__ import annotations

import json
import math
from pathlib import Path

from netstorm.bench import codec
from netstorm.cli import main


def test_every_wire_and_typical_message_has_a_row() -> None:
    rows = codec.measure(number=3, repeats=1)
    assert {row["wire"] for row in rows} == {"frames", "control", "trainer"}
    names = {row["message"] for row in rows}
    assert {"ChunkHeader", "Hello", "Heartbeat", "LinkReport", "PolicyRequest", "PolicyReply (9 nodes)",
            "RegisterAck (9 nodes)", "PushRequest (16 names)", "push-pull request (16 names)"} <= names
    assert all(row["bytes"] > 0 and math.isclose(row["total_us"], row["encode_us"] + row["decode_us"]) for row in rows)


def test_the_command_compares_against_a_baseline_checkout(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    tree = Path(__file__).resolve().parent.parent
    assert main(["bench", "codec", "--number", "2", "--repeats", "1", "--baseline", str(tree),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["wire"], r["message"]) for r in report["baseline"]["rows"]] == \
        [(r["wire"], r["message"]) for r in report["rows"]]
