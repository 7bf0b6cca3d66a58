"""The seed's linear regression, y = x @ [0.1, 0.2, 0.3] + 0.4, by full-batch SGD.

    horovodrun -np 2 python -m hvdtrain.linear     # two workers, as the seed
    python -m hvdtrain.linear                      # one process: the same weights

Each worker holds half of the 1,000 examples; the gradients of the two halves are
averaged, which equals the one-process gradient, so N workers end with the same weights.
"""
from hvdtrain.cli import run
from hvdtrain.data import linear_data
from hvdtrain.task import Task


class LinearTask(Task):
    name = "linear"
    progress_bar = False  # one full-batch step per epoch

    def load_data(self, config, world):
        return linear_data(config.num_samples, config.true_weights, config.true_bias, config.seed)

    def build_model(self, config):
        from hvdtrain.compat import keras
        k = keras()
        return k.Sequential([
            k.Input(shape=(config.num_features,)),
            k.layers.Dense(1, kernel_initializer="zeros", bias_initializer="zeros"),
        ])

    def loss(self, y, pred):
        import tensorflow as tf
        return tf.reduce_mean(tf.square(pred - y), axis=-1)  # the seed's mean squared error

    def format_epoch(self, record):
        # The seed's line.
        return f"Epoch: {record['epoch']}  Step: {record['global_step']}  Loss: {record['loss']:.6g}"

    def summarize(self, model):
        kernel, bias = model.layers[-1].get_weights()
        return {"weights": [float(w) for w in kernel.ravel()], "bias": float(bias[0])}

    def format_result(self, result):
        weights = ", ".join(f"{w:.6f}" for w in result["weights"])
        return f"Weights: [{weights}]  Bias: {result['bias']:.6f}"


def main(argv=None):
    return run(LinearTask(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
