"""FedNCA-ML's neural-collapse analysis of a finished run, as its paper reports it: how close the
class-wise features of the final global model come to the simplex ETF.

- Inter-class similarity: the mean pairwise cosine of the K class means (class k's mean is the
  average LADM feature f_bk over the test images that carry label k), next to the ETF's -1/(K-1).
- A t-SNE map (scikit-learn) of those class-wise features with the ETF directions embedded with them.

Written to `nc_analysis.json` and `nc_tsne.png` in the run directory. For FederatedFactory,
`real_vs_synthetic_tsne` maps real and synthetic images of each class in one t-SNE.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.manifold import TSNE  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from fedskew.data.pixels import unit_float  # noqa: E402
from fedskew.models.fednca import FedNCAModel  # noqa: E402
from fedskew.results import write_json  # noqa: E402

ANALYSIS_FILE = "nc_analysis.json"
TSNE_FILE = "nc_tsne.png"
TSNE_PER_CLASS = 150


def tsne_2d(points: np.ndarray, seed: int) -> np.ndarray:
    """scikit-learn's t-SNE to 2-d on one thread: at these sizes (a few thousand points) its OpenMP
    threads spin more than they compute (measured: 27 s of CPU instead of 1.5 s for 414 points)."""
    with threadpool_limits(1):
        return TSNE(n_components=2, perplexity=min(30.0, (len(points) - 1) / 3), init="pca",
                    random_state=seed).fit_transform(points)


@torch.no_grad()
def positive_class_features(model: FedNCAModel, images: np.ndarray, labels: np.ndarray, device: torch.device,
                            batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(features (P, D), class ids (P,)): the class-k feature of every (image, k) with label k present."""
    model.to(device).eval()
    features, classes = [], []
    for start in range(0, len(images), batch_size):
        x = unit_float(torch.from_numpy(images[start:start + batch_size])).to(device)
        present = torch.from_numpy(labels[start:start + batch_size] > 0.5)
        class_features = model.forward_with_features(x)[2].cpu()
        sample_index, class_index = present.nonzero(as_tuple=True)
        features.append(class_features[sample_index, class_index].numpy())
        classes.append(class_index.numpy())
    return np.concatenate(features).astype(np.float64), np.concatenate(classes)


def interclass_similarity(features: np.ndarray, classes: np.ndarray, num_classes: int) -> dict:
    """Mean pairwise cosine of the class means (classes with features), and the ETF's -1/(K-1)."""
    present = [k for k in range(num_classes) if (classes == k).any()]
    if len(present) < 2:
        raise ValueError(f"need features of >= 2 classes for an inter-class similarity, got {len(present)}")
    means = np.stack([features[classes == k].mean(axis=0) for k in present])
    unit = means / np.linalg.norm(means, axis=1, keepdims=True)
    cosine = unit @ unit.T
    pairs = cosine[np.triu_indices(len(present), k=1)]
    return {
        "mean_pairwise_cosine": float(pairs.mean()),
        "etf_cosine": -1.0 / (num_classes - 1),
        "classes_measured": len(present),
        "class_mean_cosine": cosine.tolist(),
    }


def tsne_plot(features: np.ndarray, classes: np.ndarray, prototypes: np.ndarray, class_names: tuple[str, ...],
              path: Path, seed: int) -> None:
    """t-SNE of (up to TSNE_PER_CLASS per class) class-wise features and the K ETF prototypes, embedded together.
    The prototypes are scaled to the features' mean norm so that the map places them among the features."""
    rng = np.random.default_rng(seed)
    keep = np.concatenate([rng.permutation(np.flatnonzero(classes == k))[:TSNE_PER_CLASS] for k in np.unique(classes)])
    points = features[keep]
    scaled = prototypes * np.linalg.norm(points, axis=1).mean()
    stacked = np.concatenate([points, scaled])
    embedded = tsne_2d(stacked, seed)
    figure, axis = plt.subplots(figsize=(7, 6))
    colours = plt.get_cmap("tab20")
    for k in np.unique(classes):
        mine = classes[keep] == k
        axis.scatter(*embedded[: len(points)][mine].T, s=6, alpha=0.5, color=colours(k % 20), label=class_names[k])
    for k, (x, y) in enumerate(embedded[len(points):]):
        axis.scatter(x, y, marker="*", s=260, color=colours(k % 20), edgecolors="black", linewidths=1.0)
    axis.set_title("class-wise features of the final model (dots) and ETF directions (stars), t-SNE")
    axis.legend(fontsize=7, markerscale=2, ncol=2, loc="best")
    axis.set_xticks([])
    axis.set_yticks([])
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_fednca_analysis(model: FedNCAModel, test, run_dir: Path, device: torch.device, seed: int) -> dict:
    """The analysis of the final global model on the server's test split (an ImageDataset, multi-hot)."""
    features, classes = positive_class_features(model, test.test_images, test.test_labels, device)
    report = interclass_similarity(features, classes, model.num_classes)
    tsne_plot(features, classes, model.prototypes.cpu().numpy().astype(np.float64), test.class_names,
              run_dir / TSNE_FILE, seed)
    report["tsne_png"] = TSNE_FILE
    write_json(run_dir / ANALYSIS_FILE, report)
    print(f"fedskew: class-mean cosine {report['mean_pairwise_cosine']:.3f} (ETF {report['etf_cosine']:.3f}); "
          f"{ANALYSIS_FILE}, {TSNE_FILE}", flush=True)
    return report


def real_vs_synthetic_tsne(real: np.ndarray, real_classes: np.ndarray, synthetic: np.ndarray,
                           synthetic_classes: np.ndarray, class_names: tuple[str, ...], path: Path, seed: int) -> None:
    """One t-SNE of (up to TSNE_PER_CLASS per class and side) real and synthetic feature vectors:
    circles real, crosses synthetic, one colour per class."""
    rng = np.random.default_rng(seed)

    def subset(classes: np.ndarray) -> np.ndarray:
        return np.concatenate([rng.permutation(np.flatnonzero(classes == k))[:TSNE_PER_CLASS] for k in np.unique(classes)])

    real_keep, fake_keep = subset(real_classes), subset(synthetic_classes)
    stacked = np.concatenate([real[real_keep], synthetic[fake_keep]])
    embedded = tsne_2d(stacked, seed)
    figure, axis = plt.subplots(figsize=(7, 6))
    colours = plt.get_cmap("tab20")
    sides = ((embedded[: len(real_keep)], real_classes[real_keep], "o", "real"),
             (embedded[len(real_keep):], synthetic_classes[fake_keep], "x", "synthetic"))
    for points, classes, marker, side in sides:
        for k in np.unique(classes):
            axis.scatter(*points[classes == k].T, s=10, marker=marker, alpha=0.6, color=colours(k % 20),
                         label=f"{class_names[k]} {side}")
    axis.set_title("real (o) vs synthetic (x) images in the feature CNN's space, t-SNE")
    axis.legend(fontsize=6, ncol=2, loc="best")
    axis.set_xticks([])
    axis.set_yticks([])
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
