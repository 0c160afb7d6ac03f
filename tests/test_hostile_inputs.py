"""Hostile or broken inputs at the edges of a run: run-config values of the wrong type, infinite or absurd,
a results-dir that climbs out, npz headers that declare more data than the file holds, image links out
of a site folder, model files with unknown header fields, and a resume that would leave released rounds
out of the privacy ledger. Each is refused with one message naming the input and what is valid."""

import io
import json
import math
import struct
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from test_predict import _fednca_file

from fedskew.cli import main as cli_main
from fedskew.config import ConfigError, RunConfig
from fedskew.data.site_folder import SiteFolderError, read_labelled_folder
from fedskew.data.sources import DataSourceError, read_npz
from fedskew.models.model_file import METADATA_KEY
from fedskew.privacy import earlier_releases
from fedskew.results import RunRecorder
from fedskew.server_tasks import resume_point

# --- run config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ({"num-server-rounds": True}, ["'num-server-rounds' = True", "an integer, not true/false"]),
        ({"factory.dp-noise-multiplier": True}, ["'factory.dp-noise-multiplier' = True", "a number, not true/false"]),
        ({"fednca.ladm": 1}, ["'fednca.ladm' = 1", "true or false"]),
        ({"allow-download": "yes"}, ["'allow-download' = 'yes'", "true or false"]),
        ({"round-timeout": math.inf}, ["'round-timeout' = inf", "finite number"]),
        ({"fednca.tau": math.nan}, ["'fednca.tau' = nan", "finite number"]),
        ({"round-timeout": 1e9}, ["'round-timeout' = 1000000000.0", "less than or equal to 2592000"]),
        ({"min-available-sites": 10**9}, ["'min-available-sites' = 1000000000", "less than or equal to 10000"]),
        ({"missing-classes": 10**9}, ["'missing-classes' = 1000000000", "less than or equal to 100000"]),
        ({"results-dir": "../elsewhere"}, ["'results-dir' = '../elsewhere'", "without '..' components"]),
        ({"results-dir": "/srv/runs/../../etc"}, ["'results-dir' = '/srv/runs/../../etc'", "without '..' components"]),
        ({"results-dir": "runs\\..\\..\\etc"}, ["'results-dir'", "without '..' components"]),
    ],
    ids=["true_as_rounds", "true_as_noise", "one_as_bool", "yes_as_bool", "inf_timeout", "nan_tau", "absurd_timeout",
         "absurd_min_sites", "absurd_missing_classes", "results_up", "results_up_absolute", "results_up_backslash"],
)
def test_a_value_of_the_wrong_type_infinite_absurd_or_climbing_out_is_refused_naming_key_and_what_is_valid(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_run_config(overrides)
    message = str(info.value)
    assert message.startswith("invalid run config: key ") and message.count("key '") == 1, message  # one problem
    for fragment in fragments:
        assert fragment in message, message


def test_toml_integers_for_integer_and_float_keys_and_plain_paths_still_parse():
    cfg = RunConfig.from_run_config(
        {"num-server-rounds": 3, "round-timeout": 1800, "min-available-sites": 10_000, "results-dir": "/srv/runs..old/x"}
    )
    assert (cfg.num_server_rounds, cfg.round_timeout, cfg.results_dir) == (3, 1800.0, "/srv/runs..old/x")


# --- npz headers -----------------------------------------------------------------------------------------


def _npy(array: np.ndarray, declared_shape: tuple[int, ...] | None = None) -> bytes:
    """A .npy member holding `array`'s data under a header declaring `declared_shape`."""
    out = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False, "shape": declared_shape or array.shape}
    np.lib.format.write_array_header_1_0(out, header)
    out.write(array.tobytes())
    return out.getvalue()


def _site_npz(folder, members: dict[str, bytes]):
    folder.mkdir()
    with zipfile.ZipFile(folder / "site.npz", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return folder / "site.npz"


HUGE = 2**40  # images a forged header claims


@pytest.mark.parametrize(
    "members",
    [
        # uint8 train + val: read in place into one buffer sized from the headers
        {"train_images.npy": _npy(np.zeros((1, 4, 4), np.uint8), (HUGE, 4, 4)), "val_images.npy": _npy(np.zeros((1, 4, 4), np.uint8)),
         "train_labels.npy": _npy(np.zeros(1, np.int64), (HUGE,)), "val_labels.npy": _npy(np.zeros(1, np.int64))},
        # float images: numpy's own reader, which allocates what the header declares
        {"train_images.npy": _npy(np.zeros((1, 4, 4), np.float32), (HUGE, 4, 4)), "train_labels.npy": _npy(np.zeros(1, np.int64))},
    ],
    ids=["uint8 read in place", "float read by numpy"],
)
def test_a_small_npz_whose_header_claims_2_to_the_40_images_is_refused_before_allocating(tmp_path, members):
    path = _site_npz(tmp_path / "site", members)
    assert path.stat().st_size < 1024
    with pytest.raises(SiteFolderError) as info:
        read_labelled_folder(tmp_path / "site", multilabel=None)
    assert str(path) in str(info.value) and f"'train_images.npy' declares a ({HUGE}, 4, 4)" in str(info.value)
    assert "holds 64 bytes of data" in str(info.value) or "holds 16 bytes of data" in str(info.value)


def test_a_member_whose_zip_entry_claims_more_bytes_than_the_file_can_hold_is_refused(tmp_path):
    # Header and zip entry agree on 2 GiB, but the member stores 16 bytes (no compression): the zip
    # entry's uncompressed size is forged in the central directory.
    claimed = 2**31
    npy = _npy(np.zeros(16, np.uint8), (claimed,))
    path = _site_npz(tmp_path / "site", {"train_images.npy": npy, "train_labels.npy": _npy(np.zeros(1, np.int64))})
    data = bytearray(path.read_bytes())
    entry = data.index(b"PK\x01\x02")  # the first member's central directory entry; its uncompressed size at +24
    data[entry + 24 : entry + 28] = struct.pack("<I", claimed + len(npy) - 16)
    path.write_bytes(bytes(data))
    with pytest.raises(DataSourceError, match=r"member 'train_images.npy' claims \d+ bytes from \d+ stored bytes"):
        read_npz(path)


@pytest.mark.parametrize(
    "member, content, reason",
    [
        ("notes.txt", b"hello", "member 'notes.txt' is not a .npy array"),
        ("class_names.npy", None, "member 'class_names.npy' holds Python objects"),
    ],
)
def test_an_npz_member_that_numpy_savez_never_writes_is_refused(tmp_path, member, content, reason):
    if content is None:  # an object array, as np.save writes it with pickling allowed
        out = io.BytesIO()
        np.save(out, np.array(["a", None], dtype=object), allow_pickle=True)
        content = out.getvalue()
    path = _site_npz(tmp_path / "site", {"train_images.npy": _npy(np.zeros((1, 4, 4), np.uint8)), member: content})
    with pytest.raises(DataSourceError, match=reason):
        read_npz(path)


# --- site folder links -----------------------------------------------------------------------------------


def _png(path, value: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((4, 4), value, np.uint8)).save(path)


def _site_with_link(tmp_path, target):
    site = tmp_path / "site"
    _png(site / "images" / "own.png", 10)
    (site / "images" / "linked.png").symlink_to(target)
    (site / "labels.csv").write_text("file,labels\nown.png,0\nlinked.png,1\n")
    return site


def test_an_image_link_leading_out_of_the_site_folder_is_refused_naming_file_and_line(tmp_path):
    _png(tmp_path / "elsewhere" / "secret.png", 200)
    site = _site_with_link(tmp_path, tmp_path / "elsewhere" / "secret.png")
    with pytest.raises(SiteFolderError, match=r"labels.csv line 3 names 'linked.png', a link to .*secret.png, outside the site folder"):
        read_labelled_folder(site, multilabel=None)


def test_an_images_folder_that_links_to_another_disk_is_refused(tmp_path):
    _png(tmp_path / "disk" / "own.png", 10)
    site = tmp_path / "site"
    site.mkdir()
    (site / "images").symlink_to(tmp_path / "disk", target_is_directory=True)
    (site / "labels.csv").write_text("file,labels\nown.png,0\n")
    with pytest.raises(SiteFolderError, match="line 2 names 'own.png', a link to .*outside the site folder"):
        read_labelled_folder(site, multilabel=None)


def test_an_image_link_inside_the_site_folder_is_read(tmp_path):
    _png(tmp_path / "site" / "originals" / "x.png", 90)
    data = read_labelled_folder(_site_with_link(tmp_path, tmp_path / "site" / "originals" / "x.png"), multilabel=None, num_classes=2)
    assert data.images[:, 0, 0, 0].tolist() == pytest.approx([10 / 255, 90 / 255])


# --- model files -----------------------------------------------------------------------------------------


def test_predict_on_a_model_file_with_an_unknown_header_field_exits_2_with_one_line(tmp_path, capsys):
    _, path = _fednca_file(tmp_path)
    with safe_open(str(path), framework="pt") as handle:
        header = json.loads(handle.metadata()[METADATA_KEY])
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    forged = tmp_path / "forged.safetensors"
    save_file(tensors, str(forged), metadata={METADATA_KEY: json.dumps({**header, "trained_on": "ward 7"})})
    _png(tmp_path / "scans" / "a.png", 50)
    assert cli_main(["predict", str(forged), "--input", str(tmp_path / "scans"), "--out", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert str(forged) in err and "unknown field(s) 'trained_on'" in err and "known fields: format, decision, method" in err


# --- privacy ledger across resume ------------------------------------------------------------------------

PLAIN = {"method": "fedavg", "mosaic-grid": 0, "partition": "iid", "aggregation": "unweighted"}
CENTRAL_DP = {**PLAIN, "dp.mode": "central-server-clipping"}


def _earlier_run(tmp_path, overrides: dict):
    earlier = RunRecorder.create(RunConfig.from_run_config(overrides), multilabel=False, base=tmp_path / "earlier")
    earlier.save_checkpoint({"w": torch.ones(2)}, server_round=2)
    (earlier.path / "metrics.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in (1, 2)))
    return earlier.path


@pytest.mark.parametrize(
    "before, after, change",
    [
        (PLAIN, CENTRAL_DP, "dp.mode: 'off' -> 'central-server-clipping'"),
        (CENTRAL_DP, PLAIN, "dp.mode: 'central-server-clipping' -> 'off'"),
        (CENTRAL_DP, {**CENTRAL_DP, "dp.noise-multiplier": 2.0}, "dp.noise-multiplier: 1.0 -> 2.0"),
    ],
)
def test_a_resume_under_other_dp_settings_is_refused_naming_them(tmp_path, before, after, change):
    earlier = _earlier_run(tmp_path, before)
    resumed = RunConfig.from_run_config({**after, "resume-from": str(earlier)})
    with pytest.raises(ValueError, match=f"released its rounds under other DP settings.*{change}"):
        resume_point(resumed, RunRecorder.create(resumed, multilabel=False, base=tmp_path / "new"), {"w": torch.zeros(2)})


def test_a_resume_under_the_same_dp_settings_continues_the_ledger_and_one_without_a_ledger_is_refused(tmp_path):
    earlier = _earlier_run(tmp_path, CENTRAL_DP)
    resumed = RunConfig.from_run_config({**CENTRAL_DP, "resume-from": str(earlier)})
    assert resume_point(resumed, RunRecorder.create(resumed, multilabel=False, base=tmp_path / "new"), {"w": torch.zeros(2)})[0] == 2
    summary = json.loads((earlier / "summary.json").read_text()) if (earlier / "summary.json").is_file() else {}
    (earlier / "summary.json").write_text(json.dumps({**summary, "privacy": {"mode": "central-server-clipping", "noise_multipliers": [1.0, 0.5]}}))
    assert earlier_releases(str(earlier), "central-server-clipping") == [1.0, 0.5]
    (earlier / "summary.json").write_text(json.dumps({**summary, "privacy": {}}))
    with pytest.raises(ValueError, match="holds no privacy ledger of dp.mode = 'central-server-clipping'"):
        earlier_releases(str(earlier), "central-server-clipping")
