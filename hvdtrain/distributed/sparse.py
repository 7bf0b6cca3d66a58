"""Sparse gradients (an Embedding's ``tf.IndexedSlices``) kept sparse across the ranks.

An Embedding's gradient names only the rows its batch looked up. Reducing it dense sends the
whole table every step (a 1,000,000 x 16 float32 table: 64 MB through a ring allreduce, for
the few hundred rows a batch touches); Horovod's way, which this is, gathers every rank's
rows and their indices instead (two allgathers), and the average divides the gathered rows by
the world size. Which way a gradient goes is decided here, from static shapes only, so every
rank traces the same collectives:

    gathered   when  size * (the slices' rows)  <  ratio * (the variable's rows)
    dense      otherwise (Horovod's ``sparse_as_dense``)

``ratio`` is ``HVDTRAIN_SPARSE_AS_DENSE_RATIO`` (default 1: the ranks' rows together are
fewer than the table's). A ring allreduce sends each rank about twice the table; an
allgather sends each rank's rows once, with their indices: at ratio 1 a gathered gradient of
16 columns sends at most about 56% of the dense one's bytes. ``0``: always dense (Horovod's
``sparse_as_dense=True``); ``inf``: always gathered (Horovod's default).

What the optimizer sees does not change: the gathered rows are summed into the dense gradient
on each rank (repeated rows added up, as ``tf.convert_to_tensor`` of the slices does) before
it is applied, the gradient the dense reduction gives; only what crosses the network is
smaller. (Keras' Adam updates a sparse gradient's moments otherwise than a dense one's, so a
model trains alike at any world size only if every world size applies it dense.)
"""

from __future__ import annotations

from hvdtrain.base.config import env_number

# HVDTRAIN_SPARSE_AS_DENSE_RATIO's default: gathered when the ranks' rows are fewer than the
# table's, where an allgather sends at most about half a ring allreduce's bytes.
SPARSE_AS_DENSE_RATIO = 1.0


def ratio() -> float:
    """HVDTRAIN_SPARSE_AS_DENSE_RATIO, checked: a number, 0 or more (``inf`` allowed)."""
    return env_number(
        "HVDTRAIN_SPARSE_AS_DENSE_RATIO",
        SPARSE_AS_DENSE_RATIO,
        lambda v: v >= 0,
        "give a number, 0 or more (0: sparse gradients "
        "reduced dense; inf: always gathered; default "
        f"{SPARSE_AS_DENSE_RATIO:g})",
        strip=True,
    )


def gathers(rows, table_rows, size: int, ratio: float, elastic: bool = False) -> bool:
    """Whether a sparse gradient of ``rows`` rows (static; None: unknown) of a variable of
    ``table_rows`` rows travels gathered on ``size`` ranks. Every argument is the same on
    every rank, so every rank takes the same way."""
    if ratio == 0:
        return False
    # Unknown rows (a batch of unknown size, traced so by Keras after a short last batch),
    # and elastic worlds (a rank that joins traces with the new size, the others keep their
    # step traced with the old one): gathered, Horovod's own way for every sparse gradient,
    # decided without the unknown. A sparse gradient names a batch's rows of a table, far
    # fewer in every Embedding that makes one.
    if rows is None or table_rows is None or elastic:
        return True
    return size * rows < ratio * table_rows


def shape_of(grad):
    """(the slices' rows, the variable's rows) of an IndexedSlices, static, None if unknown."""
    import tensorflow as tf

    rows = grad.indices.shape[0] if grad.indices.shape.rank == 1 else None
    dense = None if grad.dense_shape is None else tf.get_static_value(grad.dense_shape)
    return rows, None if dense is None else int(dense[0])


def reduce_gathered(world, grads, op, compression, gradient_predivide_factor: float, ratio: float):
    """The sparse gradients among ``grads`` that go gathered, reduced: (``grads`` with each
    of those replaced by its reduced dense gradient, their positions). The rest are left for
    the dense reduction. ``op``: Horovod's Average or Sum (Adasum combines dense tensors
    only: its gradients all go dense)."""
    import tensorflow as tf

    hvd = world.hvd
    grads = list(grads)
    done: list[int] = []
    if op not in (hvd.Average, hvd.Sum):
        return grads, done
    for i, g in enumerate(grads):
        if not isinstance(g, tf.IndexedSlices):
            continue
        rows, table_rows = shape_of(g)
        if not gathers(rows, table_rows, world.size, ratio, world.elastic):
            continue
        grads[i] = _gathered(world, g, op, compression, gradient_predivide_factor)
        done.append(i)
    return grads, done


def _gathered(world, grad, op, compression, factor: float):
    """One sparse gradient through two allgathers, then dense on this rank. The average's
    scaling is the dense reduction's, as Horovod's C++ applies it: the prescale (1 / factor)
    before the collective, the postscale (factor / size) after it."""
    import tensorflow as tf

    hvd = world.hvd
    values = grad.values
    average = op == hvd.Average
    if average and factor != 1.0:
        values = values * tf.cast(1.0 / factor, values.dtype)
    compressed, ctx = compression.compress(values)
    values = compression.decompress(hvd.allgather(compressed), ctx)
    indices = hvd.allgather(grad.indices)
    if average:
        # Elastic: the size when run, not when traced (Horovod's own allreduce does the same).
        size = (
            tf.cast(hvd.size_op(), tf.float64)
            if world.elastic
            else tf.constant(float(world.size), tf.float64)
        )
        values = values * tf.cast(factor / size, values.dtype)
    # The gathered rows summed into the dense gradient (repeated rows added up): what the
    # optimizer applies, on every world size.
    return tf.convert_to_tensor(tf.IndexedSlices(values, indices, grad.dense_shape))
