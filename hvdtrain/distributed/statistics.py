"""A model's statistics that each rank updates from its own batches (BatchNormalization's
moving mean and variance) kept the same on every rank: averaged over the ranks when the run
engine asks (before every evaluation, checkpoint, elastic commit and the final save)."""

from __future__ import annotations

import numpy as np

from hvdtrain.distributed.world import World


class MovingStatistics:
    """The non-trainable float weights of a model (BatchNormalization's moving mean and
    variance, any other statistic a layer updates in training), kept the same on every rank.

    Each rank's follow its own batches between two ``sync`` calls; ``sync`` replaces them by
    their average over the ranks with one host allreduce. The run engine syncs before every
    evaluation, checkpoint, elastic commit and the final save, once per step at most (the
    semantics of MultiWorkerMirroredStrategy's ON_READ variables with MEAN aggregation).
    """

    def __init__(self, world: World, weights):
        self.world = world
        self.weights = [v for v in weights if np.asarray(v.numpy()).dtype.kind == "f"]
        self._synced_step: int | None = None  # the global step they were last averaged at

    def sync(self, global_step: int) -> None:
        if not self.weights or self.world.size == 1 or self._synced_step == global_step:
            return
        self._synced_step = global_step  # the same on every rank: all skip, or none
        now = [np.asarray(v.numpy()) for v in self.weights]
        flat = np.concatenate([np.ravel(a).astype(np.float64) for a in now])
        mean, at = self.world.allreduce_sum(flat) / self.world.size, 0
        for v, a in zip(self.weights, now):
            v.assign(mean[at : at + a.size].reshape(a.shape).astype(a.dtype))
            at += a.size
