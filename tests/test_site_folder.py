"""Site data folders: what prepare-sites writes is what a deployed site reads (the same partition and
validation split as simulation), and a missing, empty or malformed folder is a clear error."""

import csv
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from fedskew.cli import main as cli_main
from fedskew.client_tasks import load_site, site_survey
from fedskew.config import ConfigError, RunConfig
from fedskew.data.site_folder import (
    permute_rows_in_place,
    DeployedSite,
    SiteFolderError,
    load_test_set,
    prepare_sites,
    read_labelled_folder,
    write_labelled_folder,
)
from fedskew.data.sites import load_task_dataset, simulated_site
from fedskew.data.sources import DataSourceError
from fedskew.metrics import THRESHOLD_GRID
from fedskew.results import RunRecorder
from multihot_npz import CLASS_NAMES, write_multihot_npz

from fedskew.server_tasks import agreed_task_shape, load_server_test_set, make_evaluate_fn, resume_point

CFG = RunConfig.from_run_config({"method": "fedavg", "val-fraction": 0.2})
SINGLE = RunConfig.from_run_config({"method": "fedavg", "mosaic-grid": 0, "partition": "iid"})
PNG_STEP = 1 / 255


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("sites")
    prepare_sites(CFG, 3, out / "png", "png")
    prepare_sites(CFG, 3, out / "npz", "npz")
    return out


@pytest.mark.parametrize("fmt, tolerance", [("png", PNG_STEP / 2 + 1e-6), ("npz", 0.0)])
def test_a_prepared_site_reads_back_as_its_simulated_twin(prepared, fmt, tolerance):
    for k in range(3):
        deployed = load_site(CFG, {"data-dir": str(prepared / fmt / f"site-{k}"), "site-id": k, "num-sites": 3})
        simulated = simulated_site(CFG, k, 3)
        assert isinstance(deployed, DeployedSite) and (deployed.site_id, deployed.num_sites) == (k, 3)
        np.testing.assert_array_equal(deployed.train_labels, simulated.train_labels)
        np.testing.assert_array_equal(deployed.val_labels, simulated.val_labels)
        assert np.abs(deployed.train_images - simulated.train_images).max() <= tolerance
        assert np.abs(deployed.val_images - simulated.val_images).max() <= tolerance
        assert deployed.class_names == simulated.class_names and deployed.num_classes == 10


def test_the_server_test_folder_holds_the_test_split(prepared):
    dataset = load_task_dataset(CFG)
    test = load_test_set(CFG, prepared / "npz" / "server-test")
    np.testing.assert_array_equal(test.test_images, dataset.test_images)
    np.testing.assert_array_equal(test.test_labels, dataset.test_labels)
    assert len(test.train_images) == 0 and test.image_shape == dataset.image_shape


def test_a_deployed_sites_survey_reports_no_partition_and_the_task_shape(prepared):
    site = load_site(CFG, {"data-dir": str(prepared / "png" / "site-1"), "site-id": 1, "num-sites": 3})
    survey = site_survey(CFG, site)
    assert survey["unassigned"] == 0 and survey["num-classes"] == 10 and survey["image-shape"] == [1, 16, 16]
    assert sum(survey["label-counts"]) == site.train_labels.sum()


def test_prepare_sites_cli_writes_folders_and_refuses_to_overwrite(tmp_path, capsys):
    args = ["prepare-sites", "--sites", "2", "--mosaic-grid", "0", "--partition", "dirichlet", "--alpha", "0.5",
            "--out", str(tmp_path), "--format", "npz"]  # fmt: skip
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    assert "site-0" in printed and "server-test" in printed and "data-dir=" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server-test", "site-0", "site-1"]
    cfg = RunConfig.from_run_config({"mosaic-grid": 0, "partition": "dirichlet", "alpha": 0.5, "method": "fedavg"})
    site = load_site(cfg, {"data-dir": str(tmp_path / "site-1"), "site-id": 1, "num-sites": 2})
    twin = simulated_site(cfg, 1, 2)
    np.testing.assert_array_equal(site.train_labels, twin.train_labels)
    assert cli_main(args) == 2
    assert "already holds non-empty" in capsys.readouterr().err
    assert cli_main(["prepare-sites", "--sites", "2", "--out", str(tmp_path / "x"), "--alpha", "-1"]) == 2
    assert "key 'alpha' = -1.0 is invalid" in capsys.readouterr().err


# --- hand-made folders ---------------------------------------------------------------------------------


def _png_site(folder, rows, classes=None, size=4, header=("file", "labels")):
    (folder / "images").mkdir(parents=True)
    for name, _ in rows:
        Image.fromarray(np.full((size, size), 128, dtype=np.uint8)).save(folder / "images" / name)
    with (folder / "labels.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([header, *rows])
    if classes:
        (folder / "classes.txt").write_text("\n".join(classes) + "\n")
    return folder


def test_a_multilabel_png_folder_reads_ids_into_multi_hot_over_all_classes(tmp_path):
    site = _png_site(tmp_path, [("a.png", "0|2"), ("b.png", ""), ("c.png", "1")], classes=["x", "y", "z", "w"])
    data = read_labelled_folder(site, multilabel=True)
    np.testing.assert_array_equal(data.labels, [[1, 0, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0]])
    assert data.images.shape == (3, 1, 4, 4) and np.allclose(data.images, 128 / 255)
    assert data.class_names == ("x", "y", "z", "w")
    # Without classes.txt the run config names the label space; the site may lack the highest classes.
    (site / "classes.txt").unlink()
    assert read_labelled_folder(site, multilabel=True, num_classes=6).labels.shape == (3, 6)
    assert read_labelled_folder(site, multilabel=True, num_classes=6, image_size=8).images.shape == (3, 1, 8, 8)


@pytest.mark.parametrize(
    "rows, classes, header, message",
    [
        ([("a.png", "1")], ["x", "y"], ("name", "label"), "line 1 is ['name', 'label']; expected the header 'file,labels'"),
        ([("a.png", "0"), ("b.png", "one")], ["x", "y"], None, "line 3: labels 'one' are not class ids"),
        ([("a.png", "0"), ("b.png", "5")], ["x", "y"], None, "line 3: class id 5 is out of range; there are 2 classes, valid ids: 0..1"),
        ([("a.png", "0"), ("a.png", "1")], ["x", "y"], None, "line 3: 'a.png' is already labelled on line 2"),
        ([("../a.png", "0")], ["x", "y"], None, "line 2: file '../a.png' is not a plain path under images/"),
        ([("a.png", "0")], None, None, "the number of classes is unknown"),
        ([], ["x", "y"], None, "has a header but no rows"),
    ],
)
def test_a_malformed_labels_csv_names_the_line_and_what_is_valid(tmp_path, rows, classes, header, message):
    site = _png_site(tmp_path, rows, classes=classes, **({"header": header} if header else {}))
    with pytest.raises(SiteFolderError, match="labels.csv|number of classes") as err:
        read_labelled_folder(site, multilabel=True)
    assert message in str(err.value)


def test_a_single_label_run_refuses_several_labels_on_one_line(tmp_path):
    site = _png_site(tmp_path, [("a.png", "0"), ("b.png", "0|1")], classes=["x", "y"])
    with pytest.raises(SiteFolderError, match=r"line 3: labels '0\|1' are not exactly one class id.*single-label"):
        read_labelled_folder(site, multilabel=False)
    assert read_labelled_folder(site, multilabel=True).labels.shape == (2, 2)


def test_missing_unlabelled_unreadable_and_mismatched_images_are_named(tmp_path):
    site = _png_site(tmp_path / "a", [("a.png", "0"), ("b.png", "1")], classes=["x", "y"])
    (site / "images" / "b.png").unlink()
    with pytest.raises(SiteFolderError, match=r"line 3 names 'b.png', but .*b.png does not exist"):
        read_labelled_folder(site, multilabel=False)
    site = _png_site(tmp_path / "b", [("a.png", "0")], classes=["x", "y"])
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(site / "images" / "stray.png")
    with pytest.raises(SiteFolderError, match=r"holds 1 file\(s\) that labels.csv does not label \(e.g. stray.png\)"):
        read_labelled_folder(site, multilabel=False)
    site = _png_site(tmp_path / "c", [("a.png", "0"), ("b.png", "1")], classes=["x", "y"])
    (site / "images" / "b.png").write_bytes(b"not a png")
    with pytest.raises(SiteFolderError, match=r"b.png \(line 3 of .*\) is not a readable image"):
        read_labelled_folder(site, multilabel=False)
    site = _png_site(tmp_path / "d", [("a.png", "0"), ("b.png", "1")], classes=["x", "y"])
    Image.fromarray(np.zeros((5, 5, 3), np.uint8)).save(site / "images" / "b.png")
    with pytest.raises(SiteFolderError, match=r"has shape \(3, 5, 5\) \(C, H, W\) but the image on line 2 has \(1, 4, 4\)"):
        read_labelled_folder(site, multilabel=False)


def test_a_missing_empty_or_ambiguous_data_dir_is_a_clear_error_at_load_site(tmp_path):
    with pytest.raises(SiteFolderError, match=r"site data dir .*nowhere does not exist"):
        load_site(CFG, {"data-dir": str(tmp_path / "nowhere")})
    with pytest.raises(SiteFolderError, match=r"has no labels.csv and no site.npz \(found: nothing\); valid: 'images/'"):
        load_site(CFG, {"data-dir": str(tmp_path)})
    (tmp_path / "labels.csv").write_text("file,labels\n")
    (tmp_path / "site.npz").write_bytes(b"")
    with pytest.raises(SiteFolderError, match="holds both labels.csv and site.npz; keep exactly one layout"):
        load_site(CFG, {"data-dir": str(tmp_path)})
    with pytest.raises(SiteFolderError, match=r"site-id = 3 with num-sites = 3; valid site ids: 0..2"):
        load_site(CFG, {"data-dir": str(tmp_path), "site-id": 3, "num-sites": 3})


def test_a_site_npz_must_match_the_runs_label_kind(tmp_path):
    images, labels = np.random.default_rng(0).random((6, 1, 4, 4), dtype=np.float32), np.arange(6) % 3
    write_labelled_folder(tmp_path / "single", images, labels, ("a", "b", "c"), "npz")
    with pytest.raises(SiteFolderError, match="holds class ids but run-config labels = 'multi'; set labels to 'auto'"):
        read_labelled_folder(tmp_path / "single", multilabel=True)
    assert read_labelled_folder(tmp_path / "single", multilabel=None).labels.ndim == 1  # auto: the file tells
    data = read_labelled_folder(tmp_path / "single", multilabel=False)
    np.testing.assert_array_equal(data.images, images)
    np.testing.assert_array_equal(data.labels, labels)
    with pytest.raises(SiteFolderError, match="run-config num-classes = 4 but class names = 3; they must agree"):
        read_labelled_folder(tmp_path / "single", multilabel=False, num_classes=4)
    with pytest.raises(SiteFolderError, match="exists and is not empty"):
        write_labelled_folder(tmp_path / "single", images, labels, ("a", "b", "c"))


def test_a_corrupted_medmnist_file_at_a_site_fails_its_md5_check(tmp_path):
    cfg = RunConfig.from_run_config({"method": "fedavg", "dataset": "medmnist:pathmnist", "mosaic-grid": 0, "partition": "iid"})
    np.savez(tmp_path / "pathmnist.npz", train_images=np.zeros((2, 28, 28, 3), np.uint8))
    with pytest.raises(DataSourceError, match=r"pathmnist.npz has MD5 [0-9a-f]{32} but the official pathmnist.npz has MD5"):
        load_site(cfg, {"data-dir": str(tmp_path)})
    with pytest.raises(DataSourceError, match="MD5"):
        load_site(cfg, {"data-dir": str(tmp_path), "partition-id": 0, "num-partitions": 2})


# --- the server's side of a deployment -------------------------------------------------------------------


def test_server_test_data_by_run_config(prepared):
    assert load_server_test_set(CFG.model_copy(update={"test_data": "federated"})) is None
    assert load_server_test_set(CFG).name == load_task_dataset(CFG).name
    folder = load_server_test_set(CFG.model_copy(update={"test_data": str(prepared / "png" / "server-test")}))
    assert folder.num_classes == 10 and len(folder.test_labels) == len(load_task_dataset(CFG).test_labels)
    with pytest.raises(ValueError, match="key 'num-classes' = 7 is invalid"):
        load_server_test_set(CFG.model_copy(update={"num_classes": 7}))


def _survey(k=10, shape=(1, 16, 16), multilabel=1, names=None):
    return {"num-classes": k, "image-shape": list(shape), "multilabel": multilabel,
            "class-names": list(names or [str(c) for c in range(k)])}  # fmt: skip


def test_the_task_shape_comes_from_agreeing_sites_or_the_server_test_data():
    survey = {11: _survey(), 12: _survey()}
    shape, refused = agreed_task_shape(CFG, survey, None)
    assert (shape.num_classes, shape.image_shape, shape.multilabel, refused) == (10, (1, 16, 16), True, {})
    test = load_task_dataset(CFG)
    assert agreed_task_shape(CFG, survey, test) == (test, {})
    with pytest.raises(RuntimeError, match="no site answered the survey"):
        agreed_task_shape(CFG, {}, None)


def test_a_site_whose_label_kind_or_label_space_differs_is_refused_and_the_rest_go_on():
    test = load_task_dataset(CFG)
    survey = {11: _survey(), 12: _survey(k=9), 13: _survey(multilabel=0), 14: _survey(shape=(3, 16, 16))}
    task, refused = agreed_task_shape(CFG, survey, test)
    assert task is test and sorted(refused) == [12, 13, 14]
    assert "it has 9 classes but the run has 10" in refused[12]
    assert "its data is single-label but the run is multi-label" in refused[13]
    assert "its images are (3, 16, 16) (C, H, W) but the run's are (1, 16, 16)" in refused[14]
    # Without server test data the majority defines the task (the config's label kind first); class
    # names count when both sides name their classes.
    auto = RunConfig.from_run_config({"dataset": "npz:own.npz", "mosaic-grid": 0, "test-data": "federated"})
    names, other = ["a", "b", "c", "d", "e"], ["a", "b", "c", "d", "x"]
    survey = {1: _survey(k=5, names=names), 2: _survey(k=5), 3: _survey(k=4), 4: _survey(k=5, names=other), 5: _survey(k=5, names=names)}
    task, refused = agreed_task_shape(auto, survey, None)
    assert task.class_names == tuple(names) and sorted(refused) == [3, 4]
    assert "class names ['a', 'b', 'c', 'd', 'x'] differ from the run's ['a', 'b', 'c', 'd', 'e']" in refused[4]
    with pytest.raises(ValueError, match="every site was refused"):
        agreed_task_shape(CFG, {12: _survey(k=9)}, test)
    # Sites that agree on single-label data cannot run a multi-label method: one clear error.
    with pytest.raises(ConfigError, match="the sites' majority holds single-label data.*'method' = 'fednca'"):
        agreed_task_shape(auto, {1: _survey(multilabel=0)}, None)


def _write_csv_site(folder, rows, side=4):
    (folder / "images").mkdir(parents=True)
    for name, _ in rows:
        Image.fromarray(np.zeros((side, side), np.uint8)).save(folder / "images" / name)
    (folder / "labels.csv").write_text("file,labels\n" + "".join(f"{n},{lab}\n" for n, lab in rows))
    (folder / "classes.txt").write_text("a\nb\nc\n")
    return folder


def test_with_labels_auto_a_site_folder_tells_its_label_kind(tmp_path):
    multi = _write_csv_site(tmp_path / "multi", [("1.png", "0|2"), ("2.png", "1")])
    single = _write_csv_site(tmp_path / "single", [("1.png", "0"), ("2.png", "2")])
    assert read_labelled_folder(multi, multilabel=None).labels.tolist() == [[1, 0, 1], [0, 1, 0]]
    assert read_labelled_folder(single, multilabel=None).labels.tolist() == [0, 2]
    auto = RunConfig.from_run_config({"dataset": "npz:own.npz", "mosaic-grid": 0})
    assert site_survey(auto, load_site(auto, {"data-dir": str(multi)}))["multilabel"] == 1
    assert site_survey(auto, load_site(auto, {"data-dir": str(single)}))["multilabel"] == 0
    # labels = 'multi' reads one id per row as a one-hot row (a multi-label site where each image has one label).
    explicit = auto.model_copy(update={"labels": "multi"})
    assert load_site(explicit, {"data-dir": str(single)}).train_labels.ndim == 2


def test_federated_evaluation_records_the_sites_validation_metrics(tmp_path):
    from flwr.app import ArrayRecord

    recorder = RunRecorder.create(CFG, multilabel=True, base=tmp_path)
    # One class, two validation positives summed over the sites: up to 0.30 two false positives come along,
    # from 0.35 to 0.45 the predictions are exact, from 0.50 both positives are missed.
    counts = np.array([[[2, 2, 0]] if t <= 0.3 else [[2, 0, 0]] if t <= 0.45 else [[0, 0, 2]] for t in THRESHOLD_GRID])
    metrics = lambda: ({"train_loss": 0.5}, {"num-examples": 4.0}, counts)  # noqa: E731
    # Aggregation can hand back a float64 tensor for a float32 (or integer) buffer: the checkpoint keeps the model's dtype.
    aggregated = ArrayRecord({"weight": torch.ones(1, 1, dtype=torch.float64), "bias": torch.ones(1)})
    evaluate_fn = make_evaluate_fn(torch.nn.Linear(1, 1), None, torch.device("cpu"), recorder, metrics)
    assert len(evaluate_fn(1, aggregated)) == 0
    (entry,) = recorder.rounds
    # The round's threshold: the exact range's point nearest 0.5; the F1 derived from the summed counts at it.
    assert entry["threshold"] == 0.45 and entry["test"] == {} and entry["train"]["train_loss"] == 0.5
    assert entry["val"] == {"num-examples": 4.0, "val_f1_macro": 1.0, "val_f1_micro": 1.0, "val_f1_macro_at_0.5": 0.0}
    assert json.loads((recorder.path / "checkpoint.json").read_text())["round"] == 1
    assert load_file(recorder.path / "model.safetensors")["weight"].dtype == torch.float32
    # A resumed run continues the numbering and does not record its starting model again.
    resumed = make_evaluate_fn(torch.nn.Linear(1, 1), None, torch.device("cpu"), recorder, metrics, round_offset=1)
    resumed(0, aggregated)
    resumed(1, aggregated)
    assert [r["round"] for r in recorder.rounds] == [1, 2]


def test_resuming_with_a_different_partition_is_refused_naming_the_setting(tmp_path):
    earlier = RunRecorder.create(RunConfig.from_run_config({"method": "fednca"}), multilabel=True, base=tmp_path)
    earlier.save_checkpoint({"w": torch.ones(2)}, server_round=2)
    changed = RunConfig.from_run_config({"method": "fednca", "alpha": 0.5, "resume-from": str(earlier.path)})
    recorder = RunRecorder.create(changed, multilabel=True, base=tmp_path / "new")
    with pytest.raises(ValueError, match=r"settings differ from the earlier run's: alpha: 0.1 -> 0.5"):
        resume_point(changed, recorder, {})
    assert not (recorder.path / "metrics.jsonl").exists()  # nothing adopted from the refused run


def test_a_run_saved_before_feature_side_resumes_as_the_one_stage_network_it_trained(tmp_path):
    # Its config.json has no feature-side (the small CNN then had one stride-2 stage) and still holds the
    # retired fednca.warmup-fraction: it reads as feature-side 0, so only a run with 0 may continue it.
    earlier = RunRecorder.create(RunConfig.from_run_config({"method": "fednca"}), multilabel=True, base=tmp_path)
    earlier.save_checkpoint({"w": torch.ones(2)}, server_round=2)
    saved = json.loads((earlier.path / "config.json").read_text())
    del saved["feature-side"], saved["fednca.warmup-epochs"]
    (earlier.path / "config.json").write_text(json.dumps({**saved, "fednca.warmup-fraction": 0.1}))
    (earlier.path / "metrics.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in (1, 2)))
    default = RunConfig.from_run_config({"method": "fednca", "resume-from": str(earlier.path)})
    with pytest.raises(ValueError, match=r"settings differ from the earlier run's: feature-side: 0 -> 8$"):
        resume_point(default, RunRecorder.create(default, multilabel=True, base=tmp_path / "a"), {})
    same = RunConfig.from_run_config({"method": "fednca", "feature-side": 0, "resume-from": str(earlier.path)})
    done, state = resume_point(same, RunRecorder.create(same, multilabel=True, base=tmp_path / "b"), {"w": torch.zeros(2)})
    assert done == 2 and torch.equal(state["w"], torch.ones(2))


class _LostGrid:
    """A Grid whose SuperLink connection is gone."""

    def get_node_ids(self):
        raise ConnectionError("SuperLink unreachable")


def test_a_serverapp_exception_ends_the_run_as_failed_with_the_reason_in_its_results(tmp_path):
    from flwr.app import Context, RecordDict

    from fedskew.server_app import main

    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"method": "fedavg", "results-dir": str(tmp_path)})  # fmt: skip
    with pytest.raises(ConnectionError):
        main(_LostGrid(), context)
    (run,) = tmp_path.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == "ConnectionError: SuperLink unreachable"


def test_a_multi_hot_npz_is_read_as_multi_label_and_checked_against_the_config_when_loaded(tmp_path):
    path = write_multihot_npz(tmp_path / "own.npz")
    auto = {"dataset": f"npz:{path}", "mosaic-grid": 0, "min-site-size": 5}
    dataset = load_task_dataset(RunConfig.from_run_config(auto))
    assert dataset.multilabel and dataset.class_names == CLASS_NAMES and dataset.train_labels.shape == (270, 6)
    with pytest.raises(ConfigError, match=r"own.npz' holds multi-label data.*'method' = 'factory' is invalid"):
        load_task_dataset(RunConfig.from_run_config({**auto, "method": "factory", "partition": "iid"}))
    with pytest.raises(ConfigError, match=r"'mosaic-grid' = 2 is invalid for dataset .*already multi-label.*valid: 0"):
        load_task_dataset(RunConfig.from_run_config({**auto, "mosaic-grid": 2}))
    # prepare-sites writes '|'-joined rows, which a site with labels = 'auto' reads back as multi-label.
    assert cli_main(["prepare-sites", "--sites", "2", "--dataset", f"npz:{path}", "--mosaic-grid", "0",
                     "--min-site-size", "5", "--out", str(tmp_path / "sites")]) == 0  # fmt: skip
    site = load_site(RunConfig.from_run_config(auto), {"data-dir": str(tmp_path / "sites" / "site-0")})
    assert site.multilabel and site.class_names == CLASS_NAMES


@given(st.integers(0, 40).flatmap(lambda n: st.permutations(range(n))))
def test_rows_reordered_in_place_equal_fancy_indexing(order):
    # A deployed site splits its images by reordering them in place (no second copy of a large site):
    # it must give exactly what indexing gives, also on the non-contiguous (N, C, H, W) view of NHWC pixels.
    pixels = np.arange(len(order) * 2 * 3 * 3, dtype=np.uint8).reshape(len(order), 2, 3, 3)
    images = pixels.transpose(0, 3, 1, 2)
    expected = images[np.asarray(order, dtype=np.int64)].copy()
    permute_rows_in_place(images, np.asarray(order, dtype=np.int64))
    np.testing.assert_array_equal(images, expected)
