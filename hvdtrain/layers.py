"""``from hvdtrain.layers import SyncBatchNormalization``: batch statistics over the global
batch. The class depends on the Keras in use and is made on first use; the code is
``hvdtrain.distributed.layers``."""
from hvdtrain.distributed.layers import global_moments  # noqa: F401


def __getattr__(name):
    if name == "SyncBatchNormalization":
        from hvdtrain.distributed import layers
        return layers.SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SyncBatchNormalization", "global_moments"]  # noqa: F822 (made by __getattr__)
