"""``hvdtrain.DistributedOptimizer``: Horovod's synchronous gradient averaging for any Keras
optimizer, under Keras 3 as under Keras 2.

    opt = hvdtrain.DistributedOptimizer(keras.optimizers.Adam(1e-3))
    model.compile(optimizer=opt, loss=..., jit_compile=False)   # or use it in a custom loop

Before each update, the gradients are averaged over every rank by one grouped Horovod
ring-allreduce, so every rank applies the same update: what ``hvd.DistributedOptimizer``
does, and what TF1's SyncReplicasOptimizer did in the seeds. Under Keras 2
(``TF_USE_LEGACY_KERAS=1``) this *is* Horovod's ``horovod.tensorflow.keras``
``DistributedOptimizer``; under Keras 3, whose variables that wrapper cannot handle, it is
hvdtrain's, with the same arguments and meaning. In one process it returns the optimizer
unchanged.
"""
from __future__ import annotations

from hvdtrain import compat, distributed


def DistributedOptimizer(optimizer, op: str = "average", compression: str = "none",
                         gradient_predivide_factor: float = 1.0, world=None):
    """Wrap ``optimizer`` so that every update uses gradients reduced over all ranks.

    op: ``"average"`` (the default: the learning rate keeps its single-process meaning),
        ``"sum"`` or ``"adasum"`` (Keras 3 only: Horovod's Keras 2 wrapper refuses it);
        Horovod's ``hvd.Average`` etc. are accepted too.
    compression: ``"none"`` or ``"fp16"`` (gradients travel as float16), or
        ``hvd.Compression.*``.
    gradient_predivide_factor: average as ``sum(g / f) * f / size`` instead of
        ``sum(g) / size`` (guards float16 sums against overflow); op ``"average"`` only.
    world: the ``World`` to reduce over (default: this process's, ``hvdtrain.world()``).

    Horovod is started (``hvd.init()``) if hvdtrain has not started it yet. Under Keras 3 the
    optimizer is wrapped in place and returned: its state, learning-rate schedule and saved
    form stay those of its own class, so a model saved with it loads without hvdtrain.
    """
    reduction = (world or distributed.current()).reduction(op, compression,
                                                           gradient_predivide_factor)
    if reduction is None:  # one process: nothing to reduce
        return optimizer
    if compat.is_keras3():
        # Horovod's wrapper fails under Keras 3 ("'Variable' object has no attribute 'ref'"):
        # hvdtrain's reduces in apply() with Horovod's grouped allreduce instead.
        optimizer = _reducing_subclass(optimizer)
    else:
        optimizer = reduction.keras2_optimizer(optimizer)
    # What apply_gradients below needs to put the step's flags in the gradients' round.
    # object.__setattr__: Keras 3 would track an attribute set the usual way as state.
    object.__setattr__(optimizer, "_hvdtrain_reduction", reduction)
    return optimizer


def _reducing_subclass(optimizer):
    """Keras 3: make ``optimizer`` apply its reduction's result instead of its gradients.

    The optimizer's class becomes a subclass of its own class named like it (the pattern of
    Horovod's wrapper), whose ``apply`` reduces first; ``apply_gradients`` and ``fit`` go
    through ``apply``. Wrapping twice would average twice: refused.
    """
    cls = type(optimizer)
    if getattr(cls, "_hvdtrain_distributed", False):
        raise ValueError(f"{cls.__name__} optimizer is already a DistributedOptimizer")

    def apply(self, grads, trainable_variables=None):
        # Horovod: every rank applies the same, averaged gradients (a synchronous update).
        return super(wrapped, self).apply(self._hvdtrain_reduction(list(grads)),
                                          trainable_variables)

    wrapped = type(cls.__name__, (cls,), {
        "apply": apply, "_hvdtrain_distributed": True,
        # Saved models name the optimizer's own class, so they load without hvdtrain.
        "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    optimizer.__class__ = wrapped
    return optimizer


def apply_gradients(optimizer, grads, variables, riders=()):
    """One synchronous update, with ``riders`` reduced in the same Horovod round.

    ``optimizer`` comes from ``DistributedOptimizer`` (or is a plain optimizer in one
    process). The gradients are reduced as its wrapper would reduce them, together with the
    ``riders`` (small tensors of the gradients' dtype, e.g. the step's stop flags) in one
    grouped allreduce: one negotiation round per step instead of one for the gradients and
    one for the flags. Riders get the same reduction as the gradients (an average, unless the
    wrapper sums); only their sign is meant to be read. Returns the reduced riders.
    """
    riders = list(riders)
    reduce = getattr(optimizer, "_hvdtrain_reduction", None)
    if reduce is None:  # not wrapped: one process, nothing to reduce
        optimizer.apply_gradients(zip(grads, variables))
        return riders
    grads = list(grads)
    if reduce.carries_riders:
        reduced = reduce(grads + riders)
        grads, riders = reduced[:len(grads)], reduced[len(grads):]
    else:  # Adasum: its combination is meant for gradients only; the riders get a sum
        grads = reduce(grads)
        riders = [reduce.sum(r) for r in riders]
    if getattr(type(optimizer), "_hvdtrain_distributed", False):
        # Keras 3, hvdtrain's wrapper: the base class's apply (the wrapper's would reduce again).
        super(type(optimizer), optimizer).apply(grads, variables)
    else:
        # Keras 2, Horovod's wrapper: it reduces in minimize()/get_gradients() only;
        # apply_gradients applies what it is given (TF >= 2.4).
        optimizer.apply_gradients(zip(grads, variables))
    return riders
