"""8-bit pixels through every FederatedFactory path: generator training (plain and DP-SGD), the memorisation
audit, guides, intensity histograms, the P2P expert, synthesis, site validation, fidelity and predict.

Images are stored either as float32 in [0, 1] or as uint8 0-255 (fedskew.data.pixels), and 8-bit ones stay
uint8 until their pixels are used. Every path here is run on uint8 images and on their float twin
`unit_float(x)`: where pixels are used, the uint8 path applies that same conversion (an IEEE division by
255, correctly rounded, so bit for bit the twin's values), and every later float operation sees the same
bits in the same order. So the results must be *equal*, not merely close: a tolerance of the 1/255
quantisation step would hide a path that reads 0-255 values as [0, 1] ones only where it saturates.
"""

import csv

import numpy as np
import pytest
import torch

from fedskew.config import RunConfig
from fedskew.data.pixels import unit_float
from fedskew.data.sites import SiteData, simulated_site
from fedskew.data.sources import load_npz
from fedskew.factory.classifier import ClassifierRecipe, build_classifier, train_classifier
from fedskew.factory.dp_sgd import DpSgd
from fedskew.factory.intensity import INTENSITY_BINS, check_histograms, class_histograms, match_intensity
from fedskew.factory.library import Library, class_balanced_set, derived_seed, validate_upload
from fedskew.factory.site import audit_generator, generator_config, guide_config, label_counts, planned_modules
from fedskew.factory.site_validation import class_scores
from fedskew.fidelity import generator_fidelity
from fedskew.models.edm2 import build_generator, sample, train_generator
from fedskew.models.model_file import run_model_card, save_model_file
from fedskew.predict import predict
from fedskew.factory.site_handlers import site_expert, site_upload
from fedskew.protocol import (
    EXPERT_KEY,
    GENERATOR_PREFIX,
    GUIDE_MANIFEST_KEY,
    GUIDE_PREFIX,
    INTENSITY_KEY,
    MANIFEST_KEY,
    METRICS_KEY,
    decode_manifest,
    decode_states,
    encode_modules,
    unpacked_weights,
)
from fedskew.training import evaluate

CPU = torch.device("cpu")
# (channels, side): grey MedMNIST-sized, RGB CIFAR-sized, and 64 px grey (the CPU preset one UNet level deeper).
SHAPES = [(1, 28), (3, 32), (1, 64)]


def pixels(n: int, channels: int, side: int, seed: int = 0) -> np.ndarray:
    """uint8 (n, channels, side, side) covering the whole 0-255 range (both ends included)."""
    images = np.random.default_rng(seed).integers(0, 256, (n, channels, side, side), dtype=np.uint8)
    images.flat[:2] = (0, 255)
    return images


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def tiny_generator(channels: int, side: int, n_images: int):
    factory = RunConfig.from_run_config({"factory.generator-steps": 2, "factory.generator-channels": 4,
                                         "factory.augment": "flip-rot90"}).factory  # fmt: skip
    return generator_config(factory, (channels, side, side), label_dim=0, n_images=n_images, seed=3)


@pytest.mark.parametrize(("channels", "side"), SHAPES)
def test_a_generator_trains_on_uint8_pixels_exactly_as_on_their_float_values(channels, side):
    images = pixels(12, channels, side)
    config = tiny_generator(channels, side, len(images))
    from_bytes, stats = train_generator(images, None, config, progress=None, device=CPU)
    from_floats, _ = train_generator(unit_float(images), None, config, progress=None, device=CPU)
    assert stats.steps == 2 and np.isfinite(stats.loss_curve).all()
    assert_same_weights(from_bytes.state_dict(), from_floats.state_dict())


@pytest.mark.parametrize(("channels", "side"), SHAPES[:2])
def test_dp_sgd_trains_on_uint8_pixels_exactly_as_on_their_float_values(channels, side):
    images = pixels(12, channels, side, seed=1)
    config = tiny_generator(channels, side, len(images))

    def trained(x: np.ndarray) -> dict[str, torch.Tensor]:
        # The same secret seed: the same Poisson batches and gradient noise on both paths.
        private = DpSgd(1.0, 1.0, config.batch_size, len(x), secret_seed=11)
        return train_generator(x, None, config, progress=None, device=CPU, private=private)[0].state_dict()

    assert_same_weights(trained(images), trained(unit_float(images)))


def test_generator_training_names_what_it_accepts():
    config = tiny_generator(1, 28, 4)
    with pytest.raises(ValueError, match=r"float32 \(values in \[0, 1\]\) or uint8 \(0-255\) .* got ndarray uint16"):
        train_generator(np.zeros((4, 1, 28, 28), np.uint16), None, config, progress=None)
    with pytest.raises(ValueError, match=r"float32 image values must be finite and in \[0, 1\], got range \[0.0, 255.0\]"):
        train_generator(unit_float(pixels(4, 1, 28)) * 255, None, config, progress=None)


@pytest.mark.parametrize(("channels", "side"), SHAPES[:2])
def test_the_audit_finds_a_generator_that_memorised_its_uint8_training_images(channels, side):
    model = build_generator(tiny_generator(channels, side, 8))
    factory = RunConfig.from_run_config({"factory.audit-samples": 4, "factory.sampler-steps": 2}).factory
    # The site's training images are the audit's own samples stored as 8-bit: each within 1/510 per pixel of
    # its sample, so at most sqrt(C H W) / 510 away, while uniform random held-out images lie ~0.4 sqrt(C H W)
    # away: every sample counts as memorised (ratio < 1/3), the share is 1.
    samples = sample(model, 4, steps=2, seed=derived_seed(7, 0), device=CPU)
    memorised, heldout = np.rint(samples * 255).astype(np.uint8), pixels(4, channels, side)
    site = SiteData(0, 1, memorised, np.zeros(4, np.int64), heldout, np.zeros(4, np.int64), 1, ("0",))
    assert audit_generator(model, [0], site, factory, seed=7, device=CPU) == 1.0


@pytest.mark.parametrize(("channels", "side"), SHAPES[:2])
def test_intensity_histograms_count_each_8_bit_value_in_its_own_bin(channels, side):
    images, labels = pixels(30, channels, side), np.arange(30) % 3
    histograms = class_histograms(images, labels, num_classes=4)
    # Bin k of 256 over [0, 1] is [k/256, (k+1)/256), and v/255 lies in [v/256, (v+1)/256) for every v < 255
    # (v/255 - v/256 = v/(255*256) < 1/256), with 255/255 = 1 in the last (closed) bin: value v counts in bin v.
    for class_id in range(3):
        for channel in range(channels):
            expected = np.bincount(images[labels == class_id, channel].ravel(), minlength=INTENSITY_BINS)
            assert np.array_equal(histograms[class_id, channel], expected)
    assert not histograms[3].any()
    check_histograms(histograms, label_counts=[10, 10, 10, 0], image_shape=(channels, side, side))
    assert np.array_equal(histograms, class_histograms(unit_float(images), labels, num_classes=4))


# --- a site's FederatedFactory functions on a MedMNIST-layout uint8 npz, and on its float twin -------------

SITE_KEYS = {
    "mosaic-grid": 0, "partition": "classes-per-site", "classes-per-site": 1, "val-fraction": 0.25,
    "factory.generator-steps": 2, "factory.generator-channels": 4, "factory.min-class-images": 4,
    "factory.audit-samples": 4, "factory.sampler-steps": 2, "factory.sample-batch-size": 8,
    "factory.samples-per-class": 6, "factory.p2p-samples-per-class": 6, "factory.classifier-epochs": 1,
    "factory.classifier-batch-size": 16, "factory.parallel-generators": 1,
}  # fmt: skip


def write_medmnist_npz(path, images: np.ndarray, labels: np.ndarray) -> None:
    """MedMNIST's own layout: grey images (N, H, W) and labels (N, 1) for train, val and test."""
    splits = {"train": slice(0, 32), "val": slice(32, 40), "test": slice(40, None)}
    np.savez(path, **{f"{split}_{kind}": array[rows] for split, rows in splits.items()
                      for kind, array in (("images", images), ("labels", labels[:, None]))})  # fmt: skip


@pytest.fixture(scope="module")
def twin_npz(tmp_path_factory):
    """(uint8 npz, float npz of the same pixels): 28 px grey, two classes, 56 images."""
    folder = tmp_path_factory.mktemp("medmnist")
    images, labels = pixels(56, 1, 28, seed=5)[:, 0], np.arange(56) % 2
    write_medmnist_npz(folder / "bytes.npz", images, labels)
    write_medmnist_npz(folder / "floats.npz", unit_float(images), labels)
    return folder / "bytes.npz", folder / "floats.npz"


def run_config(npz, **keys) -> RunConfig:
    return RunConfig.from_run_config({"method": "factory", "dataset": f"npz:{npz}", **SITE_KEYS, **keys})


def twin_sites(twin_npz, **keys) -> list[tuple[SiteData, SiteData]]:
    """Both sites (one class each) as read from the uint8 npz and from the float one."""
    pairs = [tuple(simulated_site(run_config(npz, **keys), k, 2) for npz in twin_npz) for k in range(2)]
    for from_bytes, from_floats in pairs:
        assert from_bytes.train_images.dtype == np.uint8 and from_floats.train_images.dtype == np.float32
        assert np.array_equal(unit_float(from_bytes.train_images), from_floats.train_images)
        assert len(np.unique(from_bytes.train_labels)) == 1
    return pairs


@pytest.fixture(scope="module")
def uploads(twin_npz):
    """Each site's round-1 upload (generators, audited; guides; intensity histograms) from both npz files."""
    keys = {"factory.guide-steps": 2, "factory.match-intensity": True}
    cfg = run_config(twin_npz[0], **keys)
    return cfg, [(pair, [site_upload(cfg, site, CPU) for site in pair]) for pair in twin_sites(twin_npz, **keys)]


def uploaded(cfg: RunConfig, site: SiteData, content, guides: bool = False) -> list:
    """The generators (or guides) of one site's upload, checked as the server checks them against the plan
    its label counts make."""
    shape = tuple(site.train_images.shape[1:])
    plan = planned_modules(guide_config(cfg) if guides else cfg, site.site_id, label_counts(site), shape)
    key, prefix = (GUIDE_MANIFEST_KEY, GUIDE_PREFIX) if guides else (MANIFEST_KEY, GENERATOR_PREFIX)
    states = decode_states(content, 1 << 24, [p.module_id for p in plan], prefix)
    return validate_upload(decode_manifest(content, key, prefix), states, site_id=site.site_id, plan=plan, image_shape=shape)


def test_a_uint8_site_uploads_the_generators_guides_audit_and_histograms_of_its_float_twin(uploads):
    cfg, sites = uploads
    for (site, twin), (from_bytes, from_floats) in sites:
        for guides in (False, True):
            modules, twin_modules = uploaded(cfg, site, from_bytes, guides), uploaded(cfg, twin, from_floats, guides)
            assert len(modules) == len(twin_modules) == 1
            # The audit compared samples with the site's own [0, 1] pixels: a share (not NaN), the twin's.
            assert 0.0 <= modules[0].memorization <= 1.0 and modules[0].memorization == twin_modules[0].memorization
            assert modules[0].config == twin_modules[0].config
            assert_same_weights(modules[0].state, twin_modules[0].state)
        histograms = [content[INTENSITY_KEY][INTENSITY_KEY].numpy() for content in (from_bytes, from_floats)]
        check_histograms(histograms[0], label_counts(site), tuple(site.train_images.shape[1:]))
        assert np.array_equal(*histograms)


def test_a_uint8_site_trains_the_p2p_expert_of_its_float_twin_on_its_own_and_synthetic_images(uploads, twin_npz):
    cfg, sites = uploads
    p2p = run_config(twin_npz[0], method="factory-p2p")
    modules = [m for (site, _), (content, _) in sites for m in uploaded(cfg, site, content)]
    relayed = Library(tuple(modules), 2, (1, 28, 28), ("0", "1"))
    for (site, twin), _ in sites:
        replies = [site_expert(p2p, s, encode_modules(relayed.manifest(), modules), CPU) for s in (site, twin)]
        # Each site lacks the other's class: its expert trained on its real images and 6 synthetic ones.
        metrics = replies[0][METRICS_KEY]
        assert (metrics["lacking_classes"], metrics["synthetic_images"]) == (1, 6)
        assert_same_weights(*(unpacked_weights(r[EXPERT_KEY], "expert", 1 << 24) for r in replies))


def test_the_server_synthesises_intensity_matched_images_from_the_generators_of_uint8_sites(uploads):
    cfg, sites = uploads
    library, guides = (
        Library(tuple(m for (site, _), (content, _) in sites for m in uploaded(cfg, site, content, g)), 2, (1, 28, 28), ("0", "1"))
        for g in (False, True)
    )  # fmt: skip
    real_histograms = sum(content[INTENSITY_KEY][INTENSITY_KEY].numpy() for _, (content, _) in sites)
    synthetic = class_balanced_set(library, cfg.factory, cfg.seed, CPU, guides, cfg.factory.guidance_weight)
    matched = match_intensity(synthetic.images, synthetic.labels, real_histograms)
    assert matched.shape == (12, 1, 28, 28) and matched.dtype == np.float32
    assert 0.0 <= matched.min() and matched.max() <= 1.0 and np.bincount(synthetic.labels).tolist() == [6, 6]


# --- classifiers, site validation, fidelity and predict on uint8 images ----------------------------------------


@pytest.mark.parametrize(("channels", "side"), SHAPES[:2])
def test_classifier_training_site_validation_and_evaluation_read_uint8_as_their_float_values(channels, side):
    images, labels = pixels(24, channels, side, seed=2), np.arange(24) % 3
    recipe = ClassifierRecipe("small-cnn", 8, epochs=1, lr=0.05, momentum=0.9, weight_decay=1e-4, batch_size=8, augment="flip")
    trained = [train_classifier(x, labels, 3, recipe, val_fraction=0.25, seed=0, device=CPU)[0]
               for x in (images, unit_float(images))]  # fmt: skip
    assert_same_weights(trained[0].state_dict(), trained[1].state_dict())
    model = trained[0].eval()
    scores = [class_scores(model, x, labels, 3, CPU).to_metrics() for x in (images, unit_float(images))]
    assert scores[0] == scores[1] and sum(scores[0]["counts"]) == 24
    assert evaluate(model, images, labels, device=CPU) == evaluate(model, unit_float(images), labels, device=CPU)


def test_fidelity_of_a_synthetic_set_against_a_uint8_dataset_is_that_against_its_float_twin(twin_npz):
    real = [load_npz(path) for path in twin_npz]
    assert real[0].train_images.dtype == np.uint8 and real[1].train_images.dtype == np.float32
    rng = np.random.default_rng(4)
    synthetic, synthetic_labels = rng.random((16, 1, 28, 28), dtype=np.float32), np.arange(16) % 2
    reports = [generator_fidelity(synthetic, synthetic_labels, dataset, seed=0, device=CPU) for dataset in real]
    assert reports[0] == reports[1]
    assert all(np.isfinite(reports[0]["classifier"]["class_mean"][k]) for k in ("fd", "fd_floor", "kid", "kid_floor"))


@pytest.mark.parametrize("model_shape", [(1, 28, 28), (3, 32, 32)], ids=["as-stored", "grey-to-rgb-resized"])
def test_predict_on_a_uint8_npz_writes_the_probabilities_of_its_float_twin(twin_npz, tmp_path, model_shape):
    cfg = RunConfig.from_run_config({"method": "factory", "mosaic-grid": 0, "partition": "iid"})
    torch.manual_seed(0)
    model = build_classifier("small-cnn", model_shape, 2, cfg.feature_side)
    path = save_model_file(tmp_path / "m.safetensors", model.state_dict(), run_model_card(cfg, ("0", "1"), False, model_shape))
    rows = []
    for npz in twin_npz:
        report = predict(path, npz, tmp_path / f"{npz.stem}.csv")
        assert report["rows"] == 16 and set(report["metrics"]) >= {"accuracy"}
        rows.append(list(csv.reader((tmp_path / f"{npz.stem}.csv").open())))
    assert rows[0] == rows[1]
