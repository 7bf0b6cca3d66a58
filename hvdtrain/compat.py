"""The one place that imports TensorFlow's Keras, after checking it is Keras 2 (tf_keras)."""
import os


class KerasVersionError(RuntimeError):
    pass


def keras():
    """Return the tf_keras module that tf.keras must also be, or raise KerasVersionError."""
    flag = os.environ.get("TF_USE_LEGACY_KERAS", "")
    if flag.lower() not in ("1", "true", "yes"):
        raise KerasVersionError(
            f"TF_USE_LEGACY_KERAS={flag!r}: Horovod 0.28.1 needs Keras 2 (tf_keras); "
            "unset it or set it to 1")
    import tensorflow as tf
    import tf_keras

    active = tf.keras.__name__
    if not active.startswith("tf_keras"):
        raise KerasVersionError(
            f"Keras 3 is active in TensorFlow (tf.keras is {active}), which Horovod 0.28.1 "
            "cannot train ('Variable' object has no attribute 'ref'): import hvdtrain before "
            "using tf.keras, or export TF_USE_LEGACY_KERAS=1, and build models with tf_keras")
    return tf_keras


