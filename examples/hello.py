"""One synchronous iteration at every DC of a running job: each DC pushes its gradient and gets the
average of all three back (run ``netstorm local examples/job.toml --run-dir /tmp/ns`` first)."""

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import netstorm

RUN = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ns"


def dc(i: int) -> np.ndarray:
    kv = netstorm.connect(f"{RUN}/node-{i}.sock")              # this DC's general node
    kv.init({"w": np.zeros(1000, np.float32)})                 # every DC starts from the same values
    out = kv.push_pull({"w": np.full(1000, i, np.float32)}, average=True)
    kv.close()
    return out["w"]


with ThreadPoolExecutor(3) as pool:                            # three trainers, one per DC
    results = list(pool.map(dc, range(3)))
assert all(np.array_equal(r, np.full(1000, 1.0, np.float32)) for r in results)   # (0 + 1 + 2) / 3
print("every DC got the same average:", results[0][:3])
