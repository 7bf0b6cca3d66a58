"""Without Horovod: one process with a notice, or a refusal when a launcher started many."""

import numpy as np
import pytest

from conftest import keras_flavour, module_cmd, result, run


def test_linear_falls_back_to_one_process(no_horovod, tmp_path):
    p = run(module_cmd("linear", "--run-dir", str(tmp_path / "r")), no_horovod)
    assert p.returncode == 0, p.stderr
    notices = [l for l in p.stderr.splitlines() if "horovod unavailable" in l]
    assert len(notices) == 1 and "one process with the plain optimizer" in notices[0]
    r = result(tmp_path / "r")
    assert (r["backend"], r["world_size"]) == ("single", 1)
    assert r["keras"].split()[0] == keras_flavour()
    np.testing.assert_allclose(r["weights"], [0.1, 0.2, 0.3], atol=1e-3)


@pytest.mark.keras2  # Keras 2's fallback: this one (the linear one is Keras 3's only)
def test_mnist_falls_back_to_one_process(no_horovod, tmp_path):
    p = run(
        module_cmd(
            "mnist",
            "--run-dir",
            str(tmp_path / "r"),
            "--epochs",
            "2",
            "--learning-rate",
            "0.5",
            "--no-download",
        ),
        no_horovod,
    )
    assert p.returncode == 0, p.stderr
    assert "horovod unavailable" in p.stderr and "Test accuracy:" in p.stdout
    r = result(tmp_path / "r")
    assert r["backend"] == "single" and r["test_accuracy"] > 0.8


@pytest.mark.parametrize("var", ["OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE"])
def test_launched_without_horovod_refuses(no_horovod, tmp_path, var):
    env = dict(no_horovod, **{var: "2"})
    p = run(module_cmd("linear", "--run-dir", str(tmp_path / "r")), env)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "horovod cannot be imported" in lines[0] and "2 independent copies" in lines[0]
    assert not (tmp_path / "r").exists()


def test_backend_horovod_without_horovod_refuses(no_horovod, tmp_path):
    p = run(
        module_cmd("linear", "--backend", "horovod", "--run-dir", str(tmp_path / "r")), no_horovod
    )
    assert p.returncode == 1 and "--backend horovod asks for it" in p.stderr


def test_backend_single_under_a_launcher_refuses(env, tmp_path):
    p = run(
        module_cmd("linear", "--backend", "single", "--run-dir", str(tmp_path / "r")),
        dict(env, OMPI_COMM_WORLD_SIZE="2"),
    )
    assert p.returncode == 1 and "independent copies" in p.stderr


def test_backend_single_trains_without_horovod_even_when_installed(env, tmp_path):
    p = run(module_cmd("linear", "--backend", "single", "--run-dir", str(tmp_path / "r")), env)
    assert p.returncode == 0, p.stderr
    assert result(tmp_path / "r")["backend"] == "single"


def test_model_of_the_other_keras_gets_a_clear_error(env, tmp_path):
    """Keras 3 is the default: a tf_keras model (Keras 2) is refused in one line, not trained."""
    code = (
        "import tf_keras\n"
        "from hvdtrain.cli import run\n"
        "from hvdtrain.linear import LinearTask\n"
        "class Legacy(LinearTask):\n"
        "    def build_model(self, config):\n"
        "        return tf_keras.Sequential([tf_keras.Input(shape=(3,)), tf_keras.layers.Dense(1)])\n"
        f"raise SystemExit(run(Legacy(), ['--num-workers', '1', '--run-dir', {str(tmp_path / 'r')!r}]))\n"
    )
    p = run(["python", "-c", code], env)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "Legacy.build_model returned a tf_keras Sequential" in lines[0]
    assert "TF_USE_LEGACY_KERAS" in lines[0]


def test_legacy_keras_asked_too_late_gets_a_clear_error(env, tmp_path):
    code = (
        "import os, tensorflow as tf\n"
        "tf.keras.layers.Dense(1)\n"  # Keras 3 is now TensorFlow's Keras for good
        "os.environ['TF_USE_LEGACY_KERAS'] = '1'\n"
        "from hvdtrain.linear import main\n"
        f"raise SystemExit(main(['--run-dir', {str(tmp_path / 'r')!r}]))\n"
    )
    p = run(["python", "-c", code], env)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "set after TensorFlow chose Keras 3" in lines[0], p.stderr
    assert not (tmp_path / "r").exists()
