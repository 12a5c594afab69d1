"""The ``netstorm`` backend launched as users launch it: one torchrun per DC, or one across the DCs.

One ``netstorm local`` cluster (3 DCs, ``trainers`` 2) serves job after job, each six fresh ranks that
end with ``destroy_process_group``: DDP through the Slurm example's per-host launch script, the
compiled DDP in the Kubernetes PyTorchJob's shape (env:// per DC, no torchrun), FSDP2 over the job,
HSDP (sharded in each DC over gloo, replicated across DCs over netstorm), and every collective against
gloo under one torchrun across the DCs (the {dc} socket template, no symlinks). Every training job is
compared with one process trained on the union of the ranks' batches (the example's ``--check``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from netstorm.torch.jobranks import LaunchError, decide, socket_address
from netstorm.trainers.launch import Cluster, local_cluster

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TORCHRUN = Path(sys.executable).parent / "torchrun"
DCS, PER_DC = 3, 2
STEPS = 5

pytestmark = [pytest.mark.torch]


def test_a_rank_is_its_dcs_offset_plus_its_rank_within_the_dc() -> None:
    dcs, counts = (1, 2, 5), (2, 3, 1)
    assert [decide(r, 3, 2, dcs, counts) for r in range(3)] == [(2, True), (3, True), (4, True)]
    assert decide(0, 1, 5, dcs, counts) == (5, True)
    assert decide(4, 6, 2, dcs, counts) == (4, False)  # one launcher across the job keeps its rank
    with pytest.raises(LaunchError, match=r"WORLD_SIZE is 4.*6 ranks.*DC 2 has 3.*--nproc-per-node"):
        decide(0, 4, 2, dcs, counts)


def test_the_socket_template_finds_the_dc_of_a_rank() -> None:
    assert socket_address("/r/node-{dc}.sock", 5, {}, ranks_per_dc=2) == "/r/node-3.sock"
    assert socket_address("/r/node-{dc_index}.sock", 3, {"LOCAL_WORLD_SIZE": "2"}) == "/r/node-1.sock"
    assert socket_address("", 3, {}) is None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with local_cluster(DCS, tmp_path_factory.mktemp("run"), flags=["--trainers", str(PER_DC)],
                       ready_timeout=120) as running:
        yield running


def run_all(commands: Sequence[tuple[Sequence[str], dict[str, str]]], logs: Path, within: float = 600) -> list[str]:
    """Start every command at once (the DCs' launchers), wait for all; their stdout, each must exit 0."""
    processes = []
    for i, (argv, env) in enumerate(commands):
        with (logs / f"launch-{i}.err").open("wb") as err:
            processes.append(subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                              env={**os.environ, "PYTHONUNBUFFERED": "1", **env}))
    outs = []
    try:
        for i, process in enumerate(processes):
            out, _ = process.communicate(timeout=within)
            text = out.decode(errors="replace")
            assert process.returncode == 0, (i, text[-3000:], (logs / f"launch-{i}.err").read_text()[-3000:])
            outs.append(text)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return outs


def records(text: str) -> list[dict[str, Any]]:
    """The JSON objects in the ranks' shared stdout (unbuffered ranks write a line and its newline apart,
    so two ranks' objects may share a line)."""
    decoder = json.JSONDecoder()
    found = []
    for line in text.splitlines():
        at = line.find("{")
        while at >= 0:
            try:
                value, end = decoder.raw_decode(line, at)
            except ValueError:
                break
            found.append(value)
            at = line.find("{", end)
    return found


def check_training(outs: list[str], out_dir: Path) -> None:
    """The example's --check matched every step within 1e-5, the ranks are a permutation of 0..5 made of
    each DC's offset and its launcher's RANK, and every rank holds the same model after every step."""
    import numpy as np

    lines = [r for text in outs for r in records(text)]
    checks = [r for r in lines if "check" in r]
    assert [c["check"] for c in checks] == list(range(STEPS + 1)) and all(c["close"] for c in checks), checks
    assert sum("MATCH: 6 ranks on netstorm" in text for text in outs) == 1
    for dc, text in enumerate(outs):
        idents = [r for r in records(text) if "world" in r]
        assert sorted(r["launcher_rank"] for r in idents) == list(range(PER_DC))
        assert all(r["world"] == DCS * PER_DC and r["rank"] == dc * PER_DC + r["launcher_rank"] for r in idents)
    ranks = sorted(r["rank"] for r in lines if "world" in r)
    assert ranks == list(range(DCS * PER_DC))
    runs = [np.load(out_dir / f"rank-{r}.npz")["params"] for r in ranks]
    assert all(np.array_equal(run, runs[0]) for run in runs[1:])
    assert not np.allclose(runs[0][0], runs[0][-1])


def train_args(out: Path, *extra: str) -> list[str]:
    return [str(EXAMPLES / "ddp_train.py"), "--out", str(out), "--steps", str(STEPS), "--check", "--rtol", "0",
            "--atol", "1e-5", *extra]


def per_dc_torchrun(cluster: Cluster, args: Sequence[str]) -> list[tuple[list[str], dict[str, str]]]:
    """One torchrun per DC through the Slurm example's per-host script (one host per DC, the head)."""
    return [(["bash", str(EXAMPLES / "slurm" / "netstorm-ranks.sh"), *args],
             {"NETSTORM_HEAD": "127.0.0.1", "NETSTORM_NODE_SOCKET": cluster.socket(dc), "NNODES": "1",
              "RANKS_PER_HOST": str(PER_DC), "RDZV_ID": f"dc{dc}", "RDZV_PORT": str(free_port()),
              "TORCHRUN": str(TORCHRUN)})
            for dc in cluster.node_ids]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_per_dc_torchruns_make_one_job_for_ddp_compiled_ddp_fsdp2_and_hsdp(cluster: Cluster, tmp_path: Path) -> None:
    """Four jobs in a row on the same nodes, each six fresh ranks."""
    for job, extra in enumerate([(), ("--shard", "fsdp"), ("--shard", "hsdp")]):
        out = tmp_path / f"job{job}"
        out.mkdir()
        check_training(run_all(per_dc_torchrun(cluster, train_args(out, *extra)), out), out)
    # the Kubernetes PyTorchJob's shape: the operator sets env:// per DC (WORLD_SIZE = the DC's ranks)
    out = tmp_path / "compiled"
    out.mkdir()
    commands = []
    for dc in cluster.node_ids:
        port = str(free_port())
        for local in range(PER_DC):
            commands.append(([sys.executable, *train_args(out, "--compile")],
                             {"RANK": str(local), "WORLD_SIZE": str(PER_DC), "LOCAL_RANK": str(local),
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NETSTORM_SOCKET": cluster.socket(dc)}))
    outs = run_all(commands, out, within=900)
    check_training(["".join(outs[i:i + PER_DC]) for i in range(0, len(outs), PER_DC)], out)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_collective_matches_gloo_under_one_torchrun_across_the_dcs(cluster: Cluster, tmp_path: Path) -> None:
    template = str(cluster.run_dir / "node-{dc}.sock")
    argv = [str(TORCHRUN), "--nproc-per-node", str(DCS * PER_DC), "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), str(ROOT / "tests" / "torch_ranks.py")]
    (out,) = run_all([(argv, {"NETSTORM_TORCH_SOCKET": template, "NETSTORM_TORCH_RANKS_PER_DC": str(PER_DC)})],
                     tmp_path)
    reports = [r for r in records(out) if "ok" in r]
    assert sorted(r["rank"] for r in reports) == list(range(DCS * PER_DC))
    expected = {"all_reduce PRODUCT float32", "all_reduce MAX int32", "reduce_scatter_tensor MAX",
                "all_to_all_single uneven", "gather", "scatter", "subgroups of a partition", "error send", "error AVG"}
    assert all(r["ok"] and expected <= set(r["checks"]) for r in reports), reports
    assert len({len(r["checks"]) for r in reports}) == 1 and len({r["iterations"] for r in reports}) == 1
