"""ROC AUC, exact, with ties: the click models' ``val_auc``.

AUC is the probability that a random positive scores above a random negative, a tie
counting one half: the Mann-Whitney U statistic over n_pos * n_neg. With average ranks
(tied scores share the mean of their ranks), ``U = sum of the positives' ranks -
n_pos (n_pos + 1) / 2``. One sort: O(n log n), numpy, float64 throughout.
"""

from __future__ import annotations

import numpy as np


def auc(scores, labels) -> float:
    """ROC AUC of ``scores`` [N] (any monotone score: logits or probabilities) against
    0/1 ``labels`` [N].

    Raises:
      ValueError: shapes differ, a score is not finite, a label is not 0 or 1, or only
        one class is present (AUC is undefined).
    """
    scores = np.asarray(scores, np.float64).ravel()
    labels = np.asarray(labels).ravel()
    if scores.shape != labels.shape:
        raise ValueError(f"auc: {scores.size} scores but {labels.size} labels")
    if not np.isfinite(scores).all():
        raise ValueError(f"auc: {int((~np.isfinite(scores)).sum())} scores are NaN or infinite")
    positive = labels == 1
    if not (positive | (labels == 0)).all():
        raise ValueError(f"auc: labels must be 0 or 1, found {np.unique(labels[~(positive | (labels == 0))])[:5]}")
    n_pos = int(positive.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"auc: undefined with {n_pos} positive and {n_neg} negative labels")
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Tie groups of the sorted scores: [start, end) each; their average 1-based rank.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    ranks = np.empty(scores.size, np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))
