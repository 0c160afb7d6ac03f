"""Suite-wide settings: one compute thread per test process, and the longest modules first.

The suite runs on two pytest-xdist workers on a 2-core machine, and the real Flower runs start
more processes beside them. Torch's default thread pool (one thread per core in every process)
oversubscribes the cores, and its threads spin while they wait: one thread per process keeps the
work the same and the wall time several times shorter on a shared machine. OMP_NUM_THREADS also
reaches the SuperLink, ServerApp and ClientApp processes the tests start.
"""

import functools
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

# CI explores the same inputs on every run (a failure there is reproducible from the log); a developer's run
# draws new ones, and whatever it finds becomes an @example.
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from fedskew.testing.launch import SimulationSuperLink  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


# pytest-xdist (`--dist loadfile --no-loadscope-reorder`, pyproject) hands each worker a whole module, in
# collection order, and the next one only when it is nearly done. Started last, the modules of real Flower
# runs (each minutes long) would end the suite on one worker while the other idles; started first, the
# hundreds of short tests fill in behind them. Longest first, as `pytest --durations` measures them.
LONGEST_FIRST = ("test_user_paths.py", "test_factory.py", "test_user_paths_factory_sites.py", "test_deploy.py",
                 "test_e2e_flower.py", "test_ray_cluster.py", "test_factory_search.py", "test_control_variates.py",
                 "test_api_example.py")


def pytest_collection_modifyitems(items):
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its order


@pytest.fixture(scope="module")
def tiny_run_superlink(tmp_path_factory):
    """A simulation SuperLink for a module's Flower runs of tiny sites, each run on one Ray CPU (one ClientApp
    actor): the sites train for a fraction of a second, and a second actor only adds its start-up (importing torch
    and the app) on cores the other test worker is using. Measured beside one busy core, `pytest -n 0
    tests/test_e2e_flower.py` took 211 s against 242 s with two actors."""
    with SimulationSuperLink(tmp_path_factory.mktemp("flwr-home")) as link:
        link.run_app = functools.partial(link.run_app, ray_cpus=1)
        yield link
