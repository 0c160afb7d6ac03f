"""report.html from a results directory (built here by RunRecorder, as a run builds it), rendered in a real
headless Chromium; and TensorBoard event files from the same records."""

import base64
import io
import json
import re
import subprocess

import numpy as np
import pytest
from PIL import Image

from system_tools import require_tool

from fedskew.cli import main as cli_main
from fedskew.config import ConfigError, RunConfig
from fedskew.report import REPORT, write_report
from fedskew.results import RunRecorder, open_tensorboard, write_json

CLASSES = ["a", "b", "c"]
DATA_IMAGE = re.compile(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


def fake_run(base, method="fednca", multilabel=True, rounds=3, log_tensorboard=False):
    """A small results directory written through RunRecorder, with the files a real run adds."""
    cfg = RunConfig.from_run_config(
        {"method": method, "log-tensorboard": log_tensorboard}
        | ({} if multilabel else {"mosaic-grid": 0, "partition": "classes-per-site"})
    )
    recorder = RunRecorder.create(cfg, multilabel=multilabel, base=base)
    sites = [{"site-id": k, "train-size": 20, "val-size": 2, "label-counts": [5 + k, 3, 0 + 4 * k]} for k in range(3)]
    if multilabel:
        for site in sites:
            site["cooccurrence"] = np.diag(site["label-counts"]).tolist()
    write_json(recorder.path / "partition.json", {"sites": sites, "unassigned": 0, "class-names": CLASSES})
    for r in range(rounds + 1):
        score = 0.5 + 0.1 * r
        if multilabel:
            test = {"f1_macro": score, "auc_macro": score + 0.05, "map": score, "per_class_f1": [score] * 3,
                    "per_class_auc": [score + 0.05, float("nan"), score]}  # fmt: skip
            val = {"val_f1_macro": score - 0.05, "unit-weight": 1.0}
        else:
            test = {"accuracy": score, "balanced_accuracy": score, "auroc_macro": score, "per_class_recall": [score] * 3}
            val = {"val_accuracy": score - 0.05}
        train = {"train_loss": 2.0 / (r + 1), "train_seconds": 0.1, "etf-crc32": 12345.0} if r else {}
        recorder.record_round(r, test, train=train, val=val if r else {})
    for k in range(3):
        recorder.count_bytes("sent", str(1000 + k), 4_000_000)
        recorder.count_bytes("received", str(1000 + k), 2_000_000)
    recorder.record_dropout(2, "1002", "site data folder missing")
    if method.startswith("factory"):
        recorder.extra["factory"] = {
            "modules": [{"module-id": f"site{k}-class{k}", "site-id": k, "classes": [k], "image-counts": [20],
                         "checksum": "0" * 64, "memorization": 0.0 if k else None} for k in range(3)],
            "rejected": [], "missing_classes": [], "missing_class_names": [],
        }  # fmt: skip
        (recorder.path / "samples").mkdir()
        grid = np.random.default_rng(0).integers(0, 255, (24, 24, 3), dtype=np.uint8)
        Image.fromarray(grid).save(recorder.path / "samples" / "all-classes.png")
    recorder.write_summary("completed")
    return recorder


def embedded_images(page: str) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(data))) for data in DATA_IMAGE.findall(page)]


def test_a_run_report_is_one_self_contained_page_with_every_section(tmp_path):
    run = fake_run(tmp_path).path
    page = write_report(run).read_text()
    assert (run / REPORT).is_file()
    for section in ("Test metrics", "Learning curves", "Per-class test metrics at round 3", "Partition",
                    "Bytes per site", "Dropped sites", "site data folder missing", "Run config", "fednca.tau"):  # fmt: skip
        assert section in page, section
    # Every image is embedded and decodes; nothing is fetched from anywhere else; no script runs.
    images = embedded_images(page)
    assert len(images) == page.count("<img") == 5  # curves, per-class bars, label counts, co-occurrence, bytes
    assert all(image.format == "PNG" and image.size[0] > 100 for image in images)
    assert not re.search(r"""(src|href)=["'](?!data:)""", page) and "<script" not in page
    assert "12345" not in page  # the averaged ETF checksum is bookkeeping, not a curve


def test_a_run_that_failed_before_its_first_round_still_gets_a_page_with_the_reason(tmp_path):
    # The ServerApp writes the report on its failure path too; a run dir with only config and summary must do.
    recorder = RunRecorder.create(RunConfig(), multilabel=True, base=tmp_path)
    recorder.write_summary("failed", reason="ValueError: site data folder missing")
    page = write_report(recorder.path).read_text()
    assert 'class="status-failed"' in page and "site data folder missing" in page
    assert "No rounds recorded" in page and "No partition recorded" in page and "fednca.tau" in page


def test_a_factory_report_shows_sample_grids_and_memorisation_scores(tmp_path):
    run = fake_run(tmp_path, method="factory", multilabel=False).path
    page = write_report(run).read_text()
    assert "Memorisation score" in page and "site2-class2" in page and "n/a" in page  # site 0: not audited
    assert "Synthetic samples" in page and "Per-class test metrics" in page and "accuracy" in page
    sample_grid = (run / "samples" / "all-classes.png").read_bytes()
    assert base64.b64encode(sample_grid).decode() in page


def test_a_comparison_folder_gets_a_side_by_side_page_and_each_run_its_own(tmp_path):
    folder = tmp_path / "compare"
    for name, seeds in (("fedavg", (0, 1)), ("fednca", (0,))):
        for seed in seeds:
            fake_run(folder / "runs" / f"{name}-seed{seed}", method=name)
    (folder / "results.md").write_text("Command: x\n\n| method | f1_macro |\n|---|---|\n| fedavg | 0.8 |\n| fednca | 0.9 |\n")
    page = write_report(folder).read_text()
    assert "<td>fedavg</td><td>2</td><td>2</td>" in page and "<td>fednca</td><td>1</td><td>1</td>" in page
    assert "<td>0.9</td>" in page  # results.md's table, as HTML
    links = re.findall(r'<a href="([^"]+)">', page)
    assert len(links) == 3 and all((folder / link).is_file() for link in links)
    assert len(embedded_images(page)) == 2  # test curve per method, per-class bars


def test_fedskew_report_rebuilds_the_page_and_refuses_a_folder_that_is_no_run(tmp_path, capsys):
    run = fake_run(tmp_path).path
    assert cli_main(["report", str(run)]) == 0 and (run / REPORT).is_file()
    assert cli_main(["report", str(tmp_path / "empty")]) == 2
    assert "not a results directory" in capsys.readouterr().err


# --- a real browser ------------------------------------------------------------------------------------

# Appended to a copy of the page: reports every image that did not decode and every element that would load
# something from outside, then says how many images rendered.
PROBE = """<script>
window.addEventListener("load", () => {
  const broken = [...document.images].filter(img => !img.complete || img.naturalWidth === 0);
  const external = document.querySelectorAll("link[href], script[src], img:not([src^='data:']), iframe, object");
  broken.forEach(img => console.error("image did not render: " + img.alt));
  if (external.length) console.error("external resources: " + external.length);
  console.log("probe: " + document.images.length + " images rendered");
});
</script>"""


def render(page_path, screenshot, tmp_path) -> list[str]:
    """Load the page in headless Chromium, save a screenshot, return the page's console messages."""
    result = subprocess.run(
        [require_tool("chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
         "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,2400", f"--screenshot={screenshot}",
         page_path.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert screenshot.is_file(), result.stderr[-3000:]
    return re.findall(r":CONSOLE[^\]]*\] \"(.*)\", source:", result.stderr)


def test_the_report_renders_in_headless_chromium_without_errors_and_is_not_blank(tmp_path):
    require_tool("chromium")
    run = fake_run(tmp_path, method="factory", multilabel=False).path
    page = write_report(run).read_text()
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"))
    # The probe must see what it is for: a page with a broken image gets an error line.
    broken = tmp_path / "broken.html"
    broken.write_text('<html><body><img alt="x" src="data:image/png;base64,AAAA">' + PROBE + "</body></html>")
    assert any("image did not render" in m for m in render(broken, tmp_path / "broken.png", tmp_path))

    messages = render(probed, tmp_path / "shot.png", tmp_path)
    images = page.count("<img")
    assert messages == [f"probe: {images} images rendered"], messages
    shot = np.asarray(Image.open(tmp_path / "shot.png").convert("RGB"), dtype=np.float64)
    assert shot.std() > 20, "the screenshot is (nearly) one colour"
    # The embedded figures are in colour; text on white alone would leave almost no saturated pixels.
    saturation = shot.max(axis=2) - shot.min(axis=2)
    assert (saturation > 60).mean() > 0.01


# --- TensorBoard ---------------------------------------------------------------------------------------


def test_tensorboard_gets_one_scalar_per_metric_per_round(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recorder = fake_run(tmp_path, rounds=2, log_tensorboard=True)
    events = EventAccumulator(str(recorder.path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"test/f1_macro", "test/auc_macro", "test/map", "val/val_f1_macro", "train/train_loss",
            "time/round_seconds"} <= tags  # fmt: skip
    assert not {t for t in tags if "per_class" in t or "unit-weight" in t or "etf-crc32" in t}
    rounds = [json.loads(line) for line in (recorder.path / "metrics.jsonl").read_text().splitlines()]
    logged = sorted((e.step, e.value) for e in events.Scalars("test/f1_macro"))
    assert logged == [(r["round"], pytest.approx(r["test"]["f1_macro"], abs=1e-6)) for r in rounds]  # float32 events
    assert [e.step for e in events.Scalars("train/train_loss")] == [1, 2]


def test_tensorboard_without_the_package_is_a_clear_config_error(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name.startswith("tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ConfigError, match="log-tensorboard.*pip install 'fedskew\\[tensorboard\\]'"):
        open_tensorboard(tmp_path / "tb")
