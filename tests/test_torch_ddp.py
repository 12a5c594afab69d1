"""The PyTorch helper: optional (netstorm never imports torch), and the example matches one process."""

from __future__ import annotations

import subprocess
import sys


def test_importing_netstorm_and_its_trainers_does_not_import_torch() -> None:
    code = ("import sys, netstorm, netstorm.trainers.synthetic, netstorm.trainers.launch, netstorm.bench.loopback, "
            "netstorm.cli; netstorm.cli.build_parser(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
