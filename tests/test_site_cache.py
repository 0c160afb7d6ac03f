"""A deployed site's decoded data is cached between messages (each runs in a fresh process), keyed by
its files and the decoding settings, and kept per site."""

import os

import numpy as np
import pytest
from PIL import Image

import fedskew.data.site_folder as site_folder
from fedskew.client_tasks import load_site
from fedskew.config import RunConfig
from fedskew.data.site_cache import IN_FOLDER, site_cache_dir

CFG = RunConfig.from_run_config({"method": "fedavg", "mosaic-grid": 0, "partition": "iid", "val-fraction": 0.0})


def _site(folder, labels=("0", "1", "1")):
    (folder / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for k in range(len(labels)):
        Image.fromarray(rng.integers(0, 255, (6, 6), dtype=np.uint8)).save(folder / "images" / f"{k}.png")
    (folder / "labels.csv").write_text("file,labels\n" + "".join(f"{k}.png,{y}\n" for k, y in enumerate(labels)))
    (folder / "classes.txt").write_text("a\nb\n")
    return folder


def _count_decodes(monkeypatch):
    calls = []
    real = site_folder.decode_image
    monkeypatch.setattr(site_folder, "decode_image", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_second_message_reads_the_cache_and_a_changed_file_or_setting_reads_the_folder_again(tmp_path, monkeypatch):
    folder = _site(tmp_path / "site")
    decodes = _count_decodes(monkeypatch)
    first = load_site(CFG, {"data-dir": str(folder)})
    assert len(decodes) == 3 and (folder / IN_FOLDER).is_dir()
    second = load_site(CFG, {"data-dir": str(folder)})
    assert len(decodes) == 3  # nothing decoded: the cached arrays
    np.testing.assert_array_equal(second.train_images, first.train_images)
    np.testing.assert_array_equal(second.train_labels, first.train_labels)
    assert second.class_names == first.class_names == ("a", "b")
    (folder / "labels.csv").write_text("file,labels\n0.png,1\n1.png,1\n2.png,0\n")
    os.utime(folder / "labels.csv", ns=(1, 1))  # a new mtime even on a coarse clock
    relabelled = load_site(CFG, {"data-dir": str(folder)})
    assert len(decodes) == 6 and relabelled.train_labels.tolist() == [1, 1, 0]
    load_site(CFG.model_copy(update={"image_size": 4}), {"data-dir": str(folder)})
    assert len(decodes) == 9
    assert len([p for p in (folder / IN_FOLDER).iterdir() if not p.name.startswith(".")]) == 1  # one entry per site


def test_the_cache_is_per_site_and_can_be_placed_or_turned_off(tmp_path, monkeypatch):
    a, b = _site(tmp_path / "a"), _site(tmp_path / "b", labels=("1", "0", "0"))
    decodes = _count_decodes(monkeypatch)
    load_site(CFG, {"data-dir": str(a), "cache-dir": "off"})
    load_site(CFG, {"data-dir": str(a), "cache-dir": "off"})
    assert len(decodes) == 6 and not (a / IN_FOLDER).exists()
    assert load_site(CFG, {"data-dir": str(b), "cache-dir": str(tmp_path / "cache-b")}).train_labels.tolist() == [1, 0, 0]
    assert any((tmp_path / "cache-b").iterdir())
    # A read-only data dir (e.g. a container's mount) caches under the user's cache, one folder per data dir.
    monkeypatch.setattr(os, "access", lambda *args: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    dirs = {site_cache_dir(d, {}) for d in (a, b)}
    assert len(dirs) == 2 and all(d.parent == tmp_path / "home-cache" / "fedskew" for d in dirs)


@pytest.mark.parametrize("damage", ["truncate", "remove-done"])
def test_a_damaged_cache_entry_is_read_again(tmp_path, monkeypatch, damage):
    folder = _site(tmp_path / "site")
    expected = load_site(CFG, {"data-dir": str(folder)}).train_images
    (entry,) = [p for p in (folder / IN_FOLDER).iterdir() if not p.name.startswith(".")]
    if damage == "truncate":
        (entry / "images.npy").write_bytes(b"\x93NUMPY")
    else:
        (entry / "done").unlink()
    np.testing.assert_array_equal(load_site(CFG, {"data-dir": str(folder)}).train_images, expected)
