"""Seeded federated partitions of a training split: which train indices each site holds.

Every scheme is a pure function of (labels, settings, seed), so every node that runs it with the
same seed and site count derives the same partition without any communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp

PARTITION_SCHEMES = ("iid", "dirichlet", "classes-per-site", "multilabel-skew")
MAX_PARTITION_DRAWS = 1000  # redraws of the Dirichlet proportions before giving up on min_site_size
MAX_MULTILABEL_DRAWS = 20  # each costs a balancing pass; with balanced sizes, repeated failure means infeasible
MISSING_DESIGN_CANDIDATES = 32  # balanced missing-label designs tried; the one leaving fewest samples unplaceable wins
BALANCING_ITERATIONS = 300
BALANCING_TOLERANCE = 0.02  # relative deviation of each site's expected size from the mean that counts as balanced


@dataclass(frozen=True, eq=False)
class Partition:
    site_indices: tuple[np.ndarray, ...]  # disjoint, sorted int64 train indices per site
    unassigned: np.ndarray  # train indices no site could take; reported, never silently dropped
    scheme: str


def iid(num_samples: int, num_sites: int, seed: int) -> list[np.ndarray]:
    """A seeded shuffle cut into `num_sites` near-equal parts."""
    _check_num_sites(num_sites, num_samples)
    shuffled = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(part) for part in np.array_split(shuffled, num_sites)]


def dirichlet_label_skew(
    labels: np.ndarray, num_sites: int, alpha: float, seed: int, min_site_size: int = 10
) -> list[np.ndarray]:
    """Each class is split over sites by proportions ~ Dirichlet(alpha); redrawn until every site has
    at least `min_site_size` samples."""
    labels = _class_ids(labels)
    _check_num_sites(num_sites, len(labels), min_site_size)
    _check_alpha(alpha)
    rng = np.random.default_rng(seed)
    members_by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(MAX_PARTITION_DRAWS):
        shares: list[list[np.ndarray]] = [[] for _ in range(num_sites)]
        for members in members_by_class:
            proportions = rng.dirichlet(np.full(num_sites, alpha))
            cuts = np.round(np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
            for site, part in zip(shares, np.split(rng.permutation(members), cuts)):
                site.append(part)
        sites = [np.sort(np.concatenate(parts)) for parts in shares]
        if min(len(site) for site in sites) >= min_site_size:
            return sites
    raise ValueError(
        f"dirichlet partition: no draw in {MAX_PARTITION_DRAWS} gave all {num_sites} sites >= {min_site_size} samples "
        f"({len(labels)} samples, alpha={alpha}); raise alpha, or lower the number of sites or min-site-size"
    )


def classes_per_site(labels: np.ndarray, num_sites: int, k: int, seed: int) -> list[np.ndarray]:
    """Pathological skew: each site holds exactly `k` classes (k = 1: single-class silos).

    Classes are dealt to sites cyclically along a seeded class order, so every class goes to at
    least one site and class holders differ in number by at most one; a class shared by several
    sites has its samples split evenly among them.
    """
    labels = _class_ids(labels)
    _check_num_sites(num_sites, len(labels))
    classes = np.unique(labels)
    if not 1 <= k <= len(classes):
        raise ValueError(f"classes-per-site={k}; expected 1..{len(classes)} (the number of classes in the data)")
    if num_sites * k < len(classes):
        raise ValueError(
            f"classes-per-site={k} with {num_sites} sites covers {num_sites * k} class slots but the data has "
            f"{len(classes)} classes; need num_sites * classes-per-site >= {len(classes)}"
        )
    rng = np.random.default_rng(seed)
    class_order = rng.permutation(classes)
    site_classes = [class_order[(site * k + np.arange(k)) % len(classes)] for site in range(num_sites)]
    shares: list[list[np.ndarray]] = [[] for _ in range(num_sites)]
    for c in classes:
        holders = [site for site in range(num_sites) if c in site_classes[site]]
        members = rng.permutation(np.flatnonzero(labels == c))
        if len(members) < len(holders):
            raise ValueError(
                f"class {c} has {len(members)} samples but {len(holders)} sites must share it; "
                "lower the number of sites or raise classes-per-site"
            )
        for site, part in zip(holders, np.array_split(members, len(holders))):
            shares[site].append(part)
    return [np.sort(np.concatenate(parts)) for parts in shares]


def multilabel_skew(
    labels: np.ndarray, num_sites: int, alpha: float, missing_classes: int, seed: int, min_site_size: int = 10
) -> list[np.ndarray]:
    """Multi-label skew: per-site label preferences, labels missing per site, site-specific co-occurrence.

    1. Missing labels: each site lacks `missing_classes` labels. Designs are balanced (each label is
       missing at floor or ceil of num_sites * missing / K sites, so each stays present somewhere);
       of several seeded designs the one that leaves the fewest samples without an eligible site wins.
       A sample is eligible at a site only if none of its labels is missing there.
    2. Preferences: site s draws p_s ~ Dirichlet(alpha) over the K labels; a sample's affinity to s
       is the product of p_s over its labels, which makes label combinations (co-occurrence) as
       well as single labels site-specific. A sample without labels has affinity 1 everywhere.
    3. Balance: affinities are rescaled per site (Sinkhorn) so every site expects an equal share;
       a per-site scale keeps the relative preferences between samples within a site unchanged.
    4. Every label that is not missing at a site (and that some sample carries) gets at least one
       sample there: one is reserved per such (site, label) first; then each remaining sample goes
       to a site drawn from its balanced probabilities.
    Samples with no eligible site are left out; `make_partition` reports them as unassigned.
    Preferences are redrawn until every site has `min_site_size` samples.
    """
    multi_hot = _multi_hot(labels)
    num_samples, num_labels = multi_hot.shape
    _check_num_sites(num_sites, num_samples, min_site_size)
    _check_alpha(alpha)
    if not 0 <= missing_classes < num_labels:
        raise ValueError(f"missing-classes={missing_classes}; expected 0..{num_labels - 1} for {num_labels} labels")
    if num_sites * (num_labels - missing_classes) < num_labels:
        raise ValueError(
            f"missing-classes={missing_classes} with {num_sites} sites leaves "
            f"{num_sites * (num_labels - missing_classes)} present-label slots for {num_labels} labels, "
            "so some label would be missing everywhere; need num_sites * (K - missing-classes) >= K"
        )
    design_rng, assignment_rng = np.random.default_rng(seed).spawn(2)
    missing = _missing_label_design(multi_hot, num_sites, missing_classes, design_rng)
    eligible = _eligibility(multi_hot, missing)
    placeable = np.flatnonzero(eligible.any(axis=1))
    if len(placeable) < num_sites * min_site_size:
        raise ValueError(
            f"multilabel-skew: only {len(placeable)} of {num_samples} samples have a site where none of their labels "
            f"is missing, fewer than {num_sites} sites x min-site-size {min_site_size}; lower missing-classes"
        )
    multi_hot, eligible = multi_hot[placeable], eligible[placeable]
    # A label no sample carries cannot be present anywhere; every other non-missing label must be.
    required = ~missing & (multi_hot.sum(axis=0) > 0)
    _check_labels_placeable(multi_hot, eligible, required)
    for _ in range(MAX_MULTILABEL_DRAWS):
        preferences = assignment_rng.dirichlet(np.full(num_labels, alpha), size=num_sites)
        log_affinity = multi_hot @ np.log(np.maximum(preferences, np.finfo(np.float64).tiny)).T
        log_probs = _balanced_log_probabilities(np.where(eligible, log_affinity, -np.inf))
        site_of = _draw_sites(log_probs, multi_hot, required, assignment_rng)
        if site_of is None:
            continue
        sizes = np.bincount(site_of, minlength=num_sites)
        if sizes.min() >= min_site_size:
            return [placeable[site_of == site] for site in range(num_sites)]
    raise ValueError(
        f"multilabel-skew: no draw in {MAX_MULTILABEL_DRAWS} gave all {num_sites} sites >= {min_site_size} samples "
        f"({len(placeable)} placeable samples, alpha={alpha}); raise alpha, or lower the number of sites "
        "or min-site-size"
    )


def _missing_label_design(
    multi_hot: np.ndarray, num_sites: int, missing_classes: int, rng: np.random.Generator
) -> np.ndarray:
    """(sites, K) bool: which labels each site lacks; the balanced candidate leaving fewest samples unplaceable."""
    num_labels = multi_hot.shape[1]
    best, best_unplaceable = None, None
    for _ in range(MISSING_DESIGN_CANDIDATES):
        design = np.zeros((num_sites, num_labels), dtype=bool)
        times_missing = np.zeros(num_labels, dtype=np.int64)
        for site in range(num_sites):
            # Least-missed labels first (random tie-break) keeps the counts within one of each other.
            chosen = np.lexsort((rng.random(num_labels), times_missing))[:missing_classes]
            design[site, chosen] = True
            times_missing[chosen] += 1
        unplaceable = int((~_eligibility(multi_hot, design).any(axis=1)).sum())
        if best_unplaceable is None or unplaceable < best_unplaceable:
            best, best_unplaceable = design, unplaceable
    return best


def _eligibility(multi_hot: np.ndarray, missing: np.ndarray) -> np.ndarray:
    """(N, sites) bool: sample i may live at site s when none of its labels is missing there."""
    return (multi_hot @ missing.T.astype(np.float64)) == 0


def _check_labels_placeable(multi_hot: np.ndarray, eligible: np.ndarray, required: np.ndarray) -> None:
    for site, label in zip(*np.nonzero(required)):
        if not (eligible[:, site] & (multi_hot[:, label] > 0)).any():
            raise ValueError(
                f"multilabel-skew: label {label} should be present at site {site}, but no sample carrying it has all "
                "its labels present there; lower missing-classes"
            )


def _balanced_log_probabilities(log_affinity: np.ndarray) -> np.ndarray:
    """Row-normalised log-probabilities (N, sites) whose column sums (expected site sizes) are equal.

    Sinkhorn scaling in the log domain: per-site scales are adjusted until each site expects
    N / sites samples. Near-deterministic affinities (alpha << 0.1) can make the iteration
    oscillate; then the best-balanced iterate within the budget is used.
    """
    num_samples, num_sites = log_affinity.shape
    log_target = np.log(num_samples / num_sites)
    log_scale = np.zeros(num_sites)
    best_log_probs, best_deviation = None, np.inf
    for _ in range(BALANCING_ITERATIONS):
        logits = log_affinity + log_scale
        log_probs = logits - logsumexp(logits, axis=1, keepdims=True)
        log_expected = logsumexp(log_probs, axis=0)
        deviation = np.abs(np.expm1(log_expected - log_target)).max()
        if deviation < best_deviation:
            best_log_probs, best_deviation = log_probs, deviation
        if deviation <= BALANCING_TOLERANCE:
            break
        log_scale += log_target - log_expected
    return best_log_probs


def _draw_sites(
    log_probs: np.ndarray, multi_hot: np.ndarray, required: np.ndarray, rng: np.random.Generator
) -> np.ndarray | None:
    """A site per sample: first one reserved sample per required (site, label), then the rest drawn
    (Gumbel-max: exact sampling that stays stable for probabilities far below float precision).
    None when reservations run out of candidates (the caller redraws)."""
    num_samples, num_sites = log_probs.shape
    site_of = np.full(num_samples, -1, dtype=np.int64)
    for site, label in zip(*np.nonzero(required)):
        carries = multi_hot[:, label] > 0
        if (carries & (site_of == site)).any():
            continue
        candidates = np.flatnonzero(carries & (site_of < 0) & np.isfinite(log_probs[:, site]))
        if len(candidates) == 0:
            return None
        site_of[candidates[np.argmax(log_probs[candidates, site] + rng.gumbel(size=len(candidates)))]] = site
    free = np.flatnonzero(site_of < 0)
    site_of[free] = np.argmax(log_probs[free] + rng.gumbel(size=(len(free), num_sites)), axis=1)
    return site_of


_SCHEME_LABEL_KIND = {"iid": None, "dirichlet": "single", "classes-per-site": "single", "multilabel-skew": "multi"}
# make_partition's keyword `classes_per_site` shadows the function of that name inside it.
_pathological_partition = classes_per_site


def make_partition(
    labels: np.ndarray,
    scheme: str,
    num_sites: int,
    *,
    alpha: float,
    classes_per_site: int,
    missing_classes: int,
    seed: int,
    min_site_size: int = 10,
) -> Partition:
    """Partition the train labels by `scheme`; sites below `min_site_size` are an error for every scheme."""
    if scheme not in _SCHEME_LABEL_KIND:
        raise ValueError(f"partition scheme {scheme!r} is unknown; valid: {', '.join(PARTITION_SCHEMES)}")
    kind = "multi" if labels.ndim == 2 else "single"
    needed = _SCHEME_LABEL_KIND[scheme]
    if needed is not None and needed != kind:
        fitting = "iid or multilabel-skew" if kind == "multi" else "iid, dirichlet or classes-per-site (or mosaic)"
        raise ValueError(
            f"partition {scheme!r} needs {needed}-label data but the labels are {kind}-label (shape {labels.shape}); "
            f"use {fitting}"
        )
    if scheme == "iid":
        sites = iid(len(labels), num_sites, seed)
    elif scheme == "dirichlet":
        sites = dirichlet_label_skew(labels, num_sites, alpha, seed, min_site_size)
    elif scheme == "classes-per-site":
        sites = _pathological_partition(labels, num_sites, classes_per_site, seed)
    else:
        sites = multilabel_skew(labels, num_sites, alpha, missing_classes, seed, min_site_size)
    sizes = [len(site) for site in sites]
    if min(sizes) < min_site_size:
        raise ValueError(
            f"partition {scheme!r} gives site sizes {sizes}, below min-site-size {min_site_size}; "
            "lower the number of sites or min-site-size"
        )
    site_indices = tuple(site.astype(np.int64) for site in sites)
    taken = np.concatenate(site_indices)
    unassigned = np.setdiff1d(np.arange(len(labels), dtype=np.int64), taken)
    return Partition(site_indices=site_indices, unassigned=unassigned, scheme=scheme)


def split_site_validation(indices: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_idx, val_idx): a seeded random `val_fraction` of a site's indices held out for validation;
    at least one validation and one training sample when val_fraction > 0 and the site has >= 2 samples."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val-fraction={val_fraction}; expected 0 <= val-fraction < 1")
    num = len(indices)
    num_val = round(num * val_fraction)
    if val_fraction > 0 and num >= 2:
        num_val = min(max(num_val, 1), num - 1)
    else:
        num_val = 0
    shuffled = np.random.default_rng(seed).permutation(np.asarray(indices, dtype=np.int64))
    return np.sort(shuffled[num_val:]), np.sort(shuffled[:num_val])


def label_counts(labels: np.ndarray, site_indices: Sequence[np.ndarray], num_classes: int) -> np.ndarray:
    """(sites, K) int64: samples of each class per site (multi-label: samples carrying each label)."""
    if labels.ndim == 2 and labels.shape[1] != num_classes:
        raise ValueError(f"multi-hot labels have {labels.shape[1]} columns but num_classes={num_classes}")
    if labels.ndim == 1 and len(labels) and labels.max() >= num_classes:
        raise ValueError(f"class id {labels.max()} is out of range for num_classes={num_classes}")
    counts = np.zeros((len(site_indices), num_classes), dtype=np.int64)
    for site, indices in enumerate(site_indices):
        site_labels = labels[indices]
        counts[site] = (
            site_labels.sum(axis=0).round().astype(np.int64)
            if labels.ndim == 2
            else np.bincount(site_labels, minlength=num_classes)
        )
    return counts


def label_cooccurrence(labels_multi_hot: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """(K, K) int64: entry (a, b) counts samples carrying both labels a and b (diagonal: label counts)."""
    site_labels = _multi_hot(labels_multi_hot)[indices].astype(np.int64)
    return site_labels.T @ site_labels


def partition_summary(
    labels: np.ndarray, partition: Partition, num_classes: int, class_names: Sequence[str]
) -> dict:
    """JSON-able description: scheme, site sizes, per-site label counts, unassigned samples and
    (multi-label) per-site co-occurrence matrices."""
    if len(class_names) != num_classes:
        raise ValueError(f"{len(class_names)} class names for num_classes={num_classes}")
    summary = {
        "scheme": partition.scheme,
        "num_sites": len(partition.site_indices),
        "class_names": [str(name) for name in class_names],
        "site_sizes": [len(indices) for indices in partition.site_indices],
        "label_counts": label_counts(labels, partition.site_indices, num_classes).tolist(),
        "unassigned": len(partition.unassigned),
        "unassigned_label_counts": label_counts(labels, [partition.unassigned], num_classes)[0].tolist(),
    }
    if labels.ndim == 2:
        summary["cooccurrence"] = [label_cooccurrence(labels, indices).tolist() for indices in partition.site_indices]
    return summary


def _class_ids(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"expected single-label class ids, int (N,); got {labels.dtype} {labels.shape}")
    if len(labels) and labels.min() < 0:
        raise ValueError(f"class ids must be >= 0; got {labels.min()}")
    return labels


def _multi_hot(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 2 or not np.isin(labels, (0, 1)).all():
        raise ValueError(f"expected multi-hot 0/1 labels shaped (N, K); got {labels.dtype} {labels.shape}")
    return labels.astype(np.float64)


def _check_num_sites(num_sites: int, num_samples: int, min_site_size: int = 1) -> None:
    if num_sites < 1:
        raise ValueError(f"num_sites={num_sites}; expected >= 1")
    if num_samples < num_sites * max(min_site_size, 1):
        raise ValueError(
            f"{num_samples} samples cannot give {num_sites} sites >= {max(min_site_size, 1)} samples each; "
            "lower the number of sites or min-site-size"
        )


def _check_alpha(alpha: float) -> None:
    if not alpha > 0:
        raise ValueError(f"alpha={alpha}; expected a Dirichlet concentration > 0 (smaller = more skew)")
