"""Real models on 2 ranks (horovodrun --gloo), both paths: BatchNormalization's moving
statistics averaged over the ranks (ranks identical, the saved model is the one evaluated).

A small BN classifier on synthetic data; each test bounds its processes' time.
"""
import json
import os
import textwrap

import numpy as np
import pytest

from conftest import HOROVODRUN, ROOT, clean_env, result, run

# The data and the model, shared by the Task and the fit script.
COMMON = textwrap.dedent("""
    import numpy as np
    from hvdtrain.compat import keras

    def data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(800, 8)).astype("float32") * 2.0 + 1.0
        y = (x[:, 0] - x[:, 1] + 0.5 * x[:, 2] > 1.0).astype("int64")
        return x[:512], y[:512], x[512:], y[512:]

    def model():
        k = keras()
        k.utils.set_random_seed(1)
        return k.Sequential([k.Input((8,)), k.layers.Dense(16), k.layers.BatchNormalization(),
                             k.layers.Activation("relu"), k.layers.Dense(2, activation="softmax")])
""")
TASK = textwrap.dedent("""
    import hvdtrain
    from hvdtrain.compat import keras
    from hvdtrain.data import Data
    import common

    class BN(hvdtrain.Task):
        name = "bn"
        defaults = dict(learning_rate=0.05, batch_size=16, epochs=2, checkpoint_every=5)

        def load_data(self, config, world):
            return Data(*common.data())

        def build_model(self, config):
            return common.model()

        def loss(self, y, pred):
            return keras().losses.sparse_categorical_crossentropy(y, pred)

        def metrics(self):
            return {"accuracy": lambda y, p: keras().metrics.sparse_categorical_accuracy(y, p)}
""")
# argv: run_dir [steps_per_execution [checkpoint_every]]
FIT = textwrap.dedent("""
    import sys
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras
    import common

    hk.init()
    x, y, x_test, y_test = common.data()
    spe = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    every = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    model = common.model()
    model.compile(optimizer=hk.DistributedOptimizer(keras().optimizers.SGD(0.05)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  steps_per_execution=spe)
    try:
        hk.fit(model, hk.dataset(x, y, batch_size=16, seed=1), epochs=2,
               validation_data=(x_test, y_test), run_dir=sys.argv[1], checkpoint_every=every,
               verbose=2)
    except hk.Error as e:
        sys.exit(hk.report_error(e))
""")


@pytest.fixture
def code(tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    for name, text in (("common", COMMON), ("bn_task", TASK), ("bn_fit", FIT)):
        (folder / f"{name}.py").write_text(text)
    return folder


def env_with(code, tmp_path):
    return clean_env(tmp_path / "home", PYTHONPATH=f"{code}{os.pathsep}{ROOT}")


def two_ranks(cmd):
    return [HOROVODRUN, "-np", "2", "--gloo", "python", *map(str, cmd)]


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def saved_model_accuracy(code, run_dir):
    """model.keras loaded in this one process, scored on the whole test set."""
    import sys
    sys.path.insert(0, str(code))
    try:
        import common
        from hvdtrain.compat import keras
        _, _, x_test, y_test = common.data()
    finally:
        sys.path.remove(str(code))
    model = keras().models.load_model(os.path.join(run_dir, "model.keras"), compile=False)
    pred = np.asarray(model.predict(x_test, batch_size=len(x_test), verbose=0))
    return float(np.mean(pred.argmax(-1) == y_test)), model


def moving_stats(model):
    bn = [l for l in model.layers if "batch_normalization" in l.name][0]
    return [np.asarray(w) for w in bn.get_weights()[2:]]  # moving mean, moving variance


@pytest.mark.keras2
def test_batchnorm_task_two_ranks_identical_and_the_saved_model_is_the_one_scored(code,
                                                                                  tmp_path):
    run_dir = str(tmp_path / "task")
    p = run(two_ranks(["-m", "hvdtrain", "run", "bn_task:BN", "--run-dir", run_dir]),
            env_with(code, tmp_path), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    res = result(run_dir)
    assert res["ranks_identical"] is True and "differ from rank 0" not in p.stderr
    accuracy, model = saved_model_accuracy(code, run_dir)
    assert res["test_examples"] == 288
    assert res["test_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert res["test_accuracy"] > 0.7
    mean, var = moving_stats(model)
    assert np.abs(mean).max() > 0.1 and not np.allclose(var, 1.0)  # the statistics moved


@pytest.mark.keras2
def test_batchnorm_fit_two_ranks_identical_and_the_saved_model_is_the_one_scored(code,
                                                                                 tmp_path):
    run_dir = str(tmp_path / "fit")
    p = run(two_ranks([code / "bn_fit.py", run_dir]), env_with(code, tmp_path), timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    res = result(run_dir)
    assert res["ranks_identical"] is True and "differ from rank 0" not in p.stderr
    accuracy, model = saved_model_accuracy(code, run_dir)
    last = metrics(run_dir)[-1]
    # Keras keeps the metric in float32; one example of 288 is 3e-3.
    assert last["val_accuracy"] == pytest.approx(accuracy, abs=1e-6) and accuracy > 0.7
    mean, var = moving_stats(model)
    assert np.abs(mean).max() > 0.1 and not np.allclose(var, 1.0)
