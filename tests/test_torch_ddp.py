"""The PyTorch helper: optional (netstorm never imports torch), and the example matches one process."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from netstorm.trainers.launch import Cluster, local_cluster


def test_importing_netstorm_and_its_trainers_does_not_import_torch() -> None:
    code = ("import sys, netstorm, netstorm.trainers.synthetic, netstorm.trainers.launch, netstorm.bench.loopback, "
            "netstorm.cli; netstorm.cli.build_parser(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_without_torch_the_helper_names_the_extra_to_install() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import netstorm.torch\nexcept ImportError as exc:\n    print(exc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "netstorm[torch]" in out.stdout


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.torch
@pytest.mark.slow
def test_example_matches_single_process_training_step_for_step(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_mlp.py"), "--dcs", "3", "--steps", "4",
                          "--overlap", "--run-dir", str(tmp_path), "--timeout", "120"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "MATCH: 3 DCs" in run.stdout
    # The check itself, redone here from the saved parameters: every DC the same after every step.
    runs = [np.load(tmp_path / f"dc-{node}.npz") for node in (1, 2, 3)]
    for other in runs[1:]:
        assert np.array_equal(other["params"], runs[0]["params"])
    assert not np.allclose(runs[0]["params"][0], runs[0]["params"][-1])  # training moved the model


@pytest.mark.torch
@pytest.mark.slow
def test_distributed_optimizer_agrees_on_initial_values_and_averages_gradients(tmp_path: Path) -> None:
    import torch

    import netstorm
    from netstorm.torch import DistributedOptimizer

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(5, 3)
            self.unused = torch.nn.Parameter(torch.ones(4))  # never gets a gradient

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    def train_one_step(cluster: Cluster, index: int) -> dict[str, dict[str, np.ndarray]]:
        torch.manual_seed(100 + index)  # different initial values per DC on purpose
        model = Model()
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(index))
        kv = netstorm.connect(cluster.socket(cluster.node_ids[index]), timeout=60)
        try:
            # DC 0 pushes each gradient from backward, DC 1 all of them at step(): the sums agree.
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(), kv,
                                       overlap=index == 0)
            initial = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
            model(x).square().sum().backward()
            local = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            synced = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
            after = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
            if index == 0:  # overlap needs one backward per step: a second one is refused
                model(x).sum().backward()
                with pytest.raises(RuntimeError, match="second gradient before step"):
                    model(x).sum().backward()
        finally:
            kv.close()
        return {"initial": initial, "local": local, "synced": synced, "after": after}

    with local_cluster(2, tmp_path, ready_timeout=60) as cluster, ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(train_one_step, cluster, i) for i in range(2)]
        a, b = (f.result(timeout=60) for f in futures)
    for name in ("fc.weight", "fc.bias", "unused"):
        assert np.array_equal(a["initial"][name], b["initial"][name])
        assert np.array_equal(a["after"][name], b["after"][name])
    for name in ("fc.weight", "fc.bias"):
        mean = (a["local"][name] + b["local"][name]) / np.float32(2)
        np.testing.assert_allclose(a["synced"][name], mean, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(a["after"][name], a["initial"][name] - 0.5 * mean, rtol=1e-5, atol=1e-6)
    assert "unused" not in a["local"]
    assert np.array_equal(a["synced"]["unused"], np.zeros(4, np.float32))
    assert np.array_equal(a["after"]["unused"], a["initial"]["unused"])
