"""The Keras hvdtrain trains with, for a user's code: ``hvdtrain.compat.keras()`` is Keras 3,
or tf_keras when ``TF_USE_LEGACY_KERAS=1``. The code is ``hvdtrain.base.compat``."""
from hvdtrain.base.compat import (TRUE, check_model, describe, is_keras3, keras,  # noqa: F401
                                  legacy_requested, tf_variables, variable_name, variables)
