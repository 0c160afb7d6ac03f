"""dataset = "sites:<dir>": a simulation on the sites' own folders, one sub-folder per site in a deployed
site's layout. Simulated SuperNode k reads the k-th folder (by name, numbers compared as numbers) exactly as
a SuperNode deployed on that folder with site-id k, so the sites' split is kept and the folders deploy as
they are."""

import csv
import json
import shlex
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from fedskew.cli import main as cli_main
from fedskew.client_tasks import load_site, site_survey
from fedskew.config import ConfigError, RunConfig, check_label_kind
from fedskew.data.site_folder import check_site_count, pooled_site_data, prepare_sites, read_labelled_folder, site_folders
from fedskew.data.sites import load_task_dataset, simulated_site
from fedskew.results import RunRecorder, run_dir_name
from fedskew.server_tasks import TaskShape, load_server_test_set, train_centralized

SIDE = 8
CLASSES = ("a", "b", "c", "d")


def _png_folder(folder, values, labels, classes=CLASSES):
    """A PNG site folder: image i is a flat grey image of brightness values[i] (so every image is known by
    its value), labelled labels[i] (an id, or a list of ids for multi-label rows)."""
    (folder / "images").mkdir(parents=True)
    rows = []
    for i, (value, label) in enumerate(zip(values, labels)):
        Image.fromarray(np.full((SIDE, SIDE), value, dtype=np.uint8)).save(folder / "images" / f"{i:03d}.png")
        rows.append([f"{i:03d}.png", "|".join(map(str, label)) if isinstance(label, list) else str(label)])
    with (folder / "labels.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([["file", "labels"], *rows])
    (folder / "classes.txt").write_text("".join(f"{name}\n" for name in classes))
    return folder


# Plain string order (site-1, site-10, site-2) differs from the site order: numbers compare as numbers.
SITE_ORDER = ("site-1", "site-2", "site-10")


def _single_label_sites(root, sizes=(12, 9, 15)):
    """Three single-label PNG site folders with disjoint brightness ranges and skewed labels, and the
    server's test folder inside the same folder (the run's test-data, so no site)."""
    written = {}
    for k, (name, size) in enumerate(zip(SITE_ORDER, sizes)):
        values = [10 + 60 * k + i for i in range(size)]
        labels = [(k + (i % 3 == 0)) % len(CLASSES) for i in range(size)]  # mostly class k: the sites' own skew
        _png_folder(root / name, values, labels)
        written[name] = (values, labels)
    _png_folder(root / "server-test", [200 + i for i in range(8)], [i % len(CLASSES) for i in range(8)])
    return written


def _cfg(root, **extra):
    return RunConfig.from_run_config({"method": "fedavg", "dataset": f"sites:{root}", "mosaic-grid": 0,
                                      "test-data": str(root / "server-test"), "val-fraction": 0.25, **extra})  # fmt: skip


def _brightness(images):
    return [round(float(v) * 255) if images.dtype != np.uint8 else int(v) for v in images[:, 0, 0, 0]]


def test_each_simulated_png_site_reads_exactly_its_own_folder_and_split(tmp_path):
    written = _single_label_sites(tmp_path)
    cfg = _cfg(tmp_path)
    assert [p.name for p in site_folders(cfg)] == list(SITE_ORDER)
    for k, name in enumerate(SITE_ORDER):
        site = load_site(cfg, {"partition-id": k, "num-partitions": 3})
        assert (site.site_id, site.num_sites, site.num_classes, site.class_names) == (k, 3, 4, CLASSES)
        values, labels = written[name]
        found = dict(zip(_brightness(site.train_images) + _brightness(site.val_images),
                         np.concatenate([site.train_labels, site.val_labels]).tolist()))
        assert found == dict(zip(values, labels))  # every image of its folder, with its label, and nothing else
        assert len(site.val_labels) == round(0.25 * len(values))
        # The split a SuperNode deployed on the folder as site k makes: the folders deploy unchanged.
        deployed = load_site(cfg, {"data-dir": str(tmp_path / name), "site-id": k, "num-sites": 3})
        for field in ("train_images", "train_labels", "val_images", "val_labels"):
            np.testing.assert_array_equal(getattr(site, field), getattr(deployed, field))


def test_multilabel_png_sites_keep_their_rows(tmp_path):
    rows = {"x": [[0, 2], [], [1]], "y": [[3], [0, 1, 2, 3], [2], [2, 3]]}
    for k, (name, labels) in enumerate(rows.items()):
        _png_folder(tmp_path / name, [20 + 50 * k + i for i in range(len(labels))], labels)
    cfg = RunConfig.from_run_config({"method": "fednca", "dataset": f"sites:{tmp_path}", "mosaic-grid": 0,
                                     "test-data": "federated", "val-fraction": 0.3})  # fmt: skip
    for k, labels in enumerate(rows.values()):
        site = load_site(cfg, {"partition-id": k, "num-partitions": 2})
        assert site.multilabel and site.train_labels.shape[1] == len(CLASSES)
        found = dict(zip(_brightness(site.train_images) + _brightness(site.val_images),
                         [np.flatnonzero(row).tolist() for row in np.concatenate([site.train_labels, site.val_labels])]))
        assert found == dict(zip([20 + 50 * k + i for i in range(len(labels))], labels))
        survey = site_survey(cfg, site)
        assert survey["unassigned"] == 0 and survey["multilabel"] == 1
        assert survey["label-counts"] == site.train_labels.sum(axis=0).astype(int).tolist()


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_site_npz_folders_are_read_exactly_in_their_dtype(tmp_path, dtype):
    rng = np.random.default_rng(0)
    stored = {}
    for k, size in enumerate((7, 11)):
        pixels = rng.integers(0, 256, size=(size, SIDE, SIDE), dtype=np.uint8)
        images = pixels if dtype is np.uint8 else (pixels / 255).astype(np.float32)
        labels = rng.integers(0, 3, size=(size, 1))
        (tmp_path / f"h{k}").mkdir()
        np.savez(tmp_path / f"h{k}" / "site.npz", train_images=images, train_labels=labels,
                 class_names=np.array(["p", "q", "r"]))  # fmt: skip
        stored[k] = (images, labels[:, 0])
    cfg = RunConfig.from_run_config({"method": "fedavg", "dataset": f"sites:{tmp_path}", "mosaic-grid": 0,
                                     "test-data": "federated"})  # fmt: skip
    for k, (images, labels) in stored.items():
        site = load_site(cfg, {"partition-id": k, "num-partitions": 2})
        assert site.train_images.dtype == dtype
        pairs = sorted((img.tobytes(), int(lab)) for img, lab in zip(
            np.concatenate([site.train_images, site.val_images])[:, 0], np.concatenate([site.train_labels, site.val_labels])
        ))  # fmt: skip
        assert pairs == sorted((img.tobytes(), int(lab)) for img, lab in zip(images, labels))


def test_folders_written_by_prepare_sites_simulate_as_the_partition_they_came_from(tmp_path):
    source = RunConfig.from_run_config({"method": "fedavg", "mosaic-grid": 0, "partition": "dirichlet", "alpha": 0.5})
    prepare_sites(source, 3, tmp_path, "npz")  # site-0..2 and server-test, in one folder
    cfg = _cfg(tmp_path, **{"val-fraction": source.val_fraction})
    for k in range(3):
        site, twin = load_site(cfg, {"partition-id": k, "num-partitions": 3}), simulated_site(source, k, 3)
        for field in ("train_images", "train_labels", "val_images", "val_labels"):
            np.testing.assert_array_equal(getattr(site, field), getattr(twin, field))


def test_prepare_sites_prints_a_simulation_on_its_folders_that_parses_and_fits_them(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["prepare-sites", "--sites", "2", "--out", str(out), "--format", "npz", "--mosaic-grid", "0",
                     "--partition", "iid", "--labels", "single"]) == 0  # fmt: skip
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("flwr run")]
    words = shlex.split(line)
    assert words[words.index("--federation-config") + 1] == "num-supernodes=2"
    run = dict(word.split("=", 1) for word in shlex.split(words[words.index("--run-config") + 1]))
    cfg = RunConfig.from_run_config({"method": "fedavg", **{k: int(v) if v.isdigit() else v for k, v in run.items()}})
    assert (cfg.dataset, cfg.labels, cfg.test_data) == (f"sites:{out}", "single", str(out / "server-test"))
    assert check_site_count(cfg, 2) == [out / "site-0", out / "site-1"]


def test_the_node_count_must_match_the_site_folders(tmp_path):
    _single_label_sites(tmp_path)
    cfg = _cfg(tmp_path)
    for nodes in (2, 4):
        with pytest.raises(ConfigError) as err:
            load_site(cfg, {"partition-id": 0, "num-partitions": nodes})
        message = str(err.value)
        assert f"key 'dataset' = 'sites:{tmp_path}' holds 3 site folder(s) (site-1, site-2, site-10)" in message
        assert f"the simulation has {nodes} SuperNode(s)" in message and '"num-supernodes=3"' in message
    assert check_site_count(cfg, 3) == [tmp_path / name for name in SITE_ORDER]


def test_a_bad_sites_folder_is_one_clear_error_naming_the_path_before_any_site_is_waited_for(tmp_path):
    def server_error(root):
        with pytest.raises(ConfigError) as err:
            load_server_test_set(RunConfig.from_run_config(
                {"method": "fedavg", "dataset": f"sites:{root}", "mosaic-grid": 0, "test-data": "federated"}))
        return str(err.value)

    assert f"{tmp_path / 'missing'} does not exist or is not a folder" in server_error(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    assert "does not exist or is not a folder" in server_error(tmp_path / "file")
    empty = tmp_path / "empty"
    (empty / ".hidden").mkdir(parents=True)
    (empty / "notes.txt").write_text("x")
    assert f"{empty} holds no site folder (found: .hidden/, notes.txt)" in server_error(empty)
    bad = tmp_path / "bad"
    _png_folder(bad / "s0", [1, 2], [0, 1])
    (bad / "s1" / "images").mkdir(parents=True)
    assert f"site folder {bad / 's1'} holds neither of labels.csv and site.npz (found: images/)" in server_error(bad)
    np.savez(bad / "s0" / "site.npz", train_images=np.zeros((1, 2, 2)), train_labels=np.zeros((1, 1)))
    assert f"site folder {bad / 's0'} holds labels.csv and site.npz" in server_error(bad)


def test_the_servers_val_data_inside_the_folder_is_no_site(tmp_path):
    _single_label_sites(tmp_path)
    _png_folder(tmp_path / "server-val", [230, 231], [0, 1])
    cfg = _cfg(tmp_path, **{"val-data": str(tmp_path / "server-val")})
    assert [p.name for p in site_folders(cfg)] == list(SITE_ORDER)


def test_a_relative_sites_folder_is_under_data_root(tmp_path):
    _single_label_sites(tmp_path / "root" / "hospital")
    cfg = RunConfig.from_run_config({"method": "fedavg", "dataset": "sites:hospital", "data-root": str(tmp_path / "root"),
                                     "mosaic-grid": 0, "test-data": "federated"})  # fmt: skip
    assert [p.name for p in site_folders(cfg)] == ["server-test", *SITE_ORDER]  # not the run's test-data here


@pytest.mark.parametrize("key, value, valid", [
    ("mosaic-grid", 2, "valid: 0 with dataset 'sites:/x'"),
    ("partition", "iid", "valid: its default 'multilabel-skew' with dataset 'sites:/x'"),
    ("alpha", 0.5, "valid: its default 0.1 with dataset 'sites:/x'"),
    ("missing-classes", 1, "valid: its default 3"),
    ("test-data", "", "valid: a site-layout folder, a MedMNIST-layout .npz or 'federated' with dataset 'sites:/x'"),
])  # fmt: skip
def test_settings_a_run_on_site_folders_cannot_use_are_refused_by_key(key, value, valid):
    run = {"method": "fedavg", "dataset": "sites:/x", "mosaic-grid": 0, "test-data": "federated", key: value}
    with pytest.raises(ConfigError, match=f"key '{key}' = {value!r} is invalid; {valid}"):
        RunConfig.from_run_config(run)


def test_site_folders_tell_their_label_kind_and_the_default_partition_does_not_object():
    cfg = RunConfig.from_run_config({"method": "fedavg", "dataset": "sites:/x", "mosaic-grid": 0, "test-data": "federated"})
    assert cfg.label_kind is None and cfg.partition == "multilabel-skew"
    assert check_label_kind(cfg, False, "the sites") == "single"
    assert check_label_kind(cfg, True, "the sites") == "multi"


def test_the_centralised_bound_pools_the_site_folders_and_nothing_loads_a_whole_dataset(tmp_path):
    _single_label_sites(tmp_path)
    cfg = _cfg(tmp_path, method="centralized")
    images, labels, val_images, val_labels = pooled_site_data(cfg, 3)
    sites = [load_site(cfg, {"partition-id": k, "num-partitions": 3}) for k in range(3)]
    np.testing.assert_array_equal(images, np.concatenate([s.train_images for s in sites]))
    np.testing.assert_array_equal(val_labels, np.concatenate([s.val_labels for s in sites]))
    assert len(labels) + len(val_labels) == 12 + 9 + 15 and len(val_images) == len(val_labels)
    assert len(load_server_test_set(cfg).test_labels) == 8
    with pytest.raises(ConfigError, match="names the sites' own folders, not one dataset"):
        load_task_dataset(cfg)


@pytest.mark.parametrize("test_data", ["server-test", "federated"])
def test_the_centralised_bound_trains_on_the_folders_and_is_tested_on_test_data(tmp_path, test_data):
    root = tmp_path / "sites"
    _single_label_sites(root)
    if test_data == "federated":
        shutil.rmtree(root / "server-test")  # else a fourth site: only the run's test-data is left out
    cfg = _cfg(root, method="centralized", **{"num-server-rounds": 1, "batch-size": 8,
                                              "test-data": str(root / test_data) if test_data != "federated" else test_data})  # fmt: skip
    recorder = RunRecorder.create(cfg, multilabel=False, base=tmp_path / "results")
    task = TaskShape(len(CLASSES), (1, SIDE, SIDE), CLASSES, multilabel=False, name="the site folders")
    train_centralized(cfg, task, 3, torch.device("cpu"), recorder)
    rounds = [json.loads(line) for line in (recorder.path / "metrics.jsonl").read_text().splitlines()]
    assert rounds[1]["train"]["num_examples"] == sum(
        len(load_site(cfg, {"partition-id": k, "num-partitions": 3}).train_labels) for k in range(3))
    if test_data == "federated":  # no server test set: the pooled validation splits are the evaluation
        assert rounds[0]["test"] == {} and rounds[1]["test"] == {} and "val_accuracy" in rounds[1]["val"]
    else:  # scored on the 8 images of test-data, so every accuracy is a multiple of 1/8
        assert all(float(r["test"]["accuracy"] * 8).is_integer() for r in rounds)


def test_site_folders_of_different_tasks_are_not_pooled(tmp_path):
    _png_folder(tmp_path / "s0", [1, 2, 3], [0, 1, 2])
    _png_folder(tmp_path / "s1", [4, 5, 6], [0, 1, 0], classes=("a", "b"))
    cfg = RunConfig.from_run_config({"method": "centralized", "dataset": f"sites:{tmp_path}", "mosaic-grid": 0,
                                     "test-data": "federated"})  # fmt: skip
    with pytest.raises(ValueError, match=r"their tasks differ: site 0: single-label, 4 classes.*site 1: single-label, 2 classes"):
        pooled_site_data(cfg, 2)


def test_a_run_on_site_folders_is_named_by_their_folder():
    assert run_dir_name("fedavg", "sites:/srv/data/hospital-a/").endswith("-fedavg-sites-hospital-a")


def test_one_flower_run_on_three_png_site_folders_keeps_each_sites_labels(tiny_run_superlink, tmp_path):
    """One real `flwr run` (the only one here, ~30-90 s): three SuperNodes on the three folders, FedAvg for
    one round; partition.json names each site by its folder and records the folder's own training label counts."""
    root = tmp_path / "hospital"
    _single_label_sites(root, sizes=(24, 18, 30))
    cfg = _cfg(root)
    results = tmp_path / "results"
    outcome = tiny_run_superlink.run_app({
        "method": "fedavg", "dataset": f"sites:{root}", "mosaic-grid": 0, "test-data": str(root / "server-test"),
        "val-fraction": 0.25, "num-server-rounds": 1, "batch-size": 16, "results-dir": str(results),
    }, num_supernodes=3)  # fmt: skip
    assert outcome.completed, outcome.output[-4000:]
    (run,) = results.iterdir()
    assert run.name.endswith("-fedavg-sites-hospital")
    partition = json.loads((run / "partition.json").read_text())
    assert partition["class-names"] == list(CLASSES)
    assert [s["site-name"] for s in sorted(partition["sites"], key=lambda s: s["site-id"])] == list(SITE_ORDER)
    for record, folder in zip(sorted(partition["sites"], key=lambda s: s["site-id"]), site_folders(cfg)):
        site = load_site(cfg, {"data-dir": str(folder), "site-id": record["site-id"], "num-sites": 3})
        assert record["label-counts"] == np.bincount(site.train_labels, minlength=len(CLASSES)).tolist()
        assert (record["train-size"], record["val-size"]) == (len(site.train_labels), len(site.val_labels))
    counts = [s["label-counts"] for s in sorted(partition["sites"], key=lambda s: s["site-id"])]
    assert [int(np.argmax(c)) for c in counts] == [0, 1, 2]  # the folders' own skew, not a re-split
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 1
