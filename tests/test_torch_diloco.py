"""netstorm.torch's DiLoCo: a torch model trained by its inner optimizer equals the numpy DiLoCo on the
same model (the parameters are views of its flat buffer), with a torch.optim.SGD as the outer optimizer."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from netstorm.diloco.outer import OuterSGD
from netstorm.errors import ConfigError
from tests.diloco_job import Job

pytestmark = pytest.mark.torch


def test_torch_diloco_matches_the_numpy_core_and_keeps_dcs_identical() -> None:
    import torch

    from netstorm.diloco.sync import DiLoCo as FlatDiLoCo
    from netstorm.torch.diloco import DiLoCo, outer_of

    rng = np.random.default_rng(0)
    xs = {dc: torch.tensor(rng.normal(size=(32, 5)), dtype=torch.float32) for dc in (1, 2)}
    ys = {dc: xs[dc] @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]) + dc for dc in (1, 2)}

    initial = {}
    for dc in (1, 2):  # built here: torch's global generator is not for threads
        torch.manual_seed(dc)
        initial[dc] = torch.nn.Linear(5, 1).state_dict()

    def model_of(dc: int) -> torch.nn.Module:
        model = torch.nn.Linear(5, 1)
        model.load_state_dict(initial[dc])
        return model

    def run_torch(job: Job, dc: int) -> DiLoCo:
        model = model_of(dc)
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        dl = DiLoCo(model, inner, outer, job.client(dc), sync_every=4, fragments=2, fragment_delay=1)
        for _ in range(17):
            loss = ((model(xs[dc]).squeeze(1) - ys[dc]) ** 2).mean()
            loss.backward()
            dl.step()
            inner.zero_grad()
        dl.close()
        return dl

    def run_numpy(job: Job, dc: int) -> FlatDiLoCo:
        model = model_of(dc)
        dl = FlatDiLoCo(job.client(dc), {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
                        sync_every=4, fragments=2, fragment_delay=1, outer=OuterSGD())
        w, b = torch.from_numpy(dl.params["weight"]), torch.from_numpy(dl.params["bias"])
        for _ in range(17):
            w.requires_grad_(True)
            b.requires_grad_(True)
            loss = ((xs[dc] @ w.T + b).squeeze(1) - ys[dc]) ** 2
            gw, gb = torch.autograd.grad(loss.mean(), (w, b))
            with torch.no_grad():
                w.requires_grad_(False)
                b.requires_grad_(False)
                w.add_(gw, alpha=-0.05)  # torch.optim.SGD's own update
                b.add_(gb, alpha=-0.05)
            dl.step()
        dl.close()
        return dl

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        job = Job([1, 2])
        ours = [pool.submit(run_torch, job, dc) for dc in (1, 2)]
        torch_runs = [f.result(timeout=60) for f in ours]
        job = Job([1, 2])
        ref = [pool.submit(run_numpy, job, dc) for dc in (1, 2)]
        numpy_runs = [f.result(timeout=60) for f in ref]
    assert torch_runs[0].digest() == torch_runs[1].digest()
    np.testing.assert_array_equal(torch_runs[0].sync.state.params, numpy_runs[0].state.params)
    np.testing.assert_array_equal(torch_runs[1].sync.local, numpy_runs[1].local)
    assert len(torch_runs[0].records) == 8
    with pytest.raises(ConfigError, match="Adam"):
        outer_of(torch.optim.Adam(torch.nn.Linear(2, 1).parameters()))
