"""Keras' BatchNormalization with its batch statistics over every rank's batch.

``from hvdtrain.layers import SyncBatchNormalization`` (or ``hvdtrain.SyncBatchNormalization``),
then ``SyncBatchNormalization()(x)`` where ``keras.layers.BatchNormalization()(x)`` stood: it
takes BatchNormalization's arguments. Keras 3 and Keras 2 (``TF_USE_LEGACY_KERAS=1``) each get
a subclass of their own BatchNormalization, made on first use.

In training, each call normalizes with the mean and variance of every rank's batch together:
each rank's per-channel [count, sum, sum of squares] go into one Horovod Sum allreduce, so the
count is right when the ranks' batches differ in size, and the gradient flows back through it.
With the gradients averaged over the ranks (``hvdtrain.DistributedOptimizer``), training on N
ranks gives one process's weights and moving statistics at the global batch. Its cost: one
small allreduce per layer per step in the forward pass and one in the backward pass. In
inference (``training=False``) it uses the moving statistics, with no collective; in one
process it is Keras' BatchNormalization.

Saved (``model.save``, the run directory's model.keras) it is Keras' own BatchNormalization, so
the file opens without hvdtrain and predicts the same; loaded, it normalizes per rank again:
build the model in code to train on from a checkpoint.

Args:
    **kwargs: BatchNormalization's arguments. Keras 2: ``fused=True`` and
        ``virtual_batch_size`` are refused (both keep the statistics per rank).

Raises:
    ValueError: Keras 2: ``fused=True`` or ``virtual_batch_size`` was given.
"""

from __future__ import annotations

from hvdtrain.base import compat
from hvdtrain.distributed.start import current


def global_moments(x, axes, world, weights=None, keepdims=False):
    """Mean and variance of a tensor over some axes and over every rank's tensor.

    What ``SyncBatchNormalization`` normalizes with, for a layer of one's own. Each rank's
    sums are taken about its own mean (two passes, as ``tf.nn.moments``) and combined in
    float64, so that a large mean does not cancel the variance away. Every rank must call
    it, with the same axes.

    Args:
        x: this rank's tensor.
        axes: the axes to reduce over (as ``tf.nn.moments``).
        world: the World to reduce over (``hvdtrain.world()``).
        weights: 0/1 weights broadcastable to ``x`` (from a mask) that choose the entries
            counted; None: all of them.
        keepdims: keep the reduced axes, of length 1.

    Returns:
        ``(mean, variance)``, in ``x``'s dtype.
    """
    import tensorflow as tf

    dtype = x.dtype
    if dtype in (tf.float16, tf.bfloat16):
        x = tf.cast(x, tf.float32)  # float16's range is too small for sums of squares
    if weights is None:
        sizes = tf.gather(tf.shape(x), axes)
        n = tf.cast(tf.reduce_prod(sizes), x.dtype) * tf.ones_like(
            tf.reduce_sum(x, axes, keepdims=True)
        )
        local_mean = tf.math.divide_no_nan(tf.reduce_sum(x, axes, keepdims=True), n)
        squares = tf.reduce_sum(tf.square(x - local_mean), axes, keepdims=True)
    else:
        w = tf.broadcast_to(tf.cast(weights, x.dtype), tf.shape(x))
        n = tf.reduce_sum(w, axes, keepdims=True)
        local_mean = tf.math.divide_no_nan(tf.reduce_sum(w * x, axes, keepdims=True), n)
        squares = tf.reduce_sum(w * tf.square(x - local_mean), axes, keepdims=True)
    n, local_mean = tf.cast(n, tf.float64), tf.cast(local_mean, tf.float64)
    # [count, sum, sum of squares] of this rank's entries: sums over the ranks are the global
    # ones. One tensor, one allreduce.
    local = tf.stack([n, n * local_mean, tf.cast(squares, tf.float64) + n * tf.square(local_mean)])
    count, total, total_squares = tf.unstack(world.sum_statistics(local))
    mean = tf.math.divide_no_nan(total, count)
    variance = tf.maximum(tf.math.divide_no_nan(total_squares, count) - tf.square(mean), 0.0)
    mean, variance = tf.cast(mean, dtype), tf.cast(variance, dtype)
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


def _collective(world) -> bool:
    """Whether the statistics must go over the ranks (an elastic world may grow later)."""
    return world.size > 1 or world.elastic


def _saved_as(cls, base):
    """Name ``cls`` like ``base``: Keras saves a layer by its class's name and module, so a
    model with ``cls`` saves ``base`` and opens without hvdtrain (as DistributedOptimizer's
    optimizers do)."""
    cls.__name__, cls.__qualname__, cls.__module__ = (
        base.__name__,
        base.__qualname__,
        base.__module__,
    )
    return cls


def _keras3_class(keras):
    base = keras.layers.BatchNormalization

    class SyncBatchNormalization(base):  # type: ignore[valid-type, misc]  # the Keras in use
        """Keras 3's BatchNormalization, its training statistics over every rank's batch."""

        def _moments(self, inputs, mask):
            world = current()
            if not _collective(world):
                return super()._moments(inputs, mask)
            weights = None
            if mask is not None:
                import tensorflow as tf

                weights = tf.expand_dims(mask, -1)
            return global_moments(inputs, self._reduction_axes, world, weights)

    return _saved_as(SyncBatchNormalization, base)


def _keras2_class(keras):
    base = keras.layers.BatchNormalization

    class SyncBatchNormalization(base):  # type: ignore[valid-type, misc]  # the Keras in use
        """Keras 2's BatchNormalization, its training statistics over every rank's batch."""

        def __init__(self, *args, fused=False, virtual_batch_size=None, **kwargs):
            # The fused kernel computes its statistics inside, out of reach of the allreduce.
            if fused:
                raise ValueError(
                    "SyncBatchNormalization: fused=True computes the statistics "
                    "in one kernel, per rank; leave fused unset"
                )
            if virtual_batch_size is not None:
                raise ValueError(
                    "SyncBatchNormalization: virtual_batch_size (per-rank ghost "
                    "batches) contradicts statistics over the global batch"
                )
            super().__init__(*args, fused=False, **kwargs)

        def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
            world = current()
            if not _collective(world):
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
            weights = None
            if mask is not None:
                import tensorflow as tf

                weights = tf.expand_dims(mask, -1)
            return global_moments(inputs, reduction_axes, world, weights, keepdims=keep_dims)

    return _saved_as(SyncBatchNormalization, base)


def __getattr__(name):
    # The class depends on which Keras the run uses, known once the program has started.
    if name == "SyncBatchNormalization":
        keras = compat.keras()
        cls = _keras3_class(keras) if compat.is_keras3() else _keras2_class(keras)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
