"""The exact AUC of scores, by hand: the Mann-Whitney statistic from average ranks (a tied group shares the
mean of its ranks), the oracle for the device-side AUCs in ``convbert_ds.model.electra``."""

from __future__ import annotations


def exact_auc(scores: list[float], positive: list[bool]) -> float:
    """P(a positive's score > a negative's), ties counting half; 0.5 when a class is empty."""
    order = sorted(range(len(scores)), key=scores.__getitem__)
    ranks = [0.0] * len(scores)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and scores[order[end + 1]] == scores[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            ranks[i] = (start + end) / 2 + 1  # ranks from 1: the group's mean
        start = end + 1
    n_pos = sum(positive)
    n_neg = len(positive) - n_pos
    if not n_pos or not n_neg:
        return 0.5
    return (sum(r for r, p in zip(ranks, positive) if p) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
