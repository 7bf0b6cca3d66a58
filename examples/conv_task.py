"""Your own model through hvdtrain's Task path: a small conv net on MNIST, trained with Adam.

    python examples/conv_task.py --epochs 2                     # one process
    horovodrun -np 2 python examples/conv_task.py --epochs 2    # two, gradients averaged
    python examples/conv_task.py --help                         # its flags, with defaults

With no MNIST on the machine it trains on the 5,000 digits bundled with hvdtrain.
"""
from dataclasses import dataclass

import numpy as np

import hvdtrain
import hvdtrain.cli
import hvdtrain.datasets
from hvdtrain.compat import keras  # Keras 3, or tf_keras when TF_USE_LEGACY_KERAS=1
from hvdtrain.data import Data


@dataclass
class ConvSettings:
    filters: int = hvdtrain.setting(16, "filters of each of the two conv layers")
    train_examples: int = hvdtrain.setting(0, "train on the first N examples only (0: all)")


class ConvTask(hvdtrain.Task):
    name = "conv"
    description = "A small conv net on MNIST, with Adam"
    Settings = ConvSettings
    defaults = dict(learning_rate=0.001, batch_size=64, epochs=3)

    def load_data(self, config, world):
        # The cached MNIST, or the 5,000 digits bundled with hvdtrain (no network).
        (x_train, y_train), (x_test, y_test) = hvdtrain.datasets.mnist()
        keep = np.arange(len(x_train))
        if self.settings.train_examples:  # a random subset, the same on every rank
            keep = np.sort(np.random.default_rng(0).permutation(keep)[:self.settings.train_examples])
        return Data(x_train[keep], y_train[keep], x_test, y_test)

    def build_model(self, config):
        k, f = keras(), self.settings.filters
        return k.Sequential([
            k.Input(shape=(28, 28, 1)),
            k.layers.Conv2D(f, 3, activation="relu"),
            k.layers.MaxPooling2D(),
            k.layers.Conv2D(2 * f, 3, activation="relu"),
            k.layers.MaxPooling2D(),
            k.layers.Flatten(),
            k.layers.Dense(10),
        ])

    def build_optimizer(self, config, learning_rate):
        return keras().optimizers.Adam(learning_rate)  # hvdtrain averages its gradients

    def preprocess(self, x, y):
        import tensorflow as tf
        return tf.reshape(tf.cast(x, tf.float32) / 255.0, (-1, 28, 28, 1)), tf.cast(y, tf.int32)

    def loss(self, y, pred):  # one value per example: hvdtrain takes the global mean
        return keras().losses.sparse_categorical_crossentropy(y, pred, from_logits=True)

    def metrics(self):
        import tensorflow as tf
        return {"accuracy": lambda y, p: tf.equal(tf.argmax(p, -1, output_type=tf.int32), y)}

    def format_result(self, result):
        return f"Test accuracy: {result['test_accuracy']:.4f}"


if __name__ == "__main__":
    raise SystemExit(hvdtrain.cli.run(ConvTask(), prog="conv_task.py"))
