"""``hvdtrain.DistributedOptimizer``: Horovod's synchronous gradient averaging for any Keras
optimizer, under Keras 3 as under Keras 2.

    opt = hvdtrain.DistributedOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss=..., jit_compile=False)   # or use it in a custom loop

Before each update, the gradients are averaged over every rank by Horovod ring-allreduces,
so every rank applies the same update: what ``hvd.DistributedOptimizer`` does, and what TF1's
SyncReplicasOptimizer did in the seeds. hvdtrain's own reduction (Keras 3's, and the Task
path's step under either Keras) sends them in buckets of about 4 MiB
(``HVDTRAIN_BUCKET_BYTES``), one grouped allreduce each, in the order the backward pass
produces them, so the last layers' are reduced while the first layers' are computed; Horovod's
Keras 2 wrapper sends one allreduce per gradient, which overlaps alike. Under Keras 2
(``TF_USE_LEGACY_KERAS=1``) this *is* Horovod's ``horovod.tensorflow.keras``
``DistributedOptimizer``; under Keras 3 it is hvdtrain's, with the same arguments and meaning.
(Horovod's own works under Keras 3 too, with scripts/patches/python/, but it makes a new
optimizer from the old one's config, and this one wraps in place, keeping the optimizer's
state, carries the step's stop flags in the gradients' last bucket, and turns compile's
``LossScaleOptimizer(DistributedOptimizer(opt))`` around.) In one process Keras 2's is
returned unchanged (but for ``backward_passes_per_step``), and Keras 3's is wrapped alike,
with nothing to reduce.

Sparse gradients (an Embedding's ``tf.IndexedSlices``) cross the ranks sparse when that sends
less: each rank's rows and their indices go by two Horovod allgathers instead of the whole
table by the allreduce, when size x (the gradient's rows) < ``HVDTRAIN_SPARSE_AS_DENSE_RATIO``
(default 1) x (the table's rows), decided from static shapes so that every rank decides alike
(``hvdtrain.distributed.sparse``; ``0``: always dense, Horovod's ``sparse_as_dense=True``).
What the optimizer applies is the dense gradient at every world size on hvdtrain's own paths
(the Task path's step under either Keras; Keras 3's ``apply``): the gathered rows are summed
into it on each rank, so Adam trains an Embedding alike on one process and on N ranks. Under
Keras 2 the fit path is Horovod's wrapper, which gathers them sparse on N ranks and applies
them sparse, as one process does.

``backward_passes_per_step=N`` accumulates: each update applies the mean of N calls'
gradients (N micro-batches), reduced over the ranks once, at the N-th call. Under Keras 3 this
is Keras' own ``gradient_accumulation_steps=N`` (its accumulators are optimizer variables, so
they are saved with it; ``iterations`` counts updates) with the reduction at the update; under
Keras 2 it is Horovod's ``backward_passes_per_step`` with ``average_aggregated_gradients``
(``iterations`` counts calls there: ``updates()`` below counts updates under either Keras).

Loss scaling (float16 mixed precision, see ``hvdtrain.base.precision``) composes with it in either
order: ``DistributedOptimizer(LossScaleOptimizer(opt))`` is made to reduce the gradients
before the scaler checks them, under both Keras; ``LossScaleOptimizer(DistributedOptimizer(opt))``
(what ``compile`` makes under a ``mixed_float16`` policy) is right as it is under Keras 2 and
is turned around by ``reduce_before_loss_scaling`` under Keras 3. Loss scaling and
``backward_passes_per_step`` together are refused (the Task path's ``--accumulate-steps``
accumulates in its own step and takes both).
"""

from __future__ import annotations

from typing import Any

from hvdtrain.base import compat, precision
from hvdtrain.base.errors import ConfigError
from hvdtrain.distributed.start import current


def DistributedOptimizer(
    optimizer,
    op: str = "average",
    compression: str = "none",
    gradient_predivide_factor: float = 1.0,
    world=None,
    backward_passes_per_step: int = 1,
):
    """Wrap an optimizer so that every update uses gradients reduced over all ranks.

    Any Keras optimizer, under Keras 3 as under Keras 2 (``TF_USE_LEGACY_KERAS=1``, where it
    is Horovod's ``horovod.tensorflow.keras.DistributedOptimizer``). Horovod is started if
    hvdtrain has not started it yet. Float16 loss scaling composes with it in either order
    (``compile`` under a ``mixed_float16`` policy wraps it in a ``LossScaleOptimizer``).

    Args:
        optimizer: a Keras optimizer of the Keras in use.
        op: ``"average"`` (the default: the learning rate keeps its single-process meaning),
            ``"sum"`` or ``"adasum"`` (Keras 3 only: Horovod's Keras 2 wrapper refuses it);
            Horovod's ``hvd.Average`` etc. are accepted too.
        compression: ``"none"`` or ``"fp16"`` (gradients travel as float16), or
            ``hvd.Compression.*``.
        gradient_predivide_factor: average as ``sum(g / f) * f / size`` instead of
            ``sum(g) / size`` (guards float16 sums against overflow); op ``"average"`` only.
        world: the World to reduce over (default: this process's, ``hvdtrain.world()``).
        backward_passes_per_step: N > 1 accumulates the gradients of N calls (micro-batches)
            on each rank and applies their mean, reduced over the ranks once, every N-th
            call: N micro-batches of b train as one batch of N * b with a mean loss. Keras 3:
            the optimizer must not be built yet.

    Returns:
        The optimizer to give ``model.compile`` (or to use in a custom loop). Under Keras 3
        it is ``optimizer`` itself, wrapped in place: its state, learning-rate schedule and
        saved form stay those of its own class, so a model saved with it loads without
        hvdtrain. In one process under Keras 2, ``optimizer`` unchanged.

    Raises:
        ValueError: ``op``, ``compression`` or ``gradient_predivide_factor`` is not one of
            the values above.
        ConfigError: ``backward_passes_per_step`` is not an integer of at least 1, or
            cannot accumulate here (with float16 loss scaling; an optimizer already built).
    """
    reduction: Any = (world or current()).reduction(op, compression, gradient_predivide_factor)
    passes = _backward_passes(optimizer, backward_passes_per_step, reduction)
    if reduction is None:  # one process: nothing to reduce
        if not compat.is_keras3():
            return optimizer
        # Keras 3 still wraps it: sparse gradients are applied dense, as N ranks apply them.
        reduction = _Alone()
    if compat.is_keras3():
        # hvdtrain's reduces in apply() with Horovod's grouped allreduces, in place (see the
        # module's docstring for why not Horovod's). Around a LossScaleOptimizer, it reduces
        # before the scaler checks the gradients.
        optimizer = _reducing_subclass(optimizer, passes)
    elif precision.is_loss_scaled(optimizer):
        # Horovod: Keras 2's scaler must see the reduced gradients (one decision on every
        # rank), and Horovod's wrapper reduces in compute_gradients, which the scaler calls
        # on its inner optimizer: the wrapper goes inside.
        optimizer = type(optimizer)(
            reduction.keras2_optimizer(optimizer.inner_optimizer, passes),
            initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps,
        )
    else:
        optimizer = reduction.keras2_optimizer(optimizer, passes)
    # What apply_gradients below needs to put the step's flags in the gradients' reduction.
    # object.__setattr__: Keras 3 would track an attribute set the usual way as state.
    object.__setattr__(optimizer, "_hvdtrain_reduction", reduction)
    return optimizer


class _Alone:
    """Keras 3, one process: nothing to reduce. The wrapper stays for ``_apply_reduced``,
    which applies sparse gradients dense as on N ranks."""

    carries_riders = True  # the riders go through __call__ with the gradients

    def __call__(self, grads) -> list:
        return list(grads)


def _dense(grads) -> list:
    """An Embedding's sparse gradient (``tf.IndexedSlices``) as a dense tensor. N ranks
    return it dense from the reduction (gathered, or reduced dense: Horovod's
    ``sparse_as_dense``); Keras' Adam (any optimizer with slots) updates a sparse gradient's
    moments otherwise than a dense one's (rows repeated in a batch, rows not in it), so one
    process applies it dense too: a model trains alike at any world size."""
    import tensorflow as tf

    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def _backward_passes(optimizer, n, reduction) -> int:
    """Check ``backward_passes_per_step``; Keras 3: set the optimizer's own accumulation."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(
            "backward_passes_per_step", n, "must be an integer, at least 1 (1: no accumulation)"
        )
    own = getattr(optimizer, "gradient_accumulation_steps", None) or 1
    if n == 1 or n == own:
        return own
    if precision.is_loss_scaled(optimizer):
        raise ConfigError(
            "backward_passes_per_step",
            n,
            "not with a LossScaleOptimizer "
            "(float16 loss scaling): use bfloat16, or no accumulation",
        )
    if not compat.is_keras3():
        if reduction is None:
            raise ConfigError(
                "backward_passes_per_step",
                n,
                "under Keras 2 accumulation is "
                "Horovod's wrapper's, and this process runs without Horovod",
            )
        return n
    if own != 1 or getattr(optimizer, "built", False):
        had = f" with gradient_accumulation_steps={own}" if own != 1 else ""
        raise ConfigError(
            "backward_passes_per_step",
            n,
            f"the {type(optimizer).__name__} "
            f"optimizer is built already{had}; wrap it before compile or any use",
        )
    # Keras' own accumulation: averaged over the N calls, applied at the N-th; its
    # accumulators are optimizer variables (checkpointed, broadcast) and its iterations
    # count updates, as the Task path's global step does.
    optimizer.gradient_accumulation_steps = n
    return n


def _reducing_subclass(optimizer, passes: int = 1):
    """Keras 3: make ``optimizer`` apply its reduction's result instead of its gradients.

    The optimizer's class becomes a subclass of its own class named like it (the pattern of
    Horovod's wrapper), whose ``apply`` reduces first; ``apply_gradients`` and ``fit`` go
    through ``apply``. Accumulating (``passes`` > 1), Keras' ``apply`` adds each call's
    gradients to its accumulators and only an update's mean is reduced: in
    ``_clip_gradients``, which Keras calls once per update, on that mean, before clipping
    (as Horovod's Keras 2 wrapper reduces before the optimizer clips). Wrapping twice would
    average twice: refused.
    """
    cls = type(optimizer)
    if getattr(cls, "_hvdtrain_distributed", False):
        raise ValueError(f"{cls.__name__} optimizer is already a DistributedOptimizer")

    def apply(self, grads, trainable_variables=None):
        # Horovod: every rank applies the same, averaged gradients (a synchronous update).
        return _apply_reduced(
            self, _reduce(self, self._hvdtrain_reduction, list(grads)), trainable_variables
        )

    def _clip_gradients(self, grads):
        # Horovod: one allreduce per update, of the N micro-batches' mean; every rank takes
        # the update branch at the same call (the count is in the broadcast iterations).
        return super(wrapped, self)._clip_gradients(  # type: ignore[arg-type]  # made below
            _reduce(self, self._hvdtrain_reduction, list(grads))
        )

    methods = {"_clip_gradients": _clip_gradients} if passes > 1 else {"apply": apply}
    wrapped = type(
        cls.__name__,
        (cls,),
        {
            **methods,
            "_hvdtrain_distributed": True,
            # Saved models name the optimizer's own class, so they load without hvdtrain.
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )
    optimizer.__class__ = wrapped
    return optimizer


class StopFlags:
    """The fit path's SIGTERM flag, riding in an optimizer's gradient allreduce.

    ``hk.fit`` attaches one to the optimizer it counts steps with (``attach``) before Keras
    traces its train function. Every update then reduces ``[this rank's flag, 1]`` with the
    gradients, in their last bucket, and adds the result to ``total``: the stop flags
    summed over ranks and the updates that carried them. Every rank reads the same sums
    (``read``: a variable read, no communication), so every rank takes the same decision
    after a call from the updates it ran. A call whose updates carried nothing (a train
    function traced before the flags were attached, a ``train_step`` that reduces its own
    way) shows no new update, and the caller asks the ranks by a host allreduce instead.
    The variables are plain ``tf.Variable``s kept outside the optimizer's tracked state: not
    in its checkpoints, its saved form or its ``variables``."""

    def __init__(self):
        import tensorflow as tf

        with tf.init_scope():
            self.local = tf.Variable(0.0, trainable=False, dtype=tf.float32, name="hvdtrain_stop")
            self.total = tf.Variable(
                [0.0, 0.0], trainable=False, dtype=tf.float64, name="hvdtrain_stop_total"
            )

    @staticmethod
    def attach(optimizer) -> StopFlags:
        """Flags on ``optimizer`` and the optimizers it wraps (a LossScaleOptimizer's inner
        one: whichever reduces carries them), this rank's flag cleared. Made at the
        optimizer's first hk.fit and kept for its later ones: a train function traced then
        carries those."""
        chain: list = []
        o = optimizer
        while o is not None and all(o is not c for c in chain):
            chain.append(o)
            o = getattr(o, "inner_optimizer", None)
        flags = next(
            (
                c._hvdtrain_stop_flags
                for c in chain
                if getattr(c, "_hvdtrain_stop_flags", None) is not None
            ),
            None,
        )
        flags = flags or StopFlags()
        for c in chain:
            object.__setattr__(c, "_hvdtrain_stop_flags", flags)
        flags.local.assign(0.0)
        return flags

    def raise_local(self) -> None:
        """This rank was asked to stop: its next update carries that to every rank."""
        self.local.assign(1.0)

    def read(self):
        """(the stop flags summed over ranks and updates, the updates that carried them)."""
        stop, carried = self.total.numpy()
        return float(stop), float(carried)

    def ride(self, reduce, grads) -> list:
        """``reduce(grads)`` with the flags in the last bucket; the reduced flags are added
        to ``total``."""
        import tensorflow as tf

        dtype = next((g.dtype for g in grads if g is not None), None)
        if dtype is None:
            return reduce(grads)
        # After the gradients: enqueued with them (Horovod's Keras 2 wrapper reduces each
        # tensor in its own op), so that Horovod fuses it into their round.
        with tf.control_dependencies([g for g in grads if isinstance(g, tf.Tensor)]):
            rider = tf.cast(tf.stack([self.local.read_value(), 1.0]), dtype)
        grads, (rider,) = _reduce_riding(reduce, grads, [rider])
        self.total.assign_add(tf.cast(rider, tf.float64))
        return grads


def _reduce(optimizer, reduce, grads) -> list:
    """``reduce(grads)``, with the optimizer's stop flags when hk.fit attached them."""
    flags = getattr(optimizer, "_hvdtrain_stop_flags", None)
    return reduce(grads) if flags is None else flags.ride(reduce, grads)


def apply_gradients(optimizer, grads, variables, riders=()):
    """One synchronous update, with ``riders`` reduced in the gradients' last bucket.

    ``optimizer`` comes from ``DistributedOptimizer`` (or is a plain optimizer in one
    process). The gradients are reduced as its wrapper would reduce them, with the ``riders``
    (small tensors of the gradients' dtype, e.g. the step's stop flags) in their last bucket:
    no negotiation round of the riders' own. Riders get the same reduction as the gradients
    (an average, unless the wrapper sums); only their sign is meant to be read. Returns the
    reduced riders.
    """
    riders = list(riders)
    reduce = getattr(optimizer, "_hvdtrain_reduction", None)
    if reduce is None:  # not wrapped: one process, nothing to reduce
        _apply_reduced(optimizer, list(grads), variables)
        return riders
    grads, riders = _reduce_riding(reduce, grads, riders)
    _apply_reduced(optimizer, grads, variables)
    return riders


def _reduce_riding(reduce, grads, riders):
    """(reduced gradients, reduced riders): the same rounds for both when ``reduce`` carries
    riders (a reduction without that attribute, Horovod's Keras 2 per-tensor one, does)."""
    grads, riders = list(grads), list(riders)
    if getattr(reduce, "carries_riders", True):
        # In front: the first tensors are the last bucket (the backward pass produces them
        # last), so the riders go in it; the fit path's wait for every gradient and would
        # hold back any other bucket they were in.
        reduced = reduce(riders + grads)
        return list(reduced[len(riders) :]), list(reduced[: len(riders)])
    # Adasum: its combination is meant for gradients only; the riders get a sum
    return list(reduce(grads)), [reduce.sum(r) for r in riders]


def accumulation(optimizer) -> int:
    """Calls (micro-batches) per update: ``backward_passes_per_step``, or 1."""
    helper = getattr(optimizer, "_agg_helper", None)  # Horovod's Keras 2 wrapper
    if helper is not None:
        return int(helper.backward_passes_per_step)
    return int(getattr(optimizer, "gradient_accumulation_steps", None) or 1)


def updates(optimizer) -> int:
    """The optimizer's updates so far, under either Keras: Keras 3's ``iterations`` counts
    updates when accumulating, Horovod's Keras 2 wrapper's counts calls."""
    done = int(optimizer.iterations.numpy())
    return done // accumulation(optimizer) if hasattr(optimizer, "_agg_helper") else done


def _apply_reduced(optimizer, grads, variables):
    """Apply gradients that are reduced already (or need none: one process).

    Keras 3: the class's own apply (hvdtrain's wrapper's would reduce again). A
    LossScaleOptimizer skips a step with a non-finite gradient without counting it; here it
    counts, as Keras 2's does: hvdtrain's step count is the optimizer's (checkpoints, resume,
    learning-rate schedules), and every rank skips the same steps, since the gradients it
    checks are reduced. Keras 2: Horovod's wrapper reduces in minimize()/get_gradients()
    only and apply_gradients applies what it is given (TF >= 2.4); its LossScaleOptimizer
    takes unscaled gradients.
    """
    import tensorflow as tf

    grads = _dense(grads)
    if compat.is_keras3():
        cls = type(optimizer)
        own: Any = (
            super(cls, optimizer) if getattr(cls, "_hvdtrain_distributed", False) else optimizer
        )
        if not precision.is_loss_scaled(optimizer):
            return own.apply(grads, variables)
        skipped = tf.logical_not(optimizer.check_finite(grads))
        own.apply(grads, variables)
        optimizer.iterations.assign_add(tf.cast(skipped, optimizer.iterations.dtype))
        return None
    if precision.is_loss_scaled(optimizer):
        grads = optimizer.get_unscaled_gradients(grads)
    wrapper = getattr(optimizer, "inner_optimizer", optimizer)
    if hasattr(wrapper, "_aggregated_gradients"):  # Horovod's: these are reduced already
        object.__setattr__(wrapper, "_aggregated_gradients", True)
    return optimizer.apply_gradients(zip(grads, variables))


def reduce_before_loss_scaling(optimizer):
    """Keras 3: ``LossScaleOptimizer(DistributedOptimizer(opt))``, as ``compile`` wraps a
    distributed optimizer under a ``mixed_float16`` policy, checks each rank's own gradients
    and reduces only on ranks whose gradients are finite: one rank would skip the allreduce
    the others wait in. Turned around in place: the scaler reduces, its inner optimizer is
    plain again. Anything else is returned as it is."""
    inner: Any = getattr(optimizer, "inner_optimizer", None)
    if not (
        compat.is_keras3()
        and precision.is_loss_scaled(optimizer)
        and getattr(type(inner), "_hvdtrain_distributed", False)
    ):
        return optimizer
    if accumulation(inner) > 1:
        raise ConfigError(
            "backward_passes_per_step",
            accumulation(inner),
            "not with a "
            "mixed_float16 policy (loss scaling): use mixed_bfloat16, or no "
            "accumulation",
        )
    reduction = inner._hvdtrain_reduction
    inner.__class__ = type(inner).__bases__[0]  # its own class again
    object.__delattr__(inner, "_hvdtrain_reduction")
    optimizer = _reducing_subclass(optimizer)
    object.__setattr__(optimizer, "_hvdtrain_reduction", reduction)
    return optimizer
