"""``netstorm emulate --trainer torch-ddp``: DDP on netstorm and on gloo train the same model on one WAN."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from netstorm.emulation import netns

DATA = Path(__file__).parent / "data"

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.torch]


def test_netstorm_and_gloo_ddp_record_the_same_learning_curve_and_the_backend_cost(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(DATA / "emu-4.toml"),
                           "--system", "netstorm,gloo", "--trainer", "torch-ddp", "--train", "shapes",
                           "--iterations", "3", "--out", str(out), "--plots", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"]["spec"] == "torch-ddp:shapes"
    systems = result["systems"]
    for name in ("netstorm", "gloo"):
        system = systems[name]
        assert system["iterations_completed"] == 3 and len(system["iteration_s"]) == 3
        assert len(system["loss"]) == 3 and len(system["accuracy"]) == 3
        assert all(0.0 <= a <= 1.0 for a in system["accuracy"])
        assert system["target_accuracy"] == 0.5
    # the same model from the same seeds: the backends differ only in float rounding of the mean gradient
    np.testing.assert_allclose(systems["netstorm"]["loss"], systems["gloo"]["loss"], rtol=1e-3)
    assert systems["netstorm"]["node_iterations"][2] == 1  # a step is one node iteration after the rebuild
    assert 0.0 < systems["netstorm"]["integration_cost"] < 1.0
    assert "integration_cost" not in systems["gloo"]
    assert (tmp_path / "plots" / "ddp-accuracy.png").exists()
    assert not [n for n in netns.list_namespaces() if result["run_id"] in n]
