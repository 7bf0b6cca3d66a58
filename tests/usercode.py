"""The code users bring, as the tests write it out: small models, a Task and fit scripts in a
folder of their own on the ranks' PYTHONPATH, launched as users launch them.

- ``write(tmp_path, {"common": text, ...})``: the folder ``code/`` with each text as NAME.py;
  ``env_with(code, tmp_path)`` puts it first on PYTHONPATH;
- ``two_ranks(*cmd)``: ``horovodrun -np 2 --gloo python cmd...``;
- the BatchNormalization classifier that the BN tests share (test_models.py: Keras'
  BatchNormalization, its moving statistics averaged; test_sync_bn.py: SyncBatchNormalization):
  ``bn_common(layer)``, its data and model, and ``bn_task(name, **defaults)``, its Task.
"""

import os
import textwrap

from conftest import HOROVODRUN, ROOT, clean_env

# 800 examples of 8 features (512 to train, 288 to test), 2 classes; 8 -> 16 -> BN -> 2.
BN_COMMON = textwrap.dedent("""
    import numpy as np
    import hvdtrain
    from hvdtrain.compat import keras

    def data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(800, 8)).astype("float32") * 2.0 + 1.0
        y = (x[:, 0] - x[:, 1] + 0.5 * x[:, 2] > 1.0).astype("int64")
        return x[:512], y[:512], x[512:], y[512:]

    def model():
        k = keras()
        k.utils.set_random_seed(1)
        return k.Sequential([k.Input((8,)), k.layers.Dense(16), LAYER,
                             k.layers.Activation("relu"), k.layers.Dense(2, activation="softmax")])
""")
BN_TASK = textwrap.dedent("""
    import hvdtrain
    from hvdtrain.compat import keras
    from hvdtrain.data import Data
    import common

    class BN(hvdtrain.Task):
        name = NAME
        defaults = DEFAULTS

        def load_data(self, config, world):
            return Data(*common.data())

        def build_model(self, config):
            return common.model()

        def loss(self, y, pred):
            return keras().losses.sparse_categorical_crossentropy(y, pred)

        def metrics(self):
            return {"accuracy": lambda y, p: keras().metrics.sparse_categorical_accuracy(y, p)}
""")


def bn_common(layer="k.layers.BatchNormalization()"):
    """common.py of the BN tests: ``data()`` and ``model()`` with ``layer`` for the BN."""
    return BN_COMMON.replace("LAYER", layer)


def bn_task(name, **defaults):
    """bn_task.py: the Task ``BN`` training common.model() on common.data()."""
    return BN_TASK.replace("NAME", repr(name)).replace("DEFAULTS", f"dict(**{defaults!r})")


def write(tmp_path, files):
    folder = tmp_path / "code"
    folder.mkdir()
    for name, text in files.items():
        (folder / f"{name}.py").write_text(text)
    return folder


def env_with(code, tmp_path, **extra):
    return clean_env(tmp_path / "home", PYTHONPATH=f"{code}{os.pathsep}{ROOT}", **extra)


def two_ranks(*cmd):
    return [HOROVODRUN, "-np", "2", "--gloo", "python", *map(str, cmd)]
