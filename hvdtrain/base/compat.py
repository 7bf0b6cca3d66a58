"""Which Keras hvdtrain trains with, and the few calls that differ between Keras 3 and 2.

Keras 3 (the ``keras`` package, TensorFlow's default since 2.16) is the default. Keras 2
(``tf_keras``) is used when the user sets ``TF_USE_LEGACY_KERAS=1`` before TensorFlow is
imported, exactly as TensorFlow itself decides what ``tf.keras`` is. hvdtrain never sets
that variable. Everything else in hvdtrain asks this module instead of importing a Keras.
"""

import os

from hvdtrain.base.errors import KerasVersionError, TaskError, first_line

TRUE = ("1", "true", "yes")


def legacy_requested() -> bool:
    """True when the user asked for Keras 2 (tf_keras) the way TensorFlow reads it."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in TRUE


def keras():
    """The Keras module to build models with: ``keras`` (3) or ``tf_keras`` (2).

    Raises KerasVersionError, with the fix, when that Keras cannot work here.
    """
    if legacy_requested():
        try:
            import tf_keras
        except ImportError as e:
            raise KerasVersionError(
                f"TF_USE_LEGACY_KERAS=1 asks for Keras 2, but tf_keras does not import ({e}): "
                "pip install tf-keras matching your TensorFlow (scripts/setup.sh does), or "
                "unset TF_USE_LEGACY_KERAS for Keras 3"
            ) from None
        import tensorflow as tf

        active = tf.keras.__name__
        if not active.startswith("tf_keras"):
            raise KerasVersionError(
                f"TF_USE_LEGACY_KERAS=1 was set after TensorFlow chose Keras 3 (tf.keras is "
                f"{active}): set it before the program starts, or unset it for Keras 3"
            )
        return tf_keras
    try:
        import keras as keras3
    except ImportError as e:  # e.g. KERAS_BACKEND names a backend that is not installed
        raise KerasVersionError(
            f"Keras 3 does not import ({first_line(e)}); with "
            "KERAS_BACKEND set, set it to tensorflow"
        ) from None
    if not keras3.__version__.startswith("3."):
        raise KerasVersionError(
            f"keras {keras3.__version__} is installed where Keras 3 is "
            "expected: run scripts/setup.sh (keras==3.15.1)"
        )
    backend = keras3.backend.backend()
    if backend != "tensorflow":
        raise KerasVersionError(
            f"Keras 3 runs on the {backend!r} backend (KERAS_BACKEND or ~/.keras/keras.json); "
            "Horovod here trains TensorFlow: set KERAS_BACKEND=tensorflow"
        )
    return keras3


def describe() -> str:
    """ "keras 3.15.1" or "tf_keras 2.21.0": which Keras a run trained with."""
    k = keras()
    return f"{k.__name__} {k.__version__}"


def is_keras3() -> bool:
    return not legacy_requested()


def check_model(model, where: str = "build_model", verb: str = "returned") -> None:
    """Refuse a model built with the other Keras (its variables would not train), an unbuilt
    model (it would train nothing) and one with nothing to train."""
    k = keras()
    if not isinstance(model, k.Model):
        kind = type(model).__module__.split(".")[0]
        raise KerasVersionError(
            f"{where} {verb} a {kind} {type(model).__name__}, but hvdtrain trains with "
            f"{k.__name__} ({'TF_USE_LEGACY_KERAS=1' if legacy_requested() else 'Keras 3, the default'}): "
            "build it with hvdtrain.compat.keras(), or set/unset TF_USE_LEGACY_KERAS to match"
        )
    if not model.built or not model.weights:
        raise TaskError(
            f"{where} {verb} a model with no weights yet (a Sequential without "
            "keras.Input(shape) is built only when first called): start it with "
            "keras.Input(shape=...)"
        )
    if not model.trainable_weights:
        raise TaskError(f"{where} {verb} a model with no trainable weights: nothing to train")


def tf_variables(variables) -> list:
    """The tf.Variables behind Keras variables (Keras 3 wraps them; Horovod needs them)."""
    import tensorflow as tf

    return [v if isinstance(v, tf.Variable) else v.value for v in variables]


def variables(found) -> list:
    """The variables among a model's ``variables`` or ``weights``: Keras 2 lists a lookup
    layer's vocabulary handler there too (it saves the table, it holds no tensor)."""
    return [v for v in found if hasattr(v, "assign") and hasattr(v, "shape")]


def variable_name(v) -> str:
    """A variable's unique name: Keras 3's path ("dense/kernel"), or Keras 2's name."""
    return getattr(v, "path", None) or v.name
