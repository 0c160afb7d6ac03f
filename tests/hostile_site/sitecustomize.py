"""Test-only: a SuperNode started with this folder first on its PYTHONPATH is a hostile FederatedFactory
site (tests/test_deploy.py). Python imports `sitecustomize` at start-up in every process of that node;
in its ClientApp processes, once the app imports fedskew.factory.site_handlers, the site's round-1 upload
is replaced by a forged one (`forged_upload`): the site's own generators, untrained, with every lie of
LIES told at once: it claims site 0's site-id and module ids, an impossible image count and an oversized
generator (model_channels 2**40). The server refuses it at the first check it meets (the impostor);
tests/test_hostile.py sends one forged message per lie, so that every check is reached. Flower runs one
app for every node of a run, so the attack lives here, outside the package, and no user-facing switch can
turn a site hostile.

The patch waits for that import (an import hook) instead of importing at start-up: a ClientApp that
spends its first seconds importing torch, before it has fetched its task, misses its heartbeats."""

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "fedskew.factory.site_handlers"


def claim_site_zero(manifest: dict, module: dict) -> None:
    manifest["site-id"] = module["site-id"] = 0
    module["module-id"] = "site0-class0"


def impossible_image_count(manifest: dict, module: dict) -> None:
    module["image-counts"] = [10**15]


def oversized_generator(manifest: dict, module: dict) -> None:
    module["config"]["model_channels"] = 2**40


# Each lie, told on the upload's manifest and its first module's metadata.
LIES = {"impostor": claim_site_zero, "image count": impossible_image_count, "oversized generator": oversized_generator}


def forged_upload(cfg, site_id: int, label_counts: list[int], image_shape: tuple[int, ...], lies=tuple(LIES)):
    """The upload a site of `site_id` with these training label counts would send, its generators untrained
    (well-formed in every other respect), with `lies` told in its manifest."""
    from fedskew.factory.library import GeneratorModule
    from fedskew.factory.site import planned_modules
    from fedskew.models.edm2 import build_generator
    from fedskew.models.generator_io import state_dict_checksum
    from fedskew.protocol import encode_modules

    modules = []
    for planned in planned_modules(cfg, site_id, label_counts, tuple(image_shape)):
        state = build_generator(planned.config).state_dict()
        modules.append(GeneratorModule(planned.module_id, site_id, planned.classes, planned.image_counts, planned.config,
                                       state_dict_checksum(state), 0.0, state))  # fmt: skip
    manifest = {"site-id": site_id, "image-shape": list(image_shape), "modules": [m.metadata() for m in modules]}
    for lie in lies:
        LIES[lie](manifest, manifest["modules"][0])
    return encode_modules(manifest, modules)


def forge(factory) -> None:
    def forged_site_upload(cfg, site, device):
        from fedskew.client_tasks import site_survey

        return forged_upload(cfg, site.site_id, site_survey(cfg, site)["label-counts"], site.train_images.shape[1:])

    factory.site_upload = forged_site_upload


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
