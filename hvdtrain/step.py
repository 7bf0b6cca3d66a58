"""One synchronous update, compiled: its input, the loss, the averaged gradients, the sums.

Input comes one of two ways, with the same batches in the same order (``data.epoch_plan``):
- in memory: the training arrays live on the device as constants and each step gathers its
  rows by index inside the compiled function (no host copy per step);
- streamed: arrays too big for memory (``np.load(..., mmap_mode="r")``, ``np.memmap``, or any
  object with ``len()`` and integer-array indexing) stay on disk; a background tf.data
  pipeline reads this rank's next batches (and only those) while the current step runs.
"""
from __future__ import annotations

import numpy as np

from hvdtrain import compat
from hvdtrain.task import check_loss_shape

# Arrays up to this size are held on the device; larger ones are streamed even if they are
# in memory (a tf.constant is limited to 2 GiB, and a second copy of a large array hurts).
IN_MEMORY_BYTES = 1 << 30


def in_memory(array) -> bool:
    return (isinstance(array, np.ndarray) and not isinstance(array, np.memmap)
            and array.nbytes <= IN_MEMORY_BYTES)


class TrainStep:
    """``step(args, stop)`` runs one update and returns [stop, non-finite loss] flags summed
    over ranks;
    ``batches(plan)`` yields the ``args`` of each step of an epoch plan."""

    def __init__(self, task, model, optimizer, world, data, sums, metric_fns):
        import tensorflow as tf

        self.task, self.model, self.metric_fns = task, model, metric_fns
        self.x, self.y = data.x_train, data.y_train
        self.streamed = not (in_memory(self.x) and in_memory(self.y))

        def update(x, y, stop):
            x, y = task.preprocess(x, y)
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                per_example, step_sums = self.scores(y, pred)
                loss = tf.reduce_mean(per_example)
                if model.losses:  # regularisation: part of what is minimised, not reported
                    loss += tf.add_n(model.losses)
            # Horovod: the wrapped optimizer averages the gradients over all ranks.
            compat.minimize(optimizer, tape, loss, model.trainable_variables)
            sums.assign_add(step_sums)
            # A two-number allreduce: any rank's SIGTERM (stop) and any rank's non-finite loss
            # become every rank's decision at this same step. (Being ready before the
            # gradients, it costs Horovod a negotiation round of its own: docs/PERFORMANCE.md.)
            diverged = tf.cast(tf.logical_not(tf.math.is_finite(loss)), stop.dtype)
            return world.sum_in_graph(tf.stack([stop, diverged]))

        if self.streamed:
            self.step = tf.function(lambda xy, stop: update(xy[0], xy[1], stop))
        else:
            x_all, y_all = tf.constant(self.x), tf.constant(self.y)
            self.step = tf.function(
                lambda idx, stop: update(tf.gather(x_all, idx), tf.gather(y_all, idx), stop))

    def scores(self, y, pred):
        """Per-example loss, and the sums [loss, count, metric...] over this batch."""
        import tensorflow as tf

        per_example = self.task.loss(y, pred)
        parts = [per_example, tf.ones_like(per_example)]
        parts += [tf.cast(fn(y, pred), per_example.dtype) for fn in self.metric_fns.values()]
        return per_example, tf.stack([tf.reduce_sum(tf.cast(p, tf.float64)) for p in parts])

    def check(self) -> None:
        """Before anything is compiled: the task's loss must give one value per example."""
        import tensorflow as tf

        n = min(2, len(self.x))
        x, y = self.task.preprocess(tf.constant(np.asarray(self.x[:n])),
                                    tf.constant(np.asarray(self.y[:n])))
        check_loss_shape(self.task, self.task.loss(y, self.model(x, training=False)), n)

    def batches(self, plan: np.ndarray):
        """The steps' inputs for ``plan`` (rows of example indices), prefetched."""
        import tensorflow as tf

        if not self.streamed:
            return tf.data.Dataset.from_tensor_slices(plan).prefetch(2)
        x, y = self.x, self.y
        spec = (tf.TensorSpec((plan.shape[1],) + tuple(x.shape[1:]), tf.as_dtype(x.dtype)),
                tf.TensorSpec((plan.shape[1],) + tuple(y.shape[1:]), tf.as_dtype(y.dtype)))

        def read():
            for idx in plan:  # only this rank's rows are read from the array
                yield np.asarray(x[idx]), np.asarray(y[idx])

        return tf.data.Dataset.from_generator(read, output_signature=spec).prefetch(2)
