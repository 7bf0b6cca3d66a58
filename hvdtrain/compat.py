"""The Keras hvdtrain trains with, for a user's code: ``hvdtrain.compat.keras()`` is Keras 3,
or tf_keras when ``TF_USE_LEGACY_KERAS=1``.

The public face of ``hvdtrain.base.compat``, where the code is (every layer of hvdtrain asks
it which Keras is in use); this module hands on its names."""

from hvdtrain.base.compat import (
    TRUE,
    check_model,
    describe,
    is_keras3,
    keras,
    legacy_requested,
    tf_variables,
    variable_name,
    variables,
)

__all__ = [
    "TRUE",
    "check_model",
    "describe",
    "is_keras3",
    "keras",
    "legacy_requested",
    "tf_variables",
    "variable_name",
    "variables",
]
