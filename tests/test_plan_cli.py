"""``netstorm plan``: the JSON shape the issue specifies, the text form, measured rates, bad input."""

from __future__ import annotations

import json

import pytest

from netstorm.cli import main
from netstorm.policy import TOPOLOGIES, Policy
from tests.policy_graphs import internet2_redrawn


def _json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_shape_for_internet2(capsys):
    out = _json(capsys, "internet2-9", "--bw-scale", "0.25", "--model", "15275210", "--roots", "3")
    assert out["roots"] == [int(r) for r in out["chunk_share"]]
    assert len(out["roots"]) == 3
    for root, tree in out["trees"].items():
        assert set(tree) == {str(n) for n in range(1, 10)}
        assert tree[root] is None
    assert sum(out["chunk_share"].values()) == pytest.approx(1.0)
    assert all("->" in key and all(isinstance(p, list) for p in paths) for key, paths in out["aux_paths"].items())
    assert set(out["predicted_sync_s"]) == {*TOPOLOGIES, "fapt-paper"}
    assert out["limit_s"] == pytest.approx(61.1e6 * 8 / 21.5e6, rel=1e-3)
    assert all(t >= out["limit_s"] for t in out["predicted_sync_s"].values())
    assert sum(v["elements"] for v in out["chunks_per_root"].values()) == 15275210
    # The policy part decodes as a Policy.
    wire = {"wire": 1, "version": 0, "topology": out["topology"], **{k: out[k] for k in
            ("roots", "trees", "chunk_share", "quality", "aux_paths")}}
    assert Policy.from_wire(wire).roots == tuple(out["roots"])


def test_config_flags_apply(capsys, monkeypatch):
    monkeypatch.delenv("NETSTORM_NUM_ROOT_SERVERS", raising=False)
    out = _json(capsys, "internet2-9", "--num-root-servers", "2", "--chunk-size", "500000",
                "--model", "1e6", "--topology", "fapt")
    assert len(out["roots"]) == 2
    assert out["chunk_size"] == 500000
    assert sum(v["chunks"] for v in out["chunks_per_root"].values()) == 2


def test_measured_rates_file(tmp_path, capsys):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"1->2": 10, "2->1": 20, "2->3": 40, "3->2": 5}))
    out = _json(capsys, "--rates", str(path), "--topology", "star-mxnet", "--model", "2.5M")
    assert out["roots"] == [2]
    assert out["trees"] == {"2": {"1": 2, "2": None, "3": 2}}
    # The busiest link 3->2 (5 Mbit/s) carries the 10 MB model once: 16 s, plus the fill.
    assert out["predicted_detail"]["star-mxnet"]["bulk_s"] == pytest.approx(16.0)
    # STAR at the best-bound hub: hubs 1 and 2 both need 16 s (at hub 1, 1->2 carries the sum to 2 and
    # 3 at 10 Mbit/s), a tie that goes to the lower id; both baselines are predicted.
    out = _json(capsys, "--rates", str(path), "--topology", "star", "--model", "2.5M")
    assert out["roots"] == [1]
    assert out["trees"] == {"1": {"1": None, "2": 1, "3": 1}}
    assert out["predicted_detail"]["star"]["bulk_s"] == pytest.approx(16.0)


def test_text_output(capsys):
    assert main(["plan", "internet2-9", "--topology", "bkt", "--bkt-k", "3"]) == 0
    text = capsys.readouterr().out
    assert "topology bkt: 1 root(s)" in text
    assert "limit M/λ" in text
    for topology in TOPOLOGIES:
        assert f"  {topology} " in text


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "cannot read rates"),
    ('{"1-2": 5}', "is not '<a>-><b>'"),
    ('{"1->2": -5, "2->1": 5}', "positive"),
    ('{"1->2": 5}', "strongly connected"),
    ("[]", "JSON object"),
])
def test_bad_rates_file_fails_with_a_message(tmp_path, capsys, content, message):
    path = tmp_path / "rates.json"
    path.write_text(content)
    assert main(["plan", "--rates", str(path)]) == 1
    assert message in capsys.readouterr().err


def test_needs_exactly_one_source(capsys, tmp_path):
    assert main(["plan"]) == 1
    assert "exactly one" in capsys.readouterr().err
    assert main(["plan", "no-such-scenario"]) == 1
    assert "no-such-scenario" in capsys.readouterr().err


def _redrawn_rates_file(tmp_path) -> str:
    """The dynamic scenario's fifth rate draw (x0.25), where trees alone leave a link the bottleneck."""
    path = tmp_path / "redrawn.json"
    path.write_text(json.dumps({f"{a}->{b}": rate for (a, b), rate in internet2_redrawn(4).items()}))
    return str(path)


def test_planned_offload_is_printed_decodes_and_follows_the_aux_flag(tmp_path, capsys):
    rates = _redrawn_rates_file(tmp_path)
    out = _json(capsys, "--rates", rates, "--model", "1M", "--chunk-size", "6945")
    assert out["offload"], "these rates need detours"
    wire = {"wire": 1, "version": 0, "topology": out["topology"], **{k: out[k] for k in
            ("roots", "trees", "chunk_share", "quality", "aux_paths", "offload")}}
    policy = Policy.from_wire(wire)
    assert {f"{a}->{b}" for a, b in policy.offload} == set(out["offload"])
    for (a, b), moves in policy.offload.items():
        assert all(path[0] == a and path[-1] == b and len(path) > 2 for path, _ in moves)
        assert 0 < sum(fraction for _, fraction in moves) <= 1
    without = _json(capsys, "--rates", rates, "--model", "1M", "--chunk-size", "6945",
                    "--enable-aux-path", "false")
    assert without["offload"] == {}
    assert out["predicted_sync_s"]["fapt"] < without["predicted_sync_s"]["fapt"]
    assert main(["plan", "--rates", rates, "--model", "1M"]) == 0
    text = capsys.readouterr().out
    first = next(iter(out["offload"]))
    assert "planned offload" in text and f"  {first}: " in text


@pytest.mark.parametrize(("model", "chunk_size"), [("resnet50", 1_000_000), ("alexnet", 300_000), ("2.5M", 70_000)])
def test_chunks_are_the_ones_the_nodes_cut(capsys, model, chunk_size):
    # The node builds its layout from the trainer's tensors (netstorm.layout); the plan must count the
    # same chunks (ResNet-50's many small tensors share chunks there) and fill the pipeline with the
    # largest of them.
    from netstorm.allot import allot_chunks
    from netstorm.layout import Layout, TensorSpec
    from netstorm.models import layout

    out = _json(capsys, "internet2-9", "--bw-scale", "0.25", "--model", model, "--chunk-size", str(chunk_size))
    specs = [TensorSpec(name, tuple(shape), "float32") for name, shape in layout(model).tensors]
    sizes = Layout.build(specs, chunk_size).chunk_sizes()
    owners = allot_chunks(sizes, {int(r): s for r, s in out["chunk_share"].items()})
    assert {r: v["chunks"] for r, v in out["chunks_per_root"].items()} == {
        r: owners.count(int(r)) for r in out["chunks_per_root"]}
    assert sum(v["elements"] for v in out["chunks_per_root"].values()) == layout(model).params
    assert max(sizes) <= chunk_size
