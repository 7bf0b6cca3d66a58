"""The fit path's epoch and validation metrics made exact over all ranks: each metric's state
variables (sums and counts) summed over the ranks, and the results read from the sums."""

from __future__ import annotations

import numpy as np


class GlobalMetrics:
    """The model's metrics made exact over all ranks: their state variables (sums and
    counts: Mean, accuracy, AUC, ...) summed over ranks."""

    def __init__(self, model, world):
        self.model, self.world = model, world

    def variables(self) -> list:
        seen, found = set(), []
        for metric in self.model.metrics:
            for v in metric.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    found.append(v)
        return found

    def flat(self) -> np.ndarray:
        return np.concatenate(
            [np.ravel(v.numpy()).astype(np.float64) for v in self.variables()] or [np.zeros(0)]
        )

    def summed(self) -> np.ndarray:
        """All ranks: the metric state so far, summed over ranks (what a checkpoint keeps)."""
        return self.world.allreduce_sum(self.flat())

    def add(self, flat) -> None:
        self._put(flat, add=True)

    def _put(self, flat, add: bool) -> None:
        """Each metric variable's part of ``flat``, added to it or put in its place."""
        at, flat = 0, np.asarray(flat)
        for v in self.variables():
            n = int(np.prod(v.shape))
            now = np.asarray(v.numpy())
            part = flat[at : at + n].reshape(now.shape).astype(now.dtype)
            v.assign(now + part if add else part)
            at += n

    def reduce(self, stop: bool = False):
        """All ranks: put the sum over ranks into every metric variable; return the results,
        and whether ``stop`` was set on any rank: one host allreduce carries both."""
        total = self.world.allreduce_sum(np.append(self.flat(), float(stop)))
        self._put(total[:-1], add=False)
        return (
            {k: float(v) for k, v in self.model.get_metrics_result().items()},
            bool(total[-1] > 0),
        )
