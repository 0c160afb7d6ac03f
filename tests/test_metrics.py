import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import average_precision_score, balanced_accuracy_score, f1_score, roc_auc_score

from fedskew.metrics import (
    THRESHOLD_GRID,
    choose_threshold,
    counted_f1,
    counted_thresholds,
    f1_from_counts,
    multilabel_metrics,
    single_label_metrics,
    threshold_counts,
)


def test_single_label_on_a_hand_made_case():
    y = np.array([0, 0, 1, 1, 2, 2])
    probs = np.array(
        [[0.8, 0.1, 0.1], [0.3, 0.6, 0.1], [0.2, 0.7, 0.1], [0.1, 0.8, 0.1], [0.1, 0.2, 0.7], [0.5, 0.1, 0.4]]
    )
    m = single_label_metrics(y, probs)
    # predictions 0,1,1,1,2,0 -> 4 of 6 right; recall per class 1/2, 2/2, 1/2
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["per_class_recall"] == pytest.approx([0.5, 1.0, 0.5])
    assert m["balanced_accuracy"] == pytest.approx(balanced_accuracy_score(y, probs.argmax(1)))
    assert m["auroc_macro"] == pytest.approx(roc_auc_score(y, probs, multi_class="ovr", average="macro"))


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6).flatmap(lambda k: st.tuples(st.just(k), st.lists(st.integers(0, k - 1), min_size=1, max_size=30))),
       st.integers(0, 2**32 - 1))
def test_balanced_accuracy_is_scikit_learns_without_its_warning(case, seed):
    # a site's split under label skew lacks classes the model predicts: scikit-learn warns and averages the
    # recall over the classes present; the value must be the same, and no warning raised
    import warnings

    num_classes, labels = case
    y = np.array(labels)
    probs = np.random.default_rng(seed).random((len(y), num_classes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = balanced_accuracy_score(y, probs.argmax(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = single_label_metrics(y, probs)
    assert m["balanced_accuracy"] == pytest.approx(expected)


def test_multilabel_matches_scikit_learn():
    rng = np.random.default_rng(0)
    y = (rng.random((40, 4)) < 0.4).astype(int)
    probs = np.clip(y * 0.5 + rng.random((40, 4)) * 0.6, 0, 1)
    m = multilabel_metrics(y, probs)
    pred = (probs > 0.5).astype(int)
    assert m["auc_macro"] == pytest.approx(roc_auc_score(y, probs, average="macro"))
    assert m["auc_micro"] == pytest.approx(roc_auc_score(y, probs, average="micro"))
    assert m["f1_macro"] == pytest.approx(f1_score(y, pred, average="macro"))
    assert m["f1_micro"] == pytest.approx(f1_score(y, pred, average="micro"))
    assert m["map"] == pytest.approx(average_precision_score(y, probs, average="macro"))
    assert m["per_class_f1"] == pytest.approx(list(f1_score(y, pred, average=None)))


def test_multilabel_hand_made_numbers():
    y = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    probs = np.array([[0.9, 0.2], [0.4, 0.6], [0.6, 0.3], [0.1, 0.7]])
    m = multilabel_metrics(y, probs)
    # class 0: positives {0.9, 0.6} all above negatives {0.4, 0.1} -> AUC 1; predictions 1,0,1,0 -> F1 1
    # class 1: positives {0.6, 0.3} vs negatives {0.2, 0.7}: pairs won 0.6>0.2, 0.3>0.2 -> 2 of 4 -> AUC 0.5;
    #          predictions 0,1,0,1 -> tp 1, fp 1, fn 1 -> F1 0.5
    assert m["per_class_auc"] == pytest.approx([1.0, 0.5])
    assert m["per_class_f1"] == pytest.approx([1.0, 0.5])
    assert m["f1_macro"] == pytest.approx(0.75)


def test_a_class_absent_from_the_labels_is_left_out_of_macro_auc_not_counted_as_chance():
    y = np.array([[1, 0], [0, 0], [1, 0]])
    probs = np.array([[0.9, 0.1], [0.2, 0.9], [0.8, 0.3]])
    m = multilabel_metrics(y, probs)
    assert np.isnan(m["per_class_auc"][1])
    assert m["auc_macro"] == pytest.approx(1.0)


def test_multilabel_accuracy_is_medmnists_acc():
    from medmnist.evaluator import getACC

    y = np.array([[1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]])
    probs = np.array([[0.9, 0.2, 0.4], [0.1, 0.6, 0.7], [0.8, 0.5, 0.3], [0.3, 0.9, 0.1]])
    # label accuracies at > 0.5: 4/4, 2/4 (0.6 wrong; 0.5 is not > 0.5, wrong), 3/4 (0.4 wrong) -> 9/12
    m = multilabel_metrics(y, probs)
    assert m["accuracy_medmnist"] == pytest.approx(0.75)
    assert m["accuracy_medmnist"] == pytest.approx(getACC(y, probs, "multi-label, binary-class"))


# --- the decision threshold chosen on validation counts ------------------------------------------

GRID_INDEX = {t: k for k, t in enumerate(THRESHOLD_GRID)}


def _counts_at(per_threshold: dict[float, list[list[int]]], default: list[list[int]]) -> np.ndarray:
    return np.array([per_threshold.get(t, default) for t in THRESHOLD_GRID])


def test_hand_made_counts_give_the_threshold_and_macro_f1_exactly():
    # Two classes. Below 0.3 class 0 has 2 tp and 2 fp; from 0.3 on it is exact (2 tp); class 1 has 1 tp
    # and 1 fn everywhere except at 0.3, where it has 2 tp: macro-F1 there = (1 + 1) / 2 = 1.
    counts = _counts_at({0.3: [[2, 0, 0], [2, 0, 0]]}, [[2, 0, 0], [1, 0, 1]])
    counts[: GRID_INDEX[0.3], 0] = [2, 2, 0]
    assert choose_threshold(counts, THRESHOLD_GRID) == 0.3
    scores = counted_f1(counts, THRESHOLD_GRID, 0.3)
    assert scores == {"f1_macro": 1.0, "f1_micro": 1.0, "f1_macro_at_0.5": (1 + 2 / 3) / 2}
    # below 0.3: class 0 F1 = 4 / 6, class 1 = 2 / 3; micro = 2 * 3 / (2 * 3 + 2 + 1)
    macro, micro = f1_from_counts(counts[GRID_INDEX[0.25]])
    assert macro == pytest.approx(2 / 3) and micro == pytest.approx(6 / 9)


def test_equally_good_thresholds_go_to_the_one_nearest_half_and_a_model_that_separates_nothing_keeps_half():
    plateau = _counts_at({t: [[3, 0, 0]] for t in (0.1, 0.15, 0.2, 0.25, 0.3, 0.35)}, [[0, 0, 3]])
    assert choose_threshold(plateau, THRESHOLD_GRID) == 0.35
    symmetric = _counts_at({0.4: [[3, 0, 0]], 0.6: [[3, 0, 0]]}, [[0, 0, 3]])
    assert choose_threshold(symmetric, THRESHOLD_GRID) == 0.4  # equally near: the lower
    assert choose_threshold(np.zeros((len(THRESHOLD_GRID), 2, 3), dtype=np.int64), THRESHOLD_GRID) == 0.5


def test_a_fixed_threshold_is_counted_with_half_for_the_comparable_f1():
    assert counted_thresholds("validation") == THRESHOLD_GRID
    assert counted_thresholds(0.3) == (0.3, 0.5) and counted_thresholds(0.5) == (0.5,)


@st.composite
def _sites(draw):
    """2-4 sites' validation labels and probabilities over the same 3 classes (probabilities on a 0.01 grid,
    so some sit exactly on a threshold: '>' must treat them alike in every site)."""
    classes = 3
    sites = []
    for _ in range(draw(st.integers(2, 4))):
        n = draw(st.integers(0, 12))
        labels = np.array(draw(st.lists(st.lists(st.integers(0, 1), min_size=classes, max_size=classes), min_size=n, max_size=n)),
                          dtype=np.int64).reshape(n, classes)  # fmt: skip
        probs = np.array(draw(st.lists(st.lists(st.integers(0, 100), min_size=classes, max_size=classes), min_size=n, max_size=n)),
                         dtype=np.float64).reshape(n, classes) / 100  # fmt: skip
        sites.append((labels, probs))
    return sites


@settings(deadline=None, max_examples=30)  # each example fits 40 scikit-learn F1s: cheap, but not within 200 ms on a busy machine
@given(_sites())
def test_summing_the_sites_counts_is_pooling_their_predictions(sites):
    summed = sum(threshold_counts(labels, probs, THRESHOLD_GRID) for labels, probs in sites)
    labels = np.concatenate([s[0] for s in sites])
    probs = np.concatenate([s[1] for s in sites])
    np.testing.assert_array_equal(summed, threshold_counts(labels, probs, THRESHOLD_GRID))
    chosen = choose_threshold(summed, THRESHOLD_GRID)
    if len(labels):
        # The F1 the server derives from the sums is scikit-learn's F1 on the pooled predictions ...
        derived = counted_f1(summed, THRESHOLD_GRID, chosen)
        predicted = (probs > chosen).astype(int)
        assert derived["f1_macro"] == pytest.approx(f1_score(labels, predicted, average="macro", zero_division=0), abs=1e-12)
        assert derived["f1_micro"] == pytest.approx(f1_score(labels, predicted, average="micro", zero_division=0), abs=1e-12)
        # ... and no grid threshold does better on the pooled predictions.
        assert all(f1_score(labels, (probs > t).astype(int), average="macro", zero_division=0) <= derived["f1_macro"] + 1e-12
                   for t in THRESHOLD_GRID)  # fmt: skip
