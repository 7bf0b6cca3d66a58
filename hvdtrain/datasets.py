"""Datasets for a script, returned as ``keras.datasets`` returns them.

``(x_train, y_train), (x_test, y_test) = hk.datasets.mnist()`` (``hvdtrain.keras`` as
``hk``). Found without the network where possible, as the MNIST task finds its data:
``~/.keras/datasets/mnist.npz`` (Keras' own cache), else with ``download=True`` one download
per host, else the 5,000 digits bundled with hvdtrain (4,000 to train, 1,000 to test). The
same arrays on every rank: ``hk.dataset`` shards them.

A Task's data (``Data``, the loaders it is made with) is ``hvdtrain.data``; the code of both
is ``hvdtrain.inputs.loaders``.
"""

from __future__ import annotations


def mnist(download: bool = False, notice=None):
    """MNIST as ``keras.datasets.mnist.load_data()`` returns it, the same on every rank.

    Args:
        download: download it when it is not in Keras' cache; every rank must call then
            (local rank 0 downloads, the others wait).
        notice: called with the line saying which data was found when it is not the full
            MNIST (default: silent).

    Returns:
        ``(x_train, y_train), (x_test, y_test)``: uint8 images of 28 x 28 and integer labels
        0-9.

    Raises:
        DataError: a file found is bad.
    """
    from hvdtrain import distributed
    from hvdtrain.inputs.loaders import load_mnist_format

    # Without a download no rank waits for another: no collective, no Horovod needed.
    world = distributed.current() if download else distributed.World()
    data = load_mnist_format("mnist", None, download, world, notice or (lambda message: None))
    return (data.x_train, data.y_train), (data.x_test, data.y_test)
