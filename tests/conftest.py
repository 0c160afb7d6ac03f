"""Suite-wide settings: one compute thread per test process.

The suite runs on two pytest-xdist workers on a 2-core machine, and the real Flower runs start
more processes beside them. Torch's default thread pool (one thread per core in every process)
oversubscribes the cores, and its threads spin while they wait: one thread per process keeps the
work the same and the wall time several times shorter on a shared machine. OMP_NUM_THREADS also
reaches the SuperLink, ServerApp and ClientApp processes the tests start.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

# CI explores the same inputs on every run (a failure there is reproducible from the log); a developer's run
# draws new ones, and whatever it finds becomes an @example.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
