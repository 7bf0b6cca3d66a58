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


def DistributedOptimizer(optimizer, op: str = "average", compression: str = "none",
                         gradient_predivide_factor: float = 1.0):
    """Wrap ``optimizer`` so that every update uses gradients reduced over all ranks.

    op: ``"average"`` (the default: the learning rate keeps its single-process meaning),
        ``"sum"`` or ``"adasum"``; Horovod's ``hvd.Average`` etc. are accepted too.
    compression: ``"none"`` or ``"fp16"`` (gradients travel as float16), or
        ``hvd.Compression.*``.
    gradient_predivide_factor: average as ``sum(g / f) * f / size`` instead of
        ``sum(g) / size`` (guards float16 sums against overflow); op ``"average"`` only.

    Horovod is started (``hvd.init()``) if hvdtrain has not started it yet. Under Keras 3 the
    optimizer is wrapped in place and returned: its state, learning-rate schedule and saved
    form stay those of its own class, so a model saved with it loads without hvdtrain.
    """
    from hvdtrain import distributed

    return distributed.current().wrap_optimizer(
        optimizer, op=op, compression=compression,
        gradient_predivide_factor=gradient_predivide_factor)


def distribute(optimizer, reduce):
    """Keras 3: make ``optimizer`` apply ``reduce(gradients)`` instead of its gradients.

    The optimizer's class becomes a subclass of its own class named like it (the pattern of
    Horovod's wrapper), whose ``apply`` reduces first; ``apply_gradients`` and ``fit`` go
    through ``apply``. Wrapping twice would average twice: refused.
    """
    cls = type(optimizer)
    if getattr(cls, "_hvdtrain_distributed", False):
        raise ValueError(f"{cls.__name__} optimizer is already a DistributedOptimizer")

    def apply(self, grads, trainable_variables=None):
        # Horovod: every rank applies the same, averaged gradients (a synchronous update).
        return super(wrapped, self).apply(self._hvdtrain_reduce(list(grads)),
                                          trainable_variables)

    wrapped = type(cls.__name__, (cls,), {
        "apply": apply, "_hvdtrain_distributed": True,
        # Saved models name the optimizer's own class, so they load without hvdtrain.
        "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    optimizer.__class__ = wrapped
    object.__setattr__(optimizer, "_hvdtrain_reduce", reduce)
    return optimizer
