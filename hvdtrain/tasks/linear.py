"""The reference program's linear regression, y = x @ [0.1, 0.2, 0.3] + 0.4, by full-batch SGD.

    horovodrun -np 2 python -m hvdtrain.linear     # two workers, as the reference program
    python -m hvdtrain.linear                      # one process: the same weights

Each worker holds half of the 1,000 examples; the gradients of the two halves are
averaged, which equals the one-process gradient, so N workers end with the same weights.
"""

from dataclasses import dataclass

from hvdtrain.base.config import ConfigError, setting
from hvdtrain.inputs.loaders import linear_data
from hvdtrain.tasks.task import Task


@dataclass
class LinearSettings:
    """The reference program's synthetic data: y = x @ true_weights + true_bias."""

    num_samples: int = setting(1000, "synthetic examples (global, split over workers)")
    num_features: int = setting(3, "input features")
    true_weights: tuple[float, ...] = setting((0.1, 0.2, 0.3), "weights generating y")
    true_bias: float = setting(0.4, "bias generating y")

    def validate(self):
        for name in ("num_samples", "num_features"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "must be greater than 0")
        if len(self.true_weights) != self.num_features:
            raise ConfigError(
                "true_weights",
                self.true_weights,
                f"needs {self.num_features} values (--num-features)",
            )


class LinearTask(Task):
    name = "linear"
    description = "Linear regression by full-batch SGD"
    Settings = LinearSettings
    defaults = dict(
        learning_rate=0.5,  # seed: GradientDescentOptimizer(0.5)
        epochs=10,  # seed: 10 full-batch steps
        batch_size=None,  # full batch: each worker's whole shard (the reference: x_data)
        num_workers=2,  # seed: two workers
    )
    progress_bar = False  # one full-batch step per epoch

    def load_data(self, config, world):
        s = self.settings
        return linear_data(s.num_samples, s.true_weights, s.true_bias, config.seed)

    def build_model(self, config):
        from hvdtrain.base.compat import keras

        k = keras()
        return k.Sequential(
            [
                k.Input(shape=(self.settings.num_features,)),
                k.layers.Dense(1, kernel_initializer="zeros", bias_initializer="zeros"),
            ]
        )

    def loss(self, y, pred):
        import tensorflow as tf

        return tf.reduce_mean(tf.square(pred - y), axis=-1)  # the reference's mean squared error

    def format_epoch(self, record):
        # The reference program's line.
        return (
            f"Epoch: {record['epoch']}  Step: {record['global_step']}  Loss: {record['loss']:.6g}"
        )

    def summarize(self, model):
        kernel, bias = model.layers[-1].get_weights()
        return {"weights": [float(w) for w in kernel.ravel()], "bias": float(bias[0])}

    def format_result(self, result):
        weights = ", ".join(f"{w:.6f}" for w in result["weights"])
        return f"Weights: [{weights}]  Bias: {result['bias']:.6f}"
