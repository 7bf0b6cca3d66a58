"""Mixed precision: Keras' dtype policies and dynamic loss scaling, under Keras 3 as under 2.

``--mixed-precision float16`` (or ``bfloat16``) builds the Task's model under Keras'
``mixed_float16`` (``mixed_bfloat16``) policy: layers compute in 16 bits, variables stay
float32, and hvdtrain computes the loss and metrics in float32 (it casts the model's outputs).
float16 needs loss scaling, or small gradients underflow to zero: the optimizer is wrapped in
Keras' ``LossScaleOptimizer``, whose scale halves and whose update is skipped when a gradient
is not finite. bfloat16 has float32's range and needs none. In a ``model.fit`` script the
user sets the policy; Keras' ``compile`` adds the loss scaling.

Horovod: the scaler's decision must be the same on every rank, or one rank would update
while another skips (and a rank that skips Keras 3's reduction would hang the others). So
the gradients are reduced *before* the scaler looks at them (``hvdtrain.distributed.optimizer`` puts the
reduction outside Keras 3's ``LossScaleOptimizer``, inside Keras 2's, whose inner optimizer
reduces in ``compute_gradients``): a non-finite gradient on any rank makes the sum non-finite
on every rank, every rank skips, and the scale stays the same everywhere. No extra round.
"""

from __future__ import annotations

import contextlib

from hvdtrain.base import compat

# --mixed-precision's values -> Keras' policy names.
POLICIES = {"none": None, "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


@contextlib.contextmanager
def policy(name: str):
    """Keras' global dtype policy for ``--mixed-precision name`` while building a model;
    the previous one afterwards (layers keep the policy they were built with)."""
    keras, wanted = compat.keras(), POLICIES[name]
    if wanted is None:
        yield
        return
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(wanted)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(before)


def model_precision(model) -> str:
    """--mixed-precision's name for the policy ``model`` was built with (a fit's record)."""
    name = getattr(getattr(model, "dtype_policy", None), "name", "float32")
    return {v: k for k, v in POLICIES.items() if v}.get(name, "none")


def loss_scale_class():
    """The Keras in use's LossScaleOptimizer class."""
    keras = compat.keras()
    return keras.mixed_precision.LossScaleOptimizer


def is_loss_scaled(optimizer) -> bool:
    return isinstance(optimizer, loss_scale_class())


def with_loss_scaling(optimizer, name: str):
    """``optimizer`` with dynamic loss scaling when ``name`` is float16 (unless it scales
    already, e.g. a task's own LossScaleOptimizer with its own initial scale)."""
    if name != "float16" or is_loss_scaled(optimizer):
        return optimizer
    return loss_scale_class()(optimizer)


def scale_loss(optimizer, loss):
    """The loss to differentiate: times the current loss scale under loss scaling."""
    if compat.is_keras3():
        return optimizer.scale_loss(loss)  # identity for a plain Keras 3 optimizer
    return optimizer.get_scaled_loss(loss) if is_loss_scaled(optimizer) else loss


def loss_scale(optimizer):
    """The current loss scale (a number), or None without loss scaling."""
    import numpy as np

    if not is_loss_scaled(optimizer):
        return None
    if compat.is_keras3():
        value = getattr(optimizer, "dynamic_scale", optimizer.initial_scale)  # built or not
    else:
        value = optimizer.loss_scale
    return float(np.asarray(value))


def scaler_state(optimizer) -> list:
    """Keras 2's loss scale and its good-step counter: state a checkpoint and the broadcast
    must cover (a resume would start from the initial scale again), but not among its
    optimizer's ``variables``, as Keras 3's are."""
    if compat.is_keras3() or not is_loss_scaled(optimizer):
        return []
    state = optimizer._loss_scale  # tf_keras' _DynamicLossScaleState
    return [state._current_loss_scale, state._counter]


def to_float32(pred):
    """The model's outputs in float32 where a policy made them float16 or bfloat16: the
    loss and the metrics are computed in float32 (a float16 softmax or sum loses digits)."""
    import tensorflow as tf

    def cast(t):
        if isinstance(t, tf.Tensor) and t.dtype in (tf.float16, tf.bfloat16):
            return tf.cast(t, tf.float32)
        return t

    return tf.nest.map_structure(cast, pred)
