"""Synchronous updates, compiled: their input, the loss, the averaged gradients, the sums.

One compiled call runs up to ``n`` updates (``--steps-per-execution``) in a ``tf.while_loop``
that draws each update's input from an iterator (the epoch's; a tf.data pipeline's: the
run's), and stops after the first update whose [SIGTERM, non-finite loss] flags, reduced
with the gradients, are set. With ``--accumulate-steps N`` an update's input is N
micro-batches: their gradients are computed one after the other and averaged on the rank,
then reduced over the ranks once.

Input comes one of two ways, with the same batches in the same order (``data.epoch_plan``):
- in memory: the training arrays live on the device as constants and each step gathers its
  rows by index inside the compiled function (no host copy per step);
- streamed: arrays too big for memory (``np.load(..., mmap_mode="r")``, ``np.memmap``, or any
  object with ``len()`` and integer-array indexing) stay on disk; a background tf.data
  pipeline reads this rank's next batches (and only those) while the current step runs.
"""

from __future__ import annotations

import numpy as np

from hvdtrain.base.precision import scale_loss, to_float32
from hvdtrain.distributed.optimizer import apply_gradients
from hvdtrain.tasks.task import check_loss_shape, check_metric_shape

# Arrays up to this size are held on the device; larger ones are streamed even if they are
# in memory (a tf.constant is limited to 2 GiB, and a second copy of a large array hurts).
IN_MEMORY_BYTES = 1 << 30


def in_memory(array) -> bool:
    return (
        isinstance(array, np.ndarray)
        and not isinstance(array, np.memmap)
        and array.nbytes <= IN_MEMORY_BYTES
    )


def _converted(fn):
    """``fn`` as AutoGraph converts the code a converted function calls (what Keras 2 does for
    a layer's ``call``): a task's own functions keep AutoGraph's semantics inside a step that
    is traced without it."""
    import tensorflow as tf

    return tf.__internal__.autograph.tf_convert(fn, tf.__internal__.autograph.control_status_ctx())


class TrainStep:
    """``run(batches, n, stop)`` runs up to ``n`` synchronous updates in one compiled call and
    returns (updates done, [stop, non-finite loss] flags reduced over ranks);
    ``batches(plan)`` is the iterator of an epoch plan's step inputs that ``run`` draws from.

    Each update reduces its gradients in buckets (one grouped allreduce each, the first sent
    while the backward pass still runs) with the two flags in the last: no round of their
    own. The loop stops early after the first update whose reduced flags are set, so
    every rank stops after the same update: any rank's SIGTERM (``stop``, read by the host
    before the call) or any rank's non-finite loss.
    """

    def __init__(self, task, model, optimizer, world, data, sums, metric_fns, accumulate=1):
        import tensorflow as tf

        self.task, self.model = task, model
        # The task's own code, as AutoGraph converts it (its Python if/for on tensors work, as
        # they did inside a converted step); the step around it is traced as written.
        # (check() runs them as written, eagerly, so their own errors are theirs.)
        self.metric_fns = metric_fns
        self.preprocess, self._loss = (_converted(task.preprocess), _converted(task.loss))
        self._metrics = {name: _converted(fn) for name, fn in metric_fns.items()}
        self.accumulate = accumulate  # micro-batches per update (--accumulate-steps)
        self.x, self.y = data.x_train, data.y_train  # or a tf.data pipeline: see batches()
        self.sample = None  # (x, y): a pipeline's first batch, for check()
        self.first = True  # no call yet: the next one traces
        # Updates this rank finished, counted after each one's reduction: where a failed call
        # failed (the optimizer's own count may take the failed update's increment, which
        # nothing orders after its failing op).
        self.finished = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.streamed = not (in_memory(self.x) and in_memory(self.y))
        variables = model.trainable_variables
        dtype = variables[0].dtype if variables else tf.float32
        if not self.streamed:
            x_all, y_all = tf.constant(self.x), tf.constant(self.y)

        def gradients(x, y):
            """One micro-batch: its gradients, whether its loss is not finite, its sums."""
            x, y = self.preprocess(x, y)
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                per_example, step_sums = self.scores(y, pred)
                loss = tf.reduce_mean(per_example)
                if model.losses:  # regularisation: part of what is minimised, not reported
                    loss += tf.add_n([tf.cast(l, loss.dtype) for l in model.losses])
                # float16: times the loss scale (the gradients are unscaled after the reduction)
                scaled = scale_loss(optimizer, loss)
            # The loss is computed in float32 whatever the policy, so a loss scale never makes
            # it non-finite: a non-finite loss is divergence (or a float16 forward overflow,
            # which loss scaling cannot cure), a non-finite gradient alone is the scaler's.
            diverged = tf.cast(tf.logical_not(tf.math.is_finite(loss)), dtype)
            return tape.gradient(scaled, variables), diverged, step_sums

        def micro_batch(args, i):
            """The i-th of the update's ``accumulate`` micro-batches (its rows i*b..(i+1)*b)."""
            if not self.streamed:
                idx = tf.reshape(args, [self.accumulate, -1])[i]
                return tf.gather(x_all, idx), tf.gather(y_all, idx)
            return tuple(
                tf.reshape(
                    a, [self.accumulate, a.shape[0] // self.accumulate] + a.shape[1:].as_list()
                )[i]
                for a in args
            )

        def accumulated(args):
            """The mean of the update's micro-batch gradients (what one batch of all their
            examples with a mean loss gives), computed one micro-batch at a time."""
            if self.accumulate == 1:
                return gradients(
                    *(args if self.streamed else (tf.gather(x_all, args), tf.gather(y_all, args)))
                )
            grads, diverged, step_sums = gradients(*micro_batch(args, 0))
            present = [i for i, g in enumerate(grads) if g is not None]

            def body(i, total, diverged, step_sums):
                g, d, s = gradients(*micro_batch(args, i))
                return (
                    i + 1,
                    [t + tf.convert_to_tensor(g[j]) for t, j in zip(total, present)],
                    tf.maximum(diverged, d),
                    step_sums + s,
                )

            # One micro-batch at a time (parallel_iterations=1): the point is to hold one
            # micro-batch's activations, and layers' moving statistics update in order.
            _, total, diverged, step_sums = tf.while_loop(
                lambda i, *_: i < self.accumulate,
                body,
                (
                    tf.constant(1),
                    [tf.convert_to_tensor(grads[j]) for j in present],
                    diverged,
                    step_sums,
                ),
                parallel_iterations=1,
            )
            for j, t in zip(present, total):
                grads[j] = t / self.accumulate
            return grads, diverged, step_sums

        def update(args, stop):
            grads, diverged, step_sums = accumulated(args)
            flags = tf.stack([stop, diverged])
            # Horovod: the gradients are averaged over all ranks by the wrapped optimizer's
            # reduction, with the flags in the last bucket: no round of their own, and one
            # reduction per update however many micro-batches it accumulated.
            (flags,) = apply_gradients(optimizer, grads, variables, [flags])
            with tf.control_dependencies([sums.assign_add(step_sums)]):
                with tf.control_dependencies([self.finished.assign_add(1)]):
                    return tf.identity(flags)

        def run(batches, n, stop):
            stop = tf.cast(stop, dtype)

            def go_on(i, flags):
                return tf.logical_and(i < n, tf.reduce_max(flags) <= 0)

            def body(i, flags):
                return i + 1, update(next(batches), stop)

            # One update at a time (parallel_iterations=1): the next reads the weights the
            # previous one wrote.
            return tf.while_loop(
                go_on, body, (tf.constant(0), tf.zeros([2], dtype)), parallel_iterations=1
            )

        # Traced as written, without AutoGraph: every loop and branch here is TensorFlow's own
        # (tf.while_loop), and AutoGraph's conversion of this code, Horovod's and the optimizer
        # wrapper's took 2-3 s of each process's first call. The task's code is converted
        # (self.preprocess, self._loss, self._metrics).
        self._run = tf.function(run, autograph=False)

    def run(self, batches, n: int, stop: bool):
        """Up to ``n`` updates from ``batches``; (updates done, (stop, diverged)) on every rank."""
        import tensorflow as tf

        done, flags = self._run(batches, tf.constant(n, tf.int32), tf.constant(float(stop)))
        stop, diverged = flags.numpy() > 0
        self.first = False
        return int(done), bool(stop), bool(diverged)

    def scores(self, y, pred, eager=False):
        """Per-example loss, and the sums [loss, count, metric...] over this batch; both
        from the predictions in float32 (a mixed-precision model's are float16/bfloat16).
        In a compiled step the task's functions as AutoGraph converts them; ``eager``: as
        written."""
        import tensorflow as tf

        loss, metrics = (self.task.loss, self.metric_fns) if eager else (self._loss, self._metrics)
        pred = to_float32(pred)
        per_example = loss(y, pred)
        parts = [per_example, tf.ones_like(per_example)]
        parts += [tf.cast(fn(y, pred), per_example.dtype) for fn in metrics.values()]
        return per_example, tf.stack([tf.reduce_sum(tf.cast(p, tf.float64)) for p in parts])

    def check(self) -> None:
        """Before anything is compiled: the task's loss and metrics must give one value per
        example, of a type the sums can take."""
        import tensorflow as tf

        x, y = self.sample[:2] if self.sample is not None else (self.x, self.y)
        n = min(2, len(x))
        x, y = self.task.preprocess(tf.constant(np.asarray(x[:n])), tf.constant(np.asarray(y[:n])))
        # In float32, as the step and the scores give them to the loss and the metrics (a
        # mixed-precision model's outputs are 16-bit).
        pred = to_float32(self.model(x, training=False))
        check_loss_shape(self.task, self.task.loss(y, pred), n)
        for name, fn in self.metric_fns.items():
            check_metric_shape(self.task, name, tf.convert_to_tensor(fn(y, pred)), n)
        # The sums' casts: a metric of a type they cannot take fails here.
        self.scores(y, pred, eager=True)

    def batches(self, plan: np.ndarray):
        """An iterator over the steps' inputs for ``plan`` (rows of example indices),
        prefetched: index rows (in memory) or the rows' arrays read from disk (streamed)."""
        import tensorflow as tf

        if not isinstance(
            plan, np.ndarray
        ):  # a tf.data pipeline's batches (hvdtrain.inputs.pipeline)
            return iter(plan)
        # Without tf.data's autotuning: a fixed prefetch has nothing to tune, and an iterator
        # whose autotuner runs is slow to delete (its tuning thread is joined): 3-9 s at each
        # epoch's end on 2 busy cores, up to a ResNet-50 epoch's half.
        options = tf.data.Options()
        options.autotune.enabled = False
        return iter(self._rows(plan).prefetch(2).with_options(options))

    def _rows(self, plan: np.ndarray):
        """The dataset of ``plan``'s steps: its index rows (in memory), or the rows' arrays
        read from disk (streamed)."""
        import tensorflow as tf

        if not self.streamed:
            return tf.data.Dataset.from_tensor_slices(plan)
        x, y = self.x, self.y
        spec = (
            tf.TensorSpec((plan.shape[1],) + tuple(x.shape[1:]), tf.as_dtype(x.dtype)),
            tf.TensorSpec((plan.shape[1],) + tuple(y.shape[1:]), tf.as_dtype(y.dtype)),
        )

        def read():
            for idx in plan:  # only this rank's rows are read from the array
                yield np.asarray(x[idx]), np.asarray(y[idx])

        return tf.data.Dataset.from_generator(read, output_signature=spec)
