"""A site's per-class generators trained side by side in worker processes give the same generators as
training them one after another, and images drawn from them in worker processes are those drawn in one
process: each generator and each draw uses only its own seed, and at one torch thread per generator both
paths run the same float32 operations in the same order."""

import numpy as np
import pytest
import torch

from fedskew.config import RunConfig
from fedskew.data.sites import SiteData
from fedskew.factory.library import Library, SampleJob, synthesise
from fedskew.factory.parallel import worker_count
from fedskew.factory.site import train_site_generators


def tiny_site(classes: int = 2, per_class: int = 12, side: int = 8) -> SiteData:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(classes), per_class)
    images = rng.random((len(labels), 1, side, side), dtype=np.float32)
    val_labels = np.repeat(np.arange(classes), 4)
    val_images = rng.random((len(val_labels), 1, side, side), dtype=np.float32)
    return SiteData(3, 5, images, labels, val_images, val_labels, classes, tuple(f"c{c}" for c in range(classes)))


def factory_config(workers: int) -> RunConfig:
    return RunConfig.from_run_config({
        "method": "factory", "mosaic-grid": 0, "partition": "classes-per-site", "image-size": 8, "factory.generator-steps": 3, "factory.audit-samples": 4,
        "factory.sampler-steps": 2, "factory.parallel-generators": workers,
    })  # fmt: skip


def test_generators_trained_in_worker_processes_equal_those_trained_one_after_another():
    assert torch.get_num_threads() == 1  # the suite's setting: one thread per generator on both paths
    site = tiny_site()
    sequential, seq_metrics = train_site_generators(factory_config(1), site, torch.device("cpu"))
    parallel, par_metrics = train_site_generators(factory_config(2), site, torch.device("cpu"))
    assert (seq_metrics["generator_workers"], par_metrics["generator_workers"]) == (1, 2)
    assert [m.module_id for m in parallel] == [m.module_id for m in sequential] and len(parallel) == 2
    for a, b in zip(sequential, parallel):
        assert a.checksum == b.checksum and a.memorization == b.memorization
        assert a.state.keys() == b.state.keys()
        for key in a.state:
            assert torch.equal(a.state[key], b.state[key]), (a.module_id, key)
    # the generators differ from each other: equality above is not that of untrained or identical nets
    assert sequential[0].checksum != sequential[1].checksum


def test_images_drawn_in_worker_processes_equal_those_drawn_in_one_process_in_plan_order():
    site = tiny_site()
    modules, _ = train_site_generators(factory_config(1), site, torch.device("cpu"))
    library = Library(tuple(modules), site.num_classes, (1, 8, 8), site.class_names)
    a, b = (m.module_id for m in modules)
    # module a's two draws are not adjacent in the plan: the images must come back in plan order
    plan = [SampleJob(a, 0, 3, 11), SampleJob(b, 1, 2, 12), SampleJob(a, 0, 4, 13)]
    draw = dict(steps=2, batch_size=2, device=torch.device("cpu"), progress=False)
    one = synthesise(library, plan, parallel=1, **draw)
    two = synthesise(library, plan, parallel=2, **draw)
    assert one.images.shape == (9, 1, 8, 8) and one.labels.tolist() == two.labels.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert one.source.tolist() == two.source.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert np.array_equal(one.images, two.images)
    # each draw depends on its own seed only: drawn alone, the third draw gives the same images
    alone = synthesise(library, plan[2:], parallel=1, **draw)
    assert np.array_equal(alone.images, one.images[5:]) and not np.array_equal(one.images[:3], one.images[5:8])


def test_worker_count_follows_the_setting_the_cores_and_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert worker_count(0, jobs=10, device=cpu, threads=4) == 4  # automatic: one per torch thread
    assert worker_count(0, jobs=3, device=cpu, threads=8) == 3  # never more than the generators
    assert worker_count(0, jobs=10, device=cuda, threads=8) == 1  # one process per GPU
    assert worker_count(6, jobs=10, device=cuda, threads=1) == 6  # an explicit setting wins
    with pytest.raises(ValueError, match="factory.parallel-generators"):
        worker_count(-1, jobs=2, device=cpu)
