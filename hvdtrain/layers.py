"""``from hvdtrain.layers import SyncBatchNormalization``: batch statistics over the global
batch. The class depends on the Keras in use and is made on first use.

The public face of ``hvdtrain.distributed.layers``, where the code is (beside the rest of
what talks to Horovod); this module hands on its names."""

from hvdtrain.distributed.layers import global_moments


def __getattr__(name):
    if name == "SyncBatchNormalization":
        from hvdtrain.distributed import layers

        return layers.SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SyncBatchNormalization", "global_moments"]  # noqa: F822 (made by __getattr__)
