"""``hk.adapt``'s work: a preprocessing layer adapted on rank 0, its state handed to every
rank (the vocabulary, the adapted variables, and the arrays, tensors and lists of floats the
layer keeps outside them: ``engine.preflight.state_attributes``, what the preflight compares).
"""

from __future__ import annotations

import numpy as np

from hvdtrain.base.errors import TaskError, user_code
from hvdtrain.engine.preflight import state_attributes


def adapt_on_chief(layer, data, world, kwargs: dict):
    """All ranks: ``layer.adapt(data, **kwargs)`` on rank 0, then rank 0's state set on every
    other rank's ``layer``; returns ``layer``. A ``TaskError`` that ``adapt`` raised on rank 0
    is raised on every rank."""

    def on_rank0():
        if not world.is_chief:
            return None
        with user_code(f"hk.adapt: {type(layer).__name__}.adapt"):
            layer.adapt(data, **kwargs)
        vocabulary = getattr(layer, "get_vocabulary", None)
        if vocabulary is not None:
            return {"vocabulary": list(vocabulary())}
        build = getattr(layer, "get_build_config", lambda: None)()
        return {
            "build": build,
            "variables": [np.asarray(v.numpy()) for v in layer.variables],
            "attributes": {
                k: (_kind(v), np.asarray(v)) for k, v in state_attributes(layer).items()
            },
        }

    state = world.broadcast_object(world.agree(on_rank0, catch=(TaskError,), merge=TaskError))
    if world.is_chief:
        return layer
    if "vocabulary" in state:
        layer.set_vocabulary(state["vocabulary"])
        return layer
    import tensorflow as tf

    if not layer.built and state["build"]:
        layer.build_from_config(state["build"])
    for variable, value in zip(layer.variables, state["variables"]):
        variable.assign(value)
    for name, (kind, value) in state["attributes"].items():
        setattr(layer, name, {"tensor": tf.constant, "list": list}.get(kind, np.asarray)(value))
    return layer


def _kind(value) -> str:
    return (
        "tensor"
        if type(value).__name__ == "EagerTensor"
        else "array"
        if isinstance(value, np.ndarray)
        else "list"
    )
