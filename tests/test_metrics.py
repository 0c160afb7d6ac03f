import numpy as np
import pytest
from sklearn.metrics import average_precision_score, balanced_accuracy_score, f1_score, roc_auc_score

from fedskew.metrics import multilabel_metrics, single_label_metrics


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
