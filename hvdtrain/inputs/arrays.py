"""Arrays dealt to the ranks: every rank takes its own examples of each step, in an order
that is the same in any process, so a resumed run trains on what it would have.

- ``steps_per_epoch``, ``epoch_plan``, ``test_shard``: the plans (plain numpy) a Task's
  ``Data`` is trained and evaluated in (``hvdtrain.tasks.train``), and ``hk.dataset``'s;
- ``ArrayBatches``: a script's arrays (``hk.dataset``) as this rank's batches, a
  ``batches.TrainBatches`` for the fit driver, as a ``tf.data`` pipeline's
  ``pipeline.Batches`` is.
"""

from __future__ import annotations

import numpy as np

from hvdtrain.base.errors import ConfigError
from hvdtrain.inputs import nest


def steps_per_epoch(num_examples: int, batch_size: int, world_size: int) -> int:
    """Synchronous steps per epoch: every rank takes this many.

    Args:
        num_examples: the training examples, all ranks together.
        batch_size: examples per rank per step.
        world_size: the number of ranks.

    Returns:
        The full global batches in ``num_examples``; the remainder is left out of the epoch.
    """
    return num_examples // (batch_size * world_size)


def epoch_plan(
    num_examples: int,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> np.ndarray:
    """This rank's example indices for one epoch.

    One permutation of all examples per (seed, epoch), identical on every rank; global
    step k uses the k-th block of ``batch_size * world_size`` examples and rank r takes
    the r-th slice of it. The ranks' shards are disjoint and equal; the remainder that
    does not fill a global batch is left out of this epoch (another one next epoch).

    Args:
        num_examples: the training examples, all ranks together.
        batch_size: examples per rank per step.
        rank: this rank.
        world_size: the number of ranks.
        seed: the run's seed.
        epoch: the epoch, from 0.
        shuffle: False: the examples in their order.

    Returns:
        The indices, shaped ``[steps, batch_size]``.
    """
    steps = steps_per_epoch(num_examples, batch_size, world_size)
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    else:
        order = np.arange(num_examples)
    blocks = order[: steps * batch_size * world_size].reshape(steps, world_size, batch_size)
    return np.ascontiguousarray(blocks[:, rank, :])


def test_shard(num_examples: int, rank: int, world_size: int) -> np.ndarray:
    """This rank's part of the test set: every example is evaluated by exactly one rank.

    Args:
        num_examples: the test examples.
        rank: this rank.
        world_size: the number of ranks.

    Returns:
        The indices of this rank's examples.
    """
    return np.arange(rank, num_examples, world_size)


class ArrayBatches:
    """``hk.dataset``'s arrays as this rank's batches (a ``batches.TrainBatches``), in
    hvdtrain's order (``epoch_plan``): one permutation of all examples per (seed, epoch);
    global step k takes the k-th block of ``batch_size * size`` examples, rank r its r-th
    slice. ``batch_size=None``: each rank's whole shard per step.

    ``x``, ``y`` and ``sample_weight`` are arrays or what ``model.fit`` takes besides: dicts
    (by input or output name), tuples and lists of arrays, nested; every array holds the same
    examples along its first axis (``hvdtrain.inputs.nest``)."""

    def __init__(self, x, y, batch_size, seed, shuffle, world, sample_weight=None):
        self.x, self.y, self.seed, self.shuffle, self.world = x, y, seed, shuffle, world
        self.sample_weight = sample_weight
        parts = (("x", x), ("y", y)) + (
            (("sample_weight", sample_weight),) if sample_weight is not None else ()
        )
        n = nest.examples("hk.dataset", parts)
        if batch_size is not None and batch_size < 0:
            raise ConfigError(
                "batch_size",
                batch_size,
                "must be 0 or None (each rank's whole shard per step) or more",
            )
        self.batch_size = batch_size or n // world.size
        self.steps = steps_per_epoch(n, self.batch_size, world.size)
        if self.steps < 1:
            raise ConfigError(
                "batch_size",
                self.batch_size,
                f"a global batch of "
                f"{self.batch_size} x {world.size} ranks needs more than the "
                f"{n} examples",
            )
        self.examples, self.sample = n, nest.take(x, slice(0, 1))

    def info(self) -> dict:
        return {"train_examples": self.examples}

    def batches(self, first_epoch: int, end_epoch: int, first_step: int = 0):
        """A tf.data.Dataset of this rank's batches from (first_epoch, first_step) to the end."""
        import tensorflow as tf

        w = self.world
        idx = np.concatenate(
            [
                epoch_plan(
                    self.examples, self.batch_size, w.rank, w.size, self.seed, e, self.shuffle
                )[first_step if e == first_epoch else 0 :]
                for e in range(first_epoch, end_epoch)
            ]
        )
        parts = tuple(
            nest.map(tf.constant, p) for p in (self.x, self.y, self.sample_weight) if p is not None
        )
        # tf.data's default rewrites serialize the pipeline's graph with the arrays the map
        # captures (0.3-0.7 s for Fashion-MNIST's 188 MB) for nothing a gather needs: off,
        # as Keras' own array adapter has them.
        options = tf.data.Options()
        options.experimental_optimization.apply_default_optimizations = False
        return (
            tf.data.Dataset.from_tensor_slices(idx)
            .map(lambda i: tuple(nest.map(lambda a: tf.gather(a, i), p) for p in parts))
            .prefetch(2)
            .with_options(options)
        )
