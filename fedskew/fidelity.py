"""Generator quality as the papers measure it: Frechet distance (FD) and kernel inception distance
(KID) between synthetic and real images of each class, in two feature spaces, each next to its
real-vs-real floor (a real training subset of the same size against the same real test images:
what a perfect generator would score).

- Classifier features (any dataset, offline): the penultimate (pooled backbone) features of a
  small CNN trained here on the real training split.
- Inception features (FID/KID proper): torch-fidelity's Inception-v3 port, only from a local
  weights file (factory.inception-weights); nothing is downloaded.

FD = ||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)). KID = the unbiased MMD^2 with the cubic
polynomial kernel k(x, y) = (x.y / d + 1)^3, averaged over random equal-size subsets (Binkowski et
al., 2018).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from scipy.linalg import sqrtm

from fedskew.analysis import real_vs_synthetic_tsne
from fedskew.config import RunConfig
from fedskew.data.sites import load_task_dataset
from fedskew.data.pixels import unit_float
from fedskew.data.sources import ImageDataset
from fedskew.factory.library import SYNTHETIC_FILE, load_synthetic
from fedskew.models.backbones import Classifier, build_backbone
from fedskew.results import RunRecorder, write_json
from fedskew.training import make_loader, sgd, train_local

FeatureFn = Callable[[np.ndarray], np.ndarray]

FIDELITY_FILE = "fidelity.json"
TSNE_FILE = "real_vs_synthetic_tsne.png"
FEATURE_NET_EPOCHS = 10
KID_SUBSETS = 20
KID_SUBSET_SIZE = 1000


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """FD between two feature sets (rows = samples, at least 2 each)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Frechet distance needs >= 2 feature rows per set, got {len(a)} and {len(b)}")
    mu_a, mu_b = a.mean(axis=0), b.mean(axis=0)
    cov_a, cov_b = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    cross = sqrtm(cov_a @ cov_b).real
    return float(np.sum((mu_a - mu_b) ** 2) + np.trace(cov_a + cov_b - 2 * cross))


def _unbiased_mmd2(a: np.ndarray, b: np.ndarray) -> float:
    d = a.shape[1]
    k_aa, k_bb, k_ab = ((a @ a.T) / d + 1) ** 3, ((b @ b.T) / d + 1) ** 3, ((a @ b.T) / d + 1) ** 3
    m, n = len(a), len(b)
    return float(
        (k_aa.sum() - np.trace(k_aa)) / (m * (m - 1)) + (k_bb.sum() - np.trace(k_bb)) / (n * (n - 1)) - 2 * k_ab.mean()
    )


def kernel_inception_distance(a: np.ndarray, b: np.ndarray, seed: int = 0, subsets: int = KID_SUBSETS,
                              subset_size: int = KID_SUBSET_SIZE) -> float:
    """KID between two feature sets: mean unbiased MMD^2 over `subsets` random subsets of
    min(subset_size, len(a), len(b)) rows each (all rows once when both sets are that small)."""
    size = min(subset_size, len(a), len(b))
    if size < 2:
        raise ValueError(f"KID needs >= 2 feature rows per set, got {len(a)} and {len(b)}")
    a, b = a.astype(np.float64), b.astype(np.float64)
    if size == len(a) == len(b):
        return _unbiased_mmd2(a, b)
    rng = np.random.default_rng(seed)
    return float(np.mean([
        _unbiased_mmd2(a[rng.choice(len(a), size, replace=False)], b[rng.choice(len(b), size, replace=False)])
        for _ in range(subsets)
    ]))


# --- feature spaces ---------------------------------------------------------------------------------------


def classifier_features(train_images: np.ndarray, train_labels: np.ndarray, num_classes: int, seed: int,
                        device: torch.device, epochs: int = FEATURE_NET_EPOCHS) -> FeatureFn:
    """Train the small CNN on the real training split; returns images -> pooled penultimate features."""
    torch.manual_seed(seed)
    net = Classifier(build_backbone("small-cnn", train_images.shape[1], train_images.shape[2]), num_classes)
    loader = make_loader(train_images, train_labels, 64, shuffle=True, seed=seed)
    train_local(net, loader, epochs=epochs, optimizer=sgd(net, 0.05, 0.9, 5e-4), device=device)
    return _pooled_backbone_features(net.eval(), device)


def _pooled_backbone_features(net: Classifier, device: torch.device) -> FeatureFn:
    @torch.no_grad()
    def features(images: np.ndarray) -> np.ndarray:
        out = [net.backbone.forward_features(unit_float(torch.from_numpy(images[i:i + 256])).to(device)).mean(dim=(2, 3)).cpu()
               for i in range(0, len(images), 256)]
        return torch.cat(out).numpy().astype(np.float64)

    return features


def inception_features(weights_path: str, device: torch.device) -> FeatureFn:
    """torch-fidelity's Inception-v3 (the FID network) from a local weights file; 2048-d pool features."""
    path = Path(weights_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"factory.inception-weights = {weights_path!r}: no such file; give the path of the FID Inception "
            "weights (pt_inception-2015-12-05-6726825d.pth) or leave it empty to skip Inception FID/KID"
        )
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    except ImportError as exc:
        raise ImportError("factory.inception-weights needs torch-fidelity: pip install 'fedskew[fidelity]'") from exc
    net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(path))
    net = net.to(device).eval()

    @torch.no_grad()
    def features(images: np.ndarray) -> np.ndarray:
        out = []
        for i in range(0, len(images), 64):
            batch = unit_float(torch.from_numpy(images[i:i + 64]))
            if batch.shape[1] == 1:
                batch = batch.repeat(1, 3, 1, 1)
            as_bytes = (batch * 255).round().clamp(0, 255).to(torch.uint8).to(device)
            out.append(net(as_bytes)[0].cpu())
        return torch.cat(out).numpy().astype(np.float64)

    return features


# --- per-class report ---------------------------------------------------------------------------------------


def class_fidelity(features: FeatureFn, synthetic: np.ndarray, real_train: np.ndarray, real_test: np.ndarray,
                   seed: int) -> dict:
    """FD/KID of synthetic vs real test images of one class, and the floor: a real training subset of
    the same size vs the same test images. Both sides use n = min(#synthetic, #real train) images."""
    n = min(len(synthetic), len(real_train))
    if n < 2 or len(real_test) < 2:
        return {"skipped": f"too few images (synthetic {len(synthetic)}, real train {len(real_train)}, "
                           f"real test {len(real_test)}); need >= 2 each"}
    rng = np.random.default_rng(seed)
    fake = features(synthetic[rng.choice(len(synthetic), n, replace=False)])
    real = features(real_train[rng.choice(len(real_train), n, replace=False)])
    test = features(real_test)
    return {
        "n": n,
        "n_test": len(real_test),
        "fd": frechet_distance(fake, test),
        "fd_floor": frechet_distance(real, test),
        "kid": kernel_inception_distance(fake, test, seed),
        "kid_floor": kernel_inception_distance(real, test, seed),
    }


def per_class_fidelity(features: FeatureFn, synthetic_images: np.ndarray, synthetic_labels: np.ndarray,
                       real_train: tuple[np.ndarray, np.ndarray], real_test: tuple[np.ndarray, np.ndarray],
                       class_names: tuple[str, ...], seed: int) -> dict[str, dict]:
    """{class name: class_fidelity(...)} for every class with synthetic images."""
    report = {}
    for class_id in np.unique(synthetic_labels):
        report[class_names[class_id]] = class_fidelity(
            features,
            synthetic_images[synthetic_labels == class_id],
            real_train[0][real_train[1] == class_id],
            real_test[0][real_test[1] == class_id],
            seed + int(class_id),
        )
    return report


def mean_over_classes(report: dict[str, dict]) -> dict[str, float]:
    """Class means of fd, fd_floor, kid, kid_floor (classes that were measured)."""
    measured = [r for r in report.values() if "fd" in r]
    return {k: float(np.mean([r[k] for r in measured])) if measured else math.nan
            for k in ("fd", "fd_floor", "kid", "kid_floor")}


def generator_fidelity(synthetic_images: np.ndarray, synthetic_labels: np.ndarray, real: ImageDataset, seed: int,
                       device: torch.device, inception_weights: str = "", tsne_path: Path | None = None) -> dict:
    """The full report for a synthetic set against `real` (an ImageDataset with single-label train and
    test splits): per class and class-mean, in classifier features and (with weights) Inception's.
    With `tsne_path`, also a t-SNE map of real test vs synthetic images in the classifier features."""
    real_train, real_test = (real.train_images, real.train_labels), (real.test_images, real.test_labels)
    spaces: dict[str, FeatureFn] = {
        "classifier": classifier_features(real.train_images, real.train_labels, real.num_classes, seed, device)
    }
    if tsne_path is not None:
        features = spaces["classifier"]
        real_vs_synthetic_tsne(features(real.test_images), real.test_labels, features(synthetic_images),
                               synthetic_labels, real.class_names, tsne_path, seed)
    if inception_weights:
        spaces["inception"] = inception_features(inception_weights, device)
    report = {
        "feature_net": f"small-cnn, {FEATURE_NET_EPOCHS} epochs SGD on the real training split; pooled penultimate "
                       "features",
        "floor": "a real training subset of the same size vs the same real test images",
    }
    for name, features in spaces.items():
        classes = per_class_fidelity(features, synthetic_images, synthetic_labels, real_train, real_test,
                                     real.class_names, seed)
        report[name] = {"per_class": classes, "class_mean": mean_over_classes(classes)}
    return report


def record_fidelity(cfg: RunConfig, recorder: RunRecorder, device: torch.device) -> dict:
    """A factory run's report on the synthetic set it stored: written to fidelity.json in the run
    directory and under "fidelity" in summary.json. Measured when the server holds the dataset's real
    training split (test-data empty); otherwise, or when measuring fails, the reason is recorded
    instead and the run goes on (the classifier's results do not depend on it)."""
    if cfg.test_data:
        report = {"skipped": "the server holds no real training split (test-data is set): no real reference"}
    else:
        try:
            synthetic = load_synthetic(recorder.path / SYNTHETIC_FILE)
            report = generator_fidelity(synthetic.images, synthetic.labels, load_task_dataset(cfg), cfg.seed, device,
                                        cfg.factory.inception_weights, recorder.path / TSNE_FILE)
            report["tsne_png"] = TSNE_FILE
        except (OSError, ImportError, ValueError) as exc:
            report = {"failed": f"{type(exc).__name__}: {exc}"}
    write_json(recorder.path / FIDELITY_FILE, report)
    recorder.extra["fidelity"] = report
    print(f"generator fidelity: {_headline(report)}", flush=True)
    return report


def _headline(report: dict) -> str:
    if "classifier" not in report:
        return next(iter(report.values()))
    return "; ".join(
        f"{space} FD {report[space]['class_mean']['fd']:.3g} (floor {report[space]['class_mean']['fd_floor']:.3g}), "
        f"KID {report[space]['class_mean']['kid']:.3g} (floor {report[space]['class_mean']['kid_floor']:.3g})"
        for space in ("classifier", "inception") if space in report
    ) + f"; per class in {FIDELITY_FILE}"
