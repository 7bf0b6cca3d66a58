"""One process, the real loop in this interpreter: results, files, and the public API."""

import dataclasses
import json
import os

import numpy as np
import pytest

import hvdtrain
from conftest import keras_flavour
from hvdtrain import distributed
from hvdtrain.data import DataError
from hvdtrain.tasks.linear import LinearTask
from hvdtrain.tasks.mnist import MnistTask
from xor_task import OnDisk, Xor

# The real loop in this process, no launcher: the inner loop runs them.
pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def world():
    return distributed.init("auto")  # Horovod with size 1: the path users get with no launcher


def test_linear_learns_the_seed_weights(world, tmp_path):
    config = hvdtrain.preset("linear", run_dir=str(tmp_path), verbose=0, num_workers=1)
    result = hvdtrain.train(LinearTask(), config, world)
    np.testing.assert_allclose(result["weights"], [0.1, 0.2, 0.3], atol=1e-4)
    assert abs(result["bias"] - 0.4) < 1e-4
    assert result["global_step"] == 10 and result["world_size"] == 1
    assert result["backend"] == "horovod"


def test_horovod_size_1_equals_plain_optimizer(world, tmp_path):
    """The Horovod-wrapped optimizer at size 1 takes exactly the plain optimizer's steps."""
    args = dict(verbose=0, epochs=3, learning_rate=0.05, num_workers=1)
    a = hvdtrain.train(
        LinearTask(), hvdtrain.preset("linear", run_dir=str(tmp_path / "a"), **args), world
    )
    b = hvdtrain.train(
        LinearTask(),
        hvdtrain.preset("linear", run_dir=str(tmp_path / "b"), **args),
        distributed.World(),
    )
    assert b["backend"] == "single"
    np.testing.assert_allclose(a["weights"], b["weights"], atol=1e-7)
    assert a["weights"][0] < 0.09  # three small steps: far from converged, so this compares


def test_run_directory_contents(world, tmp_path):
    config = hvdtrain.preset(
        "mnist", run_dir=str(tmp_path), verbose=0, epochs=2, learning_rate=0.5, num_workers=1
    )
    result = hvdtrain.train(MnistTask(notice=lambda m: None, download=False), config, world)
    saved_config = json.load(open(tmp_path / "config.json"))
    assert saved_config["learning_rate"] == 0.5 and saved_config["task"] == "mnist"
    assert saved_config["settings"]["model"] == "softmax"
    lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [l["epoch"] for l in lines] == [1, 2]
    assert [l["global_step"] for l in lines] == [40, 80]  # 4,000 / 100 per step
    assert all(l["samples_per_sec"] > 0 and 0 < l["accuracy"] <= 1 for l in lines)
    assert lines[1]["loss"] < lines[0]["loss"]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
    # TensorBoard reads each epoch's scalars at its global step, as metrics.jsonl has them
    import tensorflow as tf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    assert {"loss", "accuracy", "samples_per_sec"} <= set(board.Tags()["tensors"])
    for tag in ("loss", "accuracy"):
        seen = sorted((e.step, float(tf.make_ndarray(e.tensor_proto))) for e in board.Tensors(tag))
        assert seen == [(l["global_step"], pytest.approx(l[tag], rel=1e-6)) for l in lines]
    saved = json.load(open(tmp_path / "result.json"))
    assert saved == json.loads(json.dumps(result))
    for key in (
        "task",
        "backend",
        "world_size",
        "global_step",
        "final_loss",
        "test_accuracy",
        "test_examples",
        "train_examples",
        "dataset",
    ):
        assert key in saved
    assert (saved["train_examples"], saved["test_examples"]) == (4000, 1000)
    assert saved["dataset"] == "mnist_sample" and saved["test_accuracy"] > 0.8


def test_mlp_model_option(world, tmp_path):
    config = hvdtrain.preset(
        "mnist", run_dir=str(tmp_path), verbose=0, epochs=1, learning_rate=0.1, num_workers=1
    )
    task = MnistTask(notice=lambda m: None, model="mlp", hidden_units=32, download=False)
    result = hvdtrain.train(task, config, world)
    assert result["test_accuracy"] > 0.5


@pytest.mark.keras2
def test_users_own_task(world, tmp_path):
    config = hvdtrain.Config(
        learning_rate=0.5,
        momentum=0.9,
        epochs=40,
        batch_size=16,
        run_dir=str(tmp_path),
        verbose=0,
        num_workers=1,
    )
    result = hvdtrain.train(Xor(), config, world)
    assert result["task"] == "xor" and result["test_accuracy"] == 1.0
    assert result["keras"].split()[0] == keras_flavour()


class BranchyXor(Xor):
    """Xor whose preprocess, loss and metric branch on tensors with Python's ``if``: AutoGraph
    turns them into graph conditionals, as it did when the whole step was converted."""

    name = "branchy_xor"

    def preprocess(self, x, y):
        import tensorflow as tf

        if tf.reduce_max(x) > 1.0:  # never: the data are 0/1
            x = x / tf.reduce_max(x)
        return x, y

    def loss(self, y, pred):
        per_example = super().loss(y, pred)
        if per_example.dtype == "float64":  # a Python condition, as before
            per_example = per_example * 1.0
        for _ in range(1):  # and a Python loop
            if tf_mean(per_example) < 0.0:  # never: a loss is >= 0
                per_example = -per_example
        return per_example


def tf_mean(t):
    import tensorflow as tf

    return tf.reduce_mean(t)


@pytest.mark.keras2
def test_a_tasks_python_control_flow_on_tensors_is_converted(world, tmp_path):
    config = dict(
        learning_rate=0.5, momentum=0.9, epochs=5, batch_size=16, verbose=0, num_workers=1
    )
    branchy = hvdtrain.train(
        BranchyXor(), hvdtrain.Config(run_dir=str(tmp_path / "b"), **config), world
    )
    plain = hvdtrain.train(Xor(), hvdtrain.Config(run_dir=str(tmp_path / "p"), **config), world)
    assert branchy["global_step"] == plain["global_step"] == 5 * 16
    assert branchy["final_loss"] == pytest.approx(plain["final_loss"], abs=1e-6)
    assert branchy["test_loss"] == pytest.approx(plain["test_loss"], abs=1e-6)


def test_batch_larger_than_data_is_a_config_error(world, tmp_path):
    config = hvdtrain.preset("linear", batch_size=5000, run_dir=str(tmp_path / "r"), verbose=0)
    with pytest.raises(hvdtrain.ConfigError, match="--batch-size=5000: a global batch"):
        hvdtrain.train(LinearTask(), config, world)
    assert not (tmp_path / "r").exists()


def test_data_error_reaches_the_caller(world, tmp_path):
    class Broken(LinearTask):
        def load_data(self, config, world):
            raise DataError("/data/x.gz: truncated gzip stream")

    config = hvdtrain.preset("linear", run_dir=str(tmp_path / "r"), verbose=0)
    with pytest.raises(distributed.RankError, match="^/data/x.gz: truncated gzip stream$"):
        hvdtrain.train(Broken(), config, world)
    assert not (tmp_path / "r").exists()


# --- the Task path, complete: optimizer, input, regularisation, reduced loss, export --------


class AdamXor(Xor):
    """Xor with the task's own optimizer: Adam on a decaying learning-rate schedule."""

    name = "adam_xor"

    def build_optimizer(self, config, learning_rate):
        k = hvdtrain.compat.keras()
        schedule = k.optimizers.schedules.ExponentialDecay(learning_rate, 100, 0.5)
        return k.optimizers.Adam(learning_rate=schedule)


def test_task_chooses_its_optimizer_and_schedule(world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run directory is runs/<task>-<time> here
    result = hvdtrain.train(
        AdamXor(), hvdtrain.Config(learning_rate=0.05, epochs=30, batch_size=16, verbose=0), world
    )
    assert result["test_accuracy"] == 1.0
    (run_dir,) = os.listdir(tmp_path / "runs")
    assert run_dir.startswith("adam_xor-")  # named after the user's task, not a built-in one
    saved = json.load(open(tmp_path / "runs" / run_dir / "config.json"))
    assert saved["task"] == "adam_xor" and saved["settings"] == {}
    assert "model" not in saved and "dataset" not in saved


class Ridge(LinearTask):
    """The linear task with a strong L2 penalty on the kernel (a model.losses term)."""

    def build_model(self, config):
        k = hvdtrain.compat.keras()
        return k.Sequential(
            [
                k.Input(shape=(3,)),
                k.layers.Dense(
                    1, kernel_initializer="zeros", kernel_regularizer=k.regularizers.L2(0.3)
                ),
            ]
        )


def test_model_losses_are_minimised_too(world, tmp_path):
    config = hvdtrain.preset(
        "linear", run_dir=str(tmp_path / "a"), verbose=0, epochs=50, num_workers=1
    )
    plain = hvdtrain.train(LinearTask(), config, world)
    ridge = hvdtrain.train(Ridge(), dataclasses.replace(config, run_dir=str(tmp_path / "b")), world)
    np.testing.assert_allclose(plain["weights"], [0.1, 0.2, 0.3], atol=1e-4)
    # The penalty pulls every weight towards 0 (measured: about 0.77 of the plain weights);
    # were model.losses ignored, both runs would end with the same weights.
    assert all(0 < r < 0.9 * p for r, p in zip(ridge["weights"], plain["weights"])), ridge[
        "weights"
    ]


class MeanLoss(LinearTask):
    def loss(self, y, pred):
        import tensorflow as tf

        return tf.reduce_mean(tf.square(pred - y))  # already reduced: the sums would be wrong


def test_a_reduced_loss_is_refused_before_anything_is_written(world, tmp_path):
    config = hvdtrain.preset("linear", run_dir=str(tmp_path / "r"), verbose=0, num_workers=1)
    with pytest.raises(
        hvdtrain.TaskError,
        match=r"MeanLoss.loss returned shape \[\] for a "
        r"batch of 2: it must return one value per "
        r"example",
    ):
        hvdtrain.train(MeanLoss(), config, world)
    assert not (tmp_path / "r").exists()


def test_the_trained_model_is_saved_and_loads_without_hvdtrain(world, tmp_path):
    config = hvdtrain.preset("linear", run_dir=str(tmp_path), verbose=0, num_workers=1)
    result = hvdtrain.train(LinearTask(), config, world)
    assert result["model"] == str(tmp_path / "model.keras")
    model = hvdtrain.compat.keras().models.load_model(tmp_path / "model.keras")
    kernel, bias = model.layers[-1].get_weights()
    np.testing.assert_array_equal(kernel.ravel(), np.float32(result["weights"]))
    assert bias[0] == np.float32(result["bias"])
    off = hvdtrain.preset(
        "linear", run_dir=str(tmp_path / "n"), verbose=0, num_workers=1, save_model=False
    )
    assert "model" not in hvdtrain.train(LinearTask(), off, world)
    assert not (tmp_path / "n" / "model.keras").exists()


def test_streamed_input_trains_exactly_like_in_memory(world, tmp_path):
    from hvdtrain.tasks.step import in_memory

    args = dict(learning_rate=0.5, momentum=0.9, epochs=5, batch_size=16, verbose=0, num_workers=1)
    a = hvdtrain.train(Xor(), hvdtrain.Config(run_dir=str(tmp_path / "a"), **args), world)
    b = hvdtrain.train(
        OnDisk(str(tmp_path)), hvdtrain.Config(run_dir=str(tmp_path / "b"), **args), world
    )
    assert not in_memory(np.load(tmp_path / "x.npy", mmap_mode="r"))
    assert a["weights_sha256"] == b["weights_sha256"]  # the same batches, the same updates
    assert a["final_loss"] == b["final_loss"] and a["global_step"] == b["global_step"] == 80
