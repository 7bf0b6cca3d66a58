"""A user's own Task through the public API, in this process: ``Xor`` (XOR with a 2-layer
network) and ``OnDisk`` (the same, its training arrays memory-mapped from disk). The
one-process tests and the accumulation tests train them."""

import os

import numpy as np

import hvdtrain
from hvdtrain.data import Data


class Xor(hvdtrain.Task):
    """A user's own task through the public API: XOR with a 2-layer network."""

    name = "xor"

    def load_data(self, config, world):
        x = np.array([[0, 0], [0, 1], [1, 0], [1, 1]] * 64, dtype=np.float32)
        y = (x[:, 0] != x[:, 1]).astype(np.int32)
        return Data(x, y, x[:4], y[:4])

    def build_model(self, config):
        k = hvdtrain.compat.keras()  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1
        return k.Sequential(
            [k.Input(shape=(2,)), k.layers.Dense(16, activation="tanh"), k.layers.Dense(2)]
        )

    def loss(self, y, pred):
        import tensorflow as tf

        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=pred)

    def metrics(self):
        import tensorflow as tf

        return {"accuracy": lambda y, p: tf.equal(tf.argmax(p, -1, output_type=tf.int32), y)}


class OnDisk(Xor):
    """Xor whose training arrays stay on disk (memory-mapped): streamed, batch by batch."""

    name = "xor_on_disk"

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def load_data(self, config, world):
        data = super().load_data(config, world)
        for name in ("x", "y"):
            np.save(os.path.join(self.directory, f"{name}.npy"), getattr(data, f"{name}_train"))
        return Data(
            np.load(os.path.join(self.directory, "x.npy"), mmap_mode="r"),
            np.load(os.path.join(self.directory, "y.npy"), mmap_mode="r"),
            data.x_test,
            data.y_test,
        )
