import numpy as np
import pytest
import torch

from fedskew.models.backbones import Classifier, ResNet, SmallCNN
from fedskew.training import augmented, evaluate, make_loader, pick_device, sgd, train_local


def _separable_data(multilabel: bool, n: int = 64):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=n)
    images = rng.normal(0, 0.1, size=(n, 1, 8, 8)).astype(np.float32)
    images[labels == 1, :, :4] += 1.0  # class 1 is bright in the top half
    if multilabel:
        return images, np.stack([labels, 1 - labels], axis=1).astype(np.float32)
    return images, labels.astype(np.int64)


@pytest.mark.parametrize("multilabel", [False, True])
def test_local_training_learns_a_separable_task(multilabel):
    torch.manual_seed(0)
    images, labels = _separable_data(multilabel)
    model = Classifier(SmallCNN(1, width=8), 2)
    device = torch.device("cpu")
    before = evaluate(model, images, labels, device=device)
    train_local(model, make_loader(images, labels, 16, shuffle=True), epochs=5, optimizer=sgd(model, 0.05, 0.9, 0), device=device)
    after = evaluate(model, images, labels, device=device)
    key = "f1_macro" if multilabel else "accuracy"
    assert after[key] >= 0.95 and after[key] > before[key]


def test_proximal_term_keeps_weights_closer_to_the_global_model():
    images, labels = _separable_data(False)
    drift = {}
    for mu in (0.0, 10.0):
        torch.manual_seed(0)
        model = Classifier(SmallCNN(1, width=8), 2)
        start = [p.detach().clone() for p in model.parameters()]
        train_local(model, make_loader(images, labels, 16, True), epochs=2, optimizer=sgd(model, 0.05, 0.0, 0),
                    device=torch.device("cpu"), proximal_mu=mu)
        drift[mu] = sum(((p - s) ** 2).sum().item() for p, s in zip(model.parameters(), start))
    assert drift[10.0] < drift[0.0]


def test_backbones_expose_a_feature_map():
    x = torch.randn(2, 3, 16, 16)
    assert SmallCNN(3).forward_features(x).shape == (2, 64, 8, 8)
    assert SmallCNN(3, 16, feature_side=8).forward_features(x).shape == (2, 64, 8, 8)  # already small enough
    assert ResNet(18, 3).forward_features(x).shape == (2, 512, 2, 2)
    assert ResNet(50, 3).forward_features(x).shape == (2, 2048, 2, 2)


@pytest.mark.parametrize("side, feature_side, expected", [(56, 0, 28), (56, 8, 7), (32, 8, 8), (24, 8, 6), (24, 4, 3), (9, 4, 3)])
def test_small_cnn_downsamples_until_the_feature_side_is_reached(side, feature_side, expected):
    # Each extra stage halves the side (rounding up, as a padded stride-2 3x3 conv does).
    cnn = SmallCNN(1, side, feature_side)
    assert cnn.forward_features(torch.zeros(1, 1, side, side)).shape == (1, 64, expected, expected)


def test_cuda_request_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        pick_device("cuda")
    assert pick_device("auto").type == "cpu"


def test_a_diverging_loss_is_reported_not_trained_on():
    images, labels = _separable_data(False)
    model = Classifier(SmallCNN(1, width=8), 2)
    images[0, 0, 0, 0] = np.nan
    with pytest.raises(FloatingPointError, match="lower `lr`"):
        train_local(model, make_loader(images, labels, 64, False), epochs=1, optimizer=sgd(model, 0.05, 0.9, 0),
                    device=torch.device("cpu"))


def _seen_by(augment: str, images: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The images the loss of an `augmented` loss function is computed on."""
    seen = []
    loss = augmented(lambda model, x, y: seen.append(x) or x.sum(), augment, seed)
    loss(None, images, torch.zeros(len(images)))
    return seen[0]


def test_no_augmentation_is_the_loss_itself():
    def loss(model, x, y):
        return x.sum()

    assert augmented(loss, "none", 0) is loss
    with pytest.raises(ValueError, match="augment must be one of"):
        augmented(loss, "rotate", 0)


@pytest.mark.parametrize("augment", ["shift", "shift-flip"])
def test_augmentation_moves_each_pixel_by_at_most_an_eighth_of_the_side(augment):
    # One lit pixel per image, far enough from the border that no shift of up to 16 // 8 = 2 px drops it.
    images = torch.zeros(64, 1, 16, 16)
    images[:, 0, 5, 9] = 1.0
    seen = _seen_by(augment, images)
    assert seen.shape == images.shape
    assert torch.equal(seen.sum(dim=(1, 2, 3)), torch.ones(64))  # moved, never duplicated or lost
    rows, cols = (seen[:, 0] == 1).nonzero()[:, 1:].T
    assert (rows - 5).abs().max() <= 2
    mirrored_cols = 15 - cols  # where the pixel lands if the image was mirrored after the shift
    within = (cols - 9).abs() <= 2
    if augment == "shift":
        assert within.all()
    else:
        mirrored = (mirrored_cols - 9).abs() <= 2
        assert (within | mirrored).all() and mirrored.any() and within.any()
    # 25 possible shifts over 64 images: a draw that never moves a pixel would be a broken generator.
    assert len(set(zip(rows.tolist(), cols.tolist()))) > 5
    assert torch.equal(seen, _seen_by(augment, images))  # the seed fixes the draws
    assert not torch.equal(seen, _seen_by(augment, images, seed=1))
