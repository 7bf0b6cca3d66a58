"""The reference program's MNIST softmax regression (784 -> 10, zero-initialised), or an MLP.

    horovodrun -np 2 python -m hvdtrain.mnist                     # two workers, as the reference program
    horovodrun -np 2 python -m hvdtrain.mnist --dataset fashion_mnist
    python -m hvdtrain.mnist --data-dir /data/mnist               # one process

With no MNIST on the machine and no network it trains on the 5,000 real digits bundled
with hvdtrain and says so.
"""

from dataclasses import dataclass

from hvdtrain.base.config import ConfigError, setting
from hvdtrain.inputs.loaders import DATASETS, load_mnist_format
from hvdtrain.tasks.task import Task

MODELS = ("softmax", "mlp")


@dataclass
class MnistSettings:
    """Which MNIST-format data, from where, and which model."""

    dataset: str = setting(
        "mnist", f"MNIST-format dataset: {', '.join(DATASETS)}", choices=DATASETS
    )
    data_dir: str | None = setting(
        None,
        "directory with IDX files (train-images-idx3-ubyte.gz, ...) or a Keras "
        "mnist.npz / fashion-mnist.npz",
        defines_run=False,
        per_rank=True,
    )
    download: bool = setting(
        True,
        "let one process per host download MNIST when no local copy exists",
        defines_run=False,
        per_rank=True,
    )
    model: str = setting(
        "softmax",
        "softmax (784->10, the reference program's) or mlp (784->hidden->10)",
        choices=MODELS,
    )
    hidden_units: int = setting(256, "hidden layer width of the mlp model")

    def validate(self):
        import os

        if self.hidden_units < 1:
            raise ConfigError("hidden_units", self.hidden_units, "must be greater than 0")
        if self.data_dir is not None and not os.path.isdir(self.data_dir):
            raise ConfigError("data_dir", self.data_dir, "no such directory")


class MnistTask(Task):
    name = "mnist"
    description = "MNIST softmax regression (or a small MLP)"
    Settings = MnistSettings
    defaults = dict(
        learning_rate=0.001,  # seed: GradientDescentOptimizer(0.001)
        batch_size=100,  # seed: mnist.train.next_batch(100), per worker
        # The reference program loops until stopped; 10 epochs is 3,000 synchronous steps on
        # full MNIST with two workers: enough for the softmax regression to level off at lr 0.5.
        epochs=10,
        num_workers=2,  # seed: two workers
    )

    def __init__(self, settings=None, notice=None, **values):
        super().__init__(settings, **values)
        self._notice = notice

    def load_data(self, config, world):
        s = self.settings
        notice = self._notice or (lambda m: world.is_chief and print(m, flush=True))
        return load_mnist_format(s.dataset, s.data_dir, s.download, world, notice)

    def build_model(self, config):
        from hvdtrain.base.compat import keras

        k = keras()
        layers = [k.Input(shape=(784,))]
        if self.settings.model == "mlp":
            layers.append(k.layers.Dense(self.settings.hidden_units, activation="relu"))
            layers.append(k.layers.Dense(10))
        else:  # the seed: W and b start at zero
            layers.append(k.layers.Dense(10, kernel_initializer="zeros", bias_initializer="zeros"))
        return k.Sequential(layers)

    def preprocess(self, x, y):
        import tensorflow as tf

        x = tf.reshape(tf.cast(x, tf.float32) / 255.0, (-1, 784))  # as input_data gave it
        return x, tf.cast(y, tf.int32)

    def loss(self, y, pred):
        import tensorflow as tf

        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=pred)

    def metrics(self):
        import tensorflow as tf

        return {"accuracy": lambda y, pred: tf.equal(tf.argmax(pred, -1, output_type=tf.int32), y)}

    def format_result(self, result):
        return f"Test accuracy: {result['test_accuracy']:.4f}"
