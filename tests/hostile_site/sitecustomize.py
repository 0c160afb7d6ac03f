"""Test-only: a SuperNode started with this folder first on its PYTHONPATH is a hostile FederatedFactory
site (tests/test_deploy.py). Python imports `sitecustomize` at start-up in every process of that node;
in its ClientApp processes this replaces the site's round-1 upload with a forged one that claims site 0's
site-id and module ids, an impossible image count and an oversized generator (model_channels 2**40).
Flower runs one app for every node of a run, so the attack lives here, outside the package, and no
user-facing switch can turn a site hostile."""

import os
import sys

if os.path.basename(sys.argv[0] if sys.argv else "") == "flwr-clientapp":
    import json

    import torch
    from flwr.app import ConfigRecord, MetricRecord, RecordDict

    import fedskew.strategies.factory as factory
    from fedskew.models.edm2 import CPU_PRESET

    def forged_upload(cfg, site, device) -> RecordDict:
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
