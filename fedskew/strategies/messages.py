"""The one place where each kind of message a site sends during the rounds is checked: a training reply, a
mean-gradient answer (fednca.control-variates) and a validation report, each against the run's model and
what the site declared in its survey reply (`Declared`). Each check returns why the message cannot be used,
or None; the strategy refuses a message with a reason (recorded as a dropout) and goes on with the other
sites. FederatedFactory's uploads, experts and site-validation scores are checked in fedskew.factory.library,
fedskew.strategies.factory and fedskew.factory.site_validation against the same survey.

What a site declared bounds what it may weigh: an average weighted by examples takes a site's
'num-examples' only up to the training (or validation) images it declared, and an unweighted one takes
'unit-weight' only as 1. A site can still understate its weight, and can declare a larger set in its
survey than it holds; docs/privacy.md (threat model) says what that leaves a lying site."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from fedskew.protocol import EXAMPLES_KEY, SINGLE_LABEL_VAL_KEYS, UNIT_WEIGHT_KEY, VAL_COUNTS_KEY

Layout = dict[str, tuple[int, ...]]  # array name -> shape


@dataclass(frozen=True)
class Declared:
    """What one site declared in its survey reply: who it is and how many images it holds."""

    site_id: int
    train_size: int
    val_size: int

    @classmethod
    def from_survey(cls, reply: Mapping) -> Declared:
        return cls(int(reply["site-id"]), int(reply["train-size"]), int(reply["val-size"]))


def declared_sites(survey: Mapping[int, Mapping]) -> dict[int, Declared]:
    """Node id -> what it declared, for the sites of the run's survey (refused ones already left out)."""
    return {int(node): Declared.from_survey(reply) for node, reply in survey.items()}


def arrays_layout(arrays: ArrayRecord) -> Layout:
    """The names and shapes of the arrays in a record."""
    return {name: tuple(array.shape) for name, array in arrays.items()}


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def weight_problem(metrics: MetricRecord, key: str, most: int | None) -> str | None:
    """Why a site's averaging weight `metrics[key]` cannot be used, or None. 'unit-weight' (an unweighted
    average) must be exactly 1; 'num-examples' a number > 0 and at most `most`, the images the site declared
    for what it reports on (None: no survey to bound it, as in unit tests of other parts)."""
    weight = metrics.get(key)
    if not _number(weight) or weight <= 0:
        return f"metric '{key}' must be a finite number > 0, found {weight!r}"
    if key == UNIT_WEIGHT_KEY and weight != 1:
        return f"metric '{key}' must be 1 (an unweighted average gives every site the same weight), found {weight!r}"
    if key == EXAMPLES_KEY and most is not None and weight > most:
        return f"metric '{key}' = {weight!r} exceeds the {most} images this site declared in its survey"
    return None


def training_reply_problem(content: RecordDict, layout: Layout, weight_key: str, declared: Declared | None) -> str | None:
    """Why a site's training reply (or its mean-gradient answer: the same form, with the trainable
    parameters' `layout`) cannot be averaged, or None when it can: one ArrayRecord `arrays` with exactly the
    arrays of `layout` (same shapes, real numbers, float values finite; integer or float either way, since
    the average of a site's integer counter arrives as a float) and one MetricRecord `metrics` whose
    `weight_key` is a usable weight (`weight_problem`, bounded by the declared training images). A site
    that sends anything else (a bug, a damaged message or a forged one) would otherwise abort the round in
    Flower's averaging, poison the model with NaN, or outweigh every other site."""
    if list(content.array_records) != ["arrays"] or list(content.metric_records) != ["metrics"]:
        return (f"expected one ArrayRecord 'arrays' and one MetricRecord 'metrics', found ArrayRecords "
                f"{sorted(content.array_records)} and MetricRecords {sorted(content.metric_records)}")
    arrays = content["arrays"]
    missing, unknown = sorted(layout.keys() - arrays.keys()), sorted(arrays.keys() - layout.keys())
    if missing or unknown:
        return (f"its arrays are not the model's: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                f"unknown {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    for name, shape in layout.items():
        try:
            value = arrays[name].numpy()
        except Exception as exc:  # any damage to the serialised bytes: refuse the reply, never the round
            return f"array '{name}' cannot be read ({type(exc).__name__}: {exc})"
        if value.shape != shape or value.dtype.kind not in "fiu":
            return f"array '{name}' has shape {value.shape} and dtype {value.dtype}; the model's has shape {shape}, real numbers"
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            return f"array '{name}' holds NaN or infinite values"
    return weight_problem(content["metrics"], weight_key, None if declared is None else declared.train_size)


def validation_report_problem(
    content: RecordDict, weight_keys: Iterable[str], multilabel: bool | None, declared: Declared | None
) -> str | None:
    """Why a site's validation reply cannot be averaged, or None when it can: one MetricRecord `metrics` and
    nothing else, the weights usable (`weight_problem`, bounded by the declared validation images), and the
    validation report's keys: the threshold counts (multi-label; checked by `counts_problem` when summed) or
    accuracies in [0, 1] (single-label). `multilabel` None: a report of a strategy used outside the app, whose
    metrics are its user's own; only its structure and weights are checked. Flower's averaging would otherwise
    abort the round, or let one site's value stand for all."""
    if list(content.array_records) or list(content.config_records) or list(content.metric_records) != ["metrics"]:
        return (f"expected only a MetricRecord 'metrics', found ArrayRecords {sorted(content.array_records)}, "
                f"ConfigRecords {sorted(content.config_records)}, MetricRecords {sorted(content.metric_records)}")
    metrics = content["metrics"]
    for key in weight_keys:
        if (problem := weight_problem(metrics, key, None if declared is None else declared.val_size)) is not None:
            return problem
    if multilabel is None:
        return None
    report_keys = (VAL_COUNTS_KEY,) if multilabel else SINGLE_LABEL_VAL_KEYS
    unexpected = sorted(set(metrics) - set(report_keys) - {EXAMPLES_KEY, UNIT_WEIGHT_KEY})
    if unexpected or any(key not in metrics for key in report_keys):
        return f"its metrics are {sorted(metrics)}; a validation report holds {sorted(report_keys)} and the weights"
    for key in () if multilabel else report_keys:
        value = metrics[key]
        if not _number(value) or not 0 <= value <= 1:
            return f"metric '{key}' must be a number in [0, 1], found {value!r}"
    return None


def counts_problem(counts, shape: tuple[int, ...], declared: Declared | None) -> str | None:
    """Why a site's multi-label validation counts cannot be summed into the round's, or None: prod(`shape`)
    non-negative integers (thresholds x classes x [tp, fp, fn]) that a validation split of the declared size
    can give: at every threshold and class tp + fp (images predicted positive) and tp + fn (images holding
    the class) are at most the declared validation images. Counts beyond those would take over the pooled
    validation that chooses the round and its threshold."""
    size = int(np.prod(shape))
    values = np.asarray(counts if isinstance(counts, list) else [], dtype=np.float64)
    if values.shape != (size,) or not np.all(np.isfinite(values) & (values >= 0) & (values == np.round(values))):
        found = f"{len(counts)} values" if isinstance(counts, list) else "none"
        return (f"'{VAL_COUNTS_KEY}' must be {size} non-negative integers (thresholds x classes x [tp, fp, fn] = "
                f"{' x '.join(map(str, shape))}); found {found}{' (not all non-negative integers)' if values.shape == (size,) else ''}")
    tp, fp, fn = np.moveaxis(values.reshape(shape), -1, 0)
    most = max((tp + fp).max(), (tp + fn).max())
    if declared is not None and most > declared.val_size:
        return (f"'{VAL_COUNTS_KEY}' counts {int(most)} images for one class at one threshold (tp + fp or tp + fn); "
                f"this site declared {declared.val_size} validation images in its survey")
    return None


def summed_counts(
    reported: dict[str, object], shape: tuple[int, ...], declared: Mapping[str, Declared | None] | None = None
) -> tuple[np.ndarray | None, dict[str, str]]:
    """(the sum of the sites' validation threshold counts, refused site -> problem). A site whose counts have
    a `counts_problem` (against `declared[site]`, where given) is left out of the sum, and so of the round's
    validation. None when no site's counts are usable."""
    total, refused = np.zeros(shape, dtype=np.int64), {}
    for site, counts in reported.items():
        if (problem := counts_problem(counts, shape, (declared or {}).get(site))) is not None:
            refused[site] = problem
            continue
        total += np.asarray(counts, dtype=np.int64).reshape(shape)
    return (total if len(refused) < len(reported) else None), refused
