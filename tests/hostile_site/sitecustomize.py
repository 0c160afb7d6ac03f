"""Test-only: a SuperNode started with this folder first on its PYTHONPATH is a hostile FederatedFactory
site (tests/test_deploy.py). Python imports `sitecustomize` at start-up in every process of that node;
in its ClientApp processes, once the app imports fedskew.strategies.factory, the site's round-1 upload
is replaced by a forged one that claims site 0's site-id and module ids, an impossible image count and
an oversized generator (model_channels 2**40). Flower runs one app for every node of a run, so the
attack lives here, outside the package, and no user-facing switch can turn a site hostile.

The patch waits for that import (an import hook) instead of importing at start-up: a ClientApp that
spends its first seconds importing torch, before it has fetched its task, misses its heartbeats."""

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "fedskew.strategies.factory"


def forge(factory) -> None:
    def forged_upload(cfg, site, device):
        import json

        import torch
        from flwr.app import ConfigRecord, MetricRecord, RecordDict

        from fedskew.models.edm2 import CPU_PRESET

        module = {"module-id": "site0-class0", "site-id": 0, "classes": [0], "image-counts": [10**15],
                  "config": {**CPU_PRESET.to_dict(), "model_channels": 2**40}, "checksum": "0" * 64,
                  "memorization": 0.0}  # fmt: skip
        manifest = {"site-id": 0, "image-shape": list(site.train_images.shape[1:]), "modules": [module]}
        return RecordDict({
            factory.MANIFEST_KEY: ConfigRecord({"json": json.dumps(manifest)}),
            factory.GENERATOR_PREFIX + "site0-class0": factory.packed_weights({"weight": torch.zeros(8)}),
            factory.METRICS_KEY: MetricRecord({"site-id": 0}),
        })  # fmt: skip

    factory.site_upload = forged_upload


class ForgeOnImport(importlib.abc.MetaPathFinder):
    """Finds TARGET like the normal path finder, then forges its upload right after it executes."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            forge(module)

        spec.loader.exec_module = exec_module
        return spec


if os.path.basename(sys.argv[0] if sys.argv else "") == "flwr-clientapp":
    sys.meta_path.insert(0, ForgeOnImport())
