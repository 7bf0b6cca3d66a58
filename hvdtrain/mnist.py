"""The seed's MNIST softmax regression (784 -> 10, zero-initialised), or a small MLP.

    horovodrun -np 2 python -m hvdtrain.mnist                     # two workers, as the seed
    horovodrun -np 2 python -m hvdtrain.mnist --dataset fashion_mnist
    python -m hvdtrain.mnist --data-dir /data/mnist               # one process

With no MNIST on the machine and no network it trains on the 5,000 real digits bundled
with hvdtrain and says so.
"""
from hvdtrain.cli import run
from hvdtrain.data import load_mnist_format
from hvdtrain.task import Task


class MnistTask(Task):
    name = "mnist"

    def __init__(self, notice=None):
        self._notice = notice

    def load_data(self, config, world):
        notice = self._notice or (lambda m: world.is_chief and print(m, flush=True))
        return load_mnist_format(config.dataset, config.data_dir, config.download, world, notice)

    def build_model(self, config):
        from hvdtrain.compat import keras
        k = keras()
        layers = [k.Input(shape=(784,))]
        if config.model == "mlp":
            layers.append(k.layers.Dense(config.hidden_units, activation="relu"))
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


def main(argv=None):
    return run(MnistTask(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
