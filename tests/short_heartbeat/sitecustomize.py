"""Test-only: a SuperNode started with this folder first on its PYTHONPATH sends its heartbeats at
Flower's shortest accepted interval (10 s) instead of the 30 s that Flower 1.42 hard-codes in the
SuperNode. The SuperLink declares a node gone after two missed intervals, so a SIGKILLed site
(tests/test_deploy.py) lapses after about 20 s instead of a minute; everything else is Flower's own code.

Like tests/hostile_site, the patch waits for the modules' import instead of importing Flower at start-up."""

import importlib.abc
import importlib.machinery
import os
import sys

SHORTEST_INTERVAL = 10  # flwr.common.constant.HEARTBEAT_MIN_INTERVAL: the SuperLink refuses anything shorter
# Both read the interval as a module global bound at import: the node's activation and heartbeat
# requests (fleet_http_connection) and the sender's wait between heartbeats (heartbeat).
TARGETS = ("flwr.supernode.fleet_http_connection", "flwr.supercore.heartbeat")


class ShortenOnImport(importlib.abc.MetaPathFinder):
    """Finds a TARGETS module like the normal path finder, then shortens its interval once it has executed."""

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.HEARTBEAT_DEFAULT_INTERVAL = SHORTEST_INTERVAL

        spec.loader.exec_module = exec_module
        return spec


if os.path.basename(sys.argv[0] if sys.argv else "") == "flower-supernode":
    sys.meta_path.insert(0, ShortenOnImport())
