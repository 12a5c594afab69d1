"""torchft as DiLoCo's peer system: ``torchft_diloco`` trainers of two DCs on loopback, a Lighthouse the
test starts, on the digits task. Every outer step leaves both DCs' global state bit-identical (the
digest NetStorm's DiLoCo checks), the held-out loss falls, and plain DiLoCo (P=1, tau=0) follows
NetStorm's single-process reference on the same data, seeds and schedule to float32 rounding: torch's
SGD rounds its update once (a fused multiply-add) where ``OuterSGD`` rounds twice, so the parameters
differ by about an ulp per outer step and the digests differ from the reference's, while the held-out
losses agree to 1e-5. Streaming DiLoCo (P=2, tau=1) is not compared with the reference: torchft's
fragments are whole tensors and it sends a fragment tau steps before its sync step, not after
(netstorm.trainers.torchft_diloco). On NetStorm's nodes (``ProcessGroupNetStormFT``) the same run is
bit-identical to the gloo one."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netstorm.errors import ConfigError
from netstorm.trainers import diloco_run, torchft_diloco
from tests.conftest import require

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240.0


def _options(parser: argparse.ArgumentParser, own: set[str]) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings} - own - {"-h", "--help"}


def test_the_command_line_is_diloco_runs_but_where_it_syncs() -> None:
    ours = _options(torchft_diloco.parser(), {"--lighthouse", "--replica-id", "--hostname"})
    theirs = _options(diloco_run.parser(), set())
    assert ours == theirs and "--fragment-delay" in ours and "--socket" in ours  # optional here: the node


def test_fragments_are_whole_tensors_cut_nearest_netstorms_bounds() -> None:
    assert torchft_diloco.fragment_groups([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    # the digits MLP: 64x1024, 1024, 1024x1024, 1024, 1024x10, 10 (half is inside the big matrix)
    assert torchft_diloco.fragment_groups([65536, 1024, 1048576, 1024, 10240, 10], 2) == [(0, 2), (2, 6)]
    assert torchft_diloco.fragment_groups([1, 100, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ConfigError):
        torchft_diloco.fragment_groups([5, 5], 3)


def test_options_without_a_torchft_counterpart_are_refused_and_compression_maps_to_should_quantize() -> None:
    base = ["--lighthouse", "http://h:1", "--dc-index", "0", "--dcs", "2", "--sync-every", "6", "--fragments", "2",
            "--fragment-delay", "1", "--steps", "12", "--out", "x"]
    mapped = torchft_diloco.torchft_options(torchft_diloco.parse([*base, "--outer-compression", "int4"]))
    assert mapped == {"sync_every": 6, "fragment_sync_delay": 1, "fragment_update_alpha": 0.0,
                      "should_quantize": True}
    assert not torchft_diloco.torchft_options(torchft_diloco.parse(base))["should_quantize"]
    for extra in (["--error-feedback"], ["--straggler-s", "5"], ["--fragment-delay", "3"]):
        with pytest.raises(ConfigError):
            torchft_diloco.torchft_options(torchft_diloco.parse([*base, *extra]))


def _require_torchft() -> None:
    try:
        import sklearn  # noqa: F401
        import torch  # noqa: F401
        import torchft  # noqa: F401
    except ImportError as exc:
        require(False, f"needs torch, scikit-learn and torchft (the peers extra): {exc}")


def _run(tmp_path: Path, h: int, p: int, tau: int, steps: int,
         sockets: list[str] | None = None) -> list[list[dict[str, Any]]]:
    """Two DCs' trainers (through their NetStorm nodes at ``sockets``, else gloo); their JSON lines."""
    from netstorm.trainers.torchft_lighthouse import Lighthouse

    tmp_path.mkdir(parents=True, exist_ok=True)
    outs = [tmp_path / f"dc{dc}.jsonl" for dc in range(2)]
    with (tmp_path / "lighthouse.log").open("wb") as log, Lighthouse(2, join_timeout_ms=30000, log=log) as lh:
        logs = [(tmp_path / f"dc{dc}.log").open("wb") for dc in range(2)]
        procs = [subprocess.Popen(
            [sys.executable, "-m", "netstorm.trainers.torchft_diloco", "--lighthouse", lh.address, "--dc-index",
             str(dc), "--dcs", "2", "--sync-every", str(h), "--fragments", str(p), "--fragment-delay", str(tau),
             "--steps", str(steps), "--timeout", "120", "--out", str(outs[dc]),
             *(["--socket", sockets[dc]] if sockets else [])],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=logs[dc]) for dc in range(2)]
        try:
            codes = [proc.wait(TIMEOUT) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for f in logs:
                f.close()
    assert codes == [0, 0], [(tmp_path / f"dc{dc}.log").read_text()[-3000:] for dc in range(2)]
    return [[json.loads(line) for line in out.read_text().splitlines()] for out in outs]


def _digests(run: list[dict[str, Any]]) -> list[str]:
    return [r["digest_after"] for r in run if r["kind"] == "sync"]


def _check_identical_and_learning(runs: list[list[dict[str, Any]]], outer_steps: int) -> list[dict[str, Any]]:
    syncs = [[r for r in run if r["kind"] == "sync"] for run in runs]
    assert len(syncs[0]) == len(syncs[1]) == outer_steps
    previous = None
    for a, b in zip(*syncs, strict=True):
        assert a["committed"] and b["committed"] and a["weight"] == b["weight"] == 2
        assert a["digest_after"] == b["digest_after"]  # after every outer step, bit for bit
        assert a["digest"] == b["digest"] and (previous is None or a["digest"] == previous)
        previous = a["digest_after"]
    ends = [next(r for r in run if r["kind"] == "end") for run in runs]
    assert ends[0]["digest"] == ends[1]["digest"] == previous and ends[0]["outer_steps"] == outer_steps
    evals = [[r for r in run if r["kind"] == "eval"] for run in runs]
    assert [e["loss"] for e in evals[0]] == [e["loss"] for e in evals[1]]
    assert evals[0][-1]["loss"] < evals[0][0]["loss"] < np.log(10)  # 10 classes: log 10 is chance
    return evals[0]


def _reference(h: int, steps: int) -> list[tuple[float, float]]:
    """NetStorm's single-process DiLoCo of the two DCs (P=1, tau=0): the held-out loss and accuracy of
    the global parameters after each outer step."""
    import torch

    from netstorm.diloco.outer import OuterSGD
    from netstorm.diloco.reference import simulate
    from netstorm.diloco.schedule import Schedule
    from netstorm.trainers.realdata import build

    torch.set_num_threads(1)
    out = []
    for upto in range(h, steps + 1, h):
        tasks = [build("digits", dc, 2, 0) for dc in range(2)]
        inners: dict[int, Any] = {}

        def inner(dc: int, step: int, local: np.ndarray, tasks: Any = tasks, inners: Any = inners) -> None:
            task = tasks[dc]
            if dc not in inners:  # the DC's model trains the simulation's local parameters in place
                at = 0
                for p in task.model.parameters():
                    p.data = torch.from_numpy(local[at:at + p.numel()].reshape(p.shape))
                    at += p.numel()
                inners[dc] = torch.optim.AdamW(task.model.parameters(), lr=task.lr)
            x, y = task.batch(step)
            task.loss(task.model, x, y).backward()
            inners[dc].step()
            inners[dc].zero_grad()

        initial = np.concatenate([p.detach().numpy().reshape(-1) for p in tasks[0].model.parameters()])
        state, _ = simulate(initial, 2, inner, upto, Schedule(h), OuterSGD(0.7, 0.9))
        evaluator, at = copy.deepcopy(tasks[0].model), 0
        for p in evaluator.parameters():
            p.data = torch.from_numpy(state.params[at:at + p.numel()].reshape(p.shape).copy())
            at += p.numel()
        out.append(tasks[0].evaluate(evaluator))
    return out


@pytest.mark.slow
def test_torchft_diloco_keeps_dcs_identical_and_follows_the_reference(tmp_path: Path) -> None:
    _require_torchft()
    h, steps = 5, 15
    evals = _check_identical_and_learning(_run(tmp_path, h, 1, 0, steps), steps // h)
    want = _reference(h, steps)
    assert [e["step"] for e in evals] == list(range(h, steps + 1, h))
    for got, (loss, accuracy) in zip(evals, want, strict=True):
        assert got["loss"] == pytest.approx(loss, rel=1e-5)
        assert abs(got["accuracy"] - accuracy) <= 1 / 360 + 1e-9  # one held-out sample at most


@pytest.mark.slow
def test_torchft_streaming_diloco_on_gloo_and_on_netstorm_nodes_agree_bit_for_bit(tmp_path: Path) -> None:
    """Streaming DiLoCo keeps both DCs identical after every fragment's outer step; swapping torchft's
    ``ProcessGroupGloo`` for NetStorm's ``ProcessGroupNetStormFT`` (``--socket``) changes no bit: two
    float32 pseudo-gradients sum alike in either order, and the sums really crossed the nodes."""
    _require_torchft()
    from netstorm.trainers.launch import local_cluster

    gloo = _run(tmp_path / "gloo", 6, 2, 1, 18)
    _check_identical_and_learning(gloo, 18 // 3)
    start = next(r for r in gloo[0] if r["kind"] == "start")
    assert start["fragment_groups"] == [[0, 2], [2, 6]] and start["torchft_options"]["fragment_sync_delay"] == 1
    assert start["process_group"] == "torchft-gloo"
    assert [r["fragment"] for r in gloo[0] if r["kind"] == "sync"] == [0, 1] * 3
    with local_cluster(2, tmp_path / "run", ready_timeout=90) as cluster:
        nodes = _run(tmp_path / "netstorm", 6, 2, 1, 18, [cluster.socket(1), cluster.socket(2)])
    _check_identical_and_learning(nodes, 18 // 3)
    assert next(r for r in nodes[0] if r["kind"] == "start")["process_group"] == "torchft-netstorm"
    assert _digests(nodes[0]) == _digests(gloo[0])
    fragment_bytes = [4 * 66560, 4 * 1059850]
    for r in (r for r in nodes[0] if r["kind"] == "sync"):
        assert r["contributors"] == [1, 2] and r["wan_bytes"] >= fragment_bytes[r["fragment"]]


def _local_addresses() -> set[str]:
    """The local IPv4 addresses of this process's established TCP connections (/proc/self/net/tcp)."""
    out = set()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "01":  # ESTABLISHED
            raw = bytes.fromhex(local.split(":")[0])
            out.add(".".join(str(b) for b in reversed(raw)))
    return out


def test_gloo_between_dcs_and_the_heal_address_use_the_given_hostname() -> None:
    """Inside a DC's namespace the machine's name resolves to loopback: gloo's mesh and the checkpoint
    server must advertise ``--hostname`` instead (127.0.0.2 here: on lo, but never what a name resolves to)."""
    _require_torchft()
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    wrapper = SimpleNamespace(_timeout=timedelta(seconds=30), _global_ranks=None, _group_rank=None,
                              _group_world_size=None, _uuid=None)
    groups: dict[int, Any] = {}
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            client = TCPStore("127.0.0.1", store.port, 2, False)
            groups[rank] = torchft_diloco.bound_gloo(wrapper, client, rank, 2, "127.0.0.2")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(groups) == 2, errors
    values = [torch.full((4,), float(rank + 1)) for rank in range(2)]
    works = [groups[rank].allreduce([values[rank]]) for rank in range(2)]
    for work in works:
        work.wait()
    assert all(v.tolist() == [3.0] * 4 for v in values)
    assert "127.0.0.2" in _local_addresses()

    transport = torchft_diloco.checkpoint_transport(timedelta(seconds=10), "10.9.8.7")
    try:
        assert transport.address().startswith("http://10.9.8.7:")
    finally:
        transport.shutdown(wait=False)
