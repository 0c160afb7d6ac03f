"""The user-path matrix's rows on PNG site folders (dataset sites:<dir>: fedmedian, fedtrimmedavg and the
centralised bound on the pooled folders) and FederatedFactory's (factory, factory-p2p), through a real `flwr run`
on the layouts of test_user_paths.py (its module explains the floors). A factory run must also synthesise a
class-balanced set at the server, every class at factory.samples-per-class, and the server's classifier trained
on it alone must learn the real test images."""

import numpy as np
import pytest
from test_user_paths import NUM_CLASSES, assert_learnt, check_federated_row, layouts, run_row  # noqa: F401 - a fixture

from fedskew.factory.library import load_synthetic

SAMPLES_PER_CLASS = 80
# FederatedFactory's setting: each site holds 2 of the 4 classes, every class at some site. 8 px images: each
# generator (one per site and class; factory-p2p: one class-conditional per site) learns the classes' squares in
# 60-100 steps, drawn with 8 sampler steps; batches of 16 give the classifiers (and the experts) 10 steps an epoch.
# Measured at 60 steps: the server's classifier scored 0.81 on the real test images with batches of 16, and 0.55
# with the default 64 (3 steps an epoch).
FACTORY = {
    "partition": "classes-per-site", "classes-per-site": 2, "factory.generator-steps": 60,
    "factory.audit-samples": 8, "factory.sampler-steps": 8, "factory.samples-per-class": SAMPLES_PER_CLASS,
    "factory.p2p-samples-per-class": 40, "factory.classifier-epochs": 10, "factory.p2p-epochs": 10,
    "factory.classifier-batch-size": 16,
}  # fmt: skip
P2P = {"method": "factory-p2p", "factory.conditional": True, "factory.generator-steps": 100}


def assert_class_balanced_synthetic_set(run, summary):
    report = summary["factory"]
    assert report["missing_classes"] == [] and report["rejected"] == [] and summary["dropped"] == []
    assert report["classifier"]["synthetic_per_class"] == [SAMPLES_PER_CLASS] * NUM_CLASSES
    stored = load_synthetic(run / "synthetic.safetensors")  # what the classifier trained on
    assert np.bincount(stored.labels, minlength=NUM_CLASSES).tolist() == [SAMPLES_PER_CLASS] * NUM_CLASSES


@pytest.mark.parametrize(("config", "layout"), [({"method": "factory"}, "npz-uint8-grey-8px"), (P2P, "npz-uint8-rgb-8px")],
                         ids=["factory", "factory-p2p"])  # fmt: skip
def test_federated_factory_on_a_uint8_medmnist_npz_learns_from_a_class_balanced_synthetic_set(
    tiny_run_superlink, layouts, tmp_path, config, layout
):
    written, method = layouts[layout], config["method"]
    run, summary, rounds = run_row(tiny_run_superlink, written, {**FACTORY, **config}, tmp_path)
    assert_class_balanced_synthetic_set(run, summary)
    assert_learnt(f"{method} on {layout} (the server's classifier)", summary["factory"]["server_test"]["accuracy"],
                  written.test_labels)  # fmt: skip
    if method == "factory-p2p":
        assert [r["round"] for r in rounds] == [1, 2] and summary["final"] == summary["p2p"]["poe_test"]
        assert_learnt(f"{method} on {layout} (the Product of Experts)", summary["final"]["accuracy"], written.test_labels)


SITE_FOLDER_ROWS = [("fedmedian", "png-sites-grey"), ("fedtrimmedavg", "png-sites-rgb-multi")]


@pytest.mark.parametrize(("method", "layout"), SITE_FOLDER_ROWS, ids=[f"{m}-{l}" for m, l in SITE_FOLDER_ROWS])
def test_a_federated_method_learns_on_site_folders(tiny_run_superlink, layouts, tmp_path, method, layout):
    check_federated_row(tiny_run_superlink, layouts, tmp_path, method, layout)


def test_the_centralised_bound_learns_on_the_pooled_site_folders(tiny_run_superlink, layouts, tmp_path):
    written = layouts["png-sites-grey"]
    run, summary, rounds = run_row(tiny_run_superlink, written, {"method": "centralized"}, tmp_path)
    assert_learnt("centralized on png-sites-grey", summary["final"]["accuracy"], written.test_labels)
