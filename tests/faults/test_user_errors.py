"""The code and data users bring, on both paths: every mistake is one line on stderr naming
what is wrong (the user's file and line for an error in their code), the documented exit
status, and nothing written where nothing should be. Never exit 0 with a wrong result."""

import os
import sys
import textwrap

import pytest

from conftest import HOROVODRUN, ROOT, clean_env, result, run

# A task that trains (3 features -> 2 classes); each case below breaks one thing of it.
GOOD = textwrap.dedent("""
    import dataclasses
    import numpy as np
    import tensorflow as tf
    import hvdtrain
    from hvdtrain.compat import keras
    from hvdtrain.data import Data

    def arrays(n=64):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(n, 3)).astype("float32")
        return x, (x[:, 0] > 0).astype("int32")

    @dataclasses.dataclass
    class Settings:
        width: int = hvdtrain.setting(4, "hidden units")
        mode: str = hvdtrain.setting("a", "a mode", choices=("a", "b"))

    class T(hvdtrain.Task):
        name = "t"
        Settings = Settings
        defaults = dict(learning_rate=0.1, batch_size=8, epochs=2)

        def load_data(self, config, world):
            x, y = arrays()
            return Data(x, y, x[:16], y[:16])

        def build_model(self, config):
            k = keras()
            return k.Sequential([k.Input((3,)), k.layers.Dense(self.settings.width),
                                 k.layers.Dense(2)])

        def loss(self, y, pred):
            return keras().losses.sparse_categorical_crossentropy(y, pred, from_logits=True)

        def metrics(self):
            return {"accuracy": lambda y, p: tf.equal(tf.argmax(p, -1, output_type=tf.int32), y)}
""")

# name: (what replaces or is added to GOOD, extra flags, exit status, fragments of the line)
CASES = {
    "syntax_error": ("def broken(:\n", (), 2, ["SyntaxError", "usertask.py:"]),
    "raises_at_import": (
        "raise RuntimeError('boom at import')\n",
        (),
        2,
        ["importing usertask raised RuntimeError: boom at import", "usertask.py:"],
    ),
    "missing_methods": (
        "class T(hvdtrain.Task):\n    name = 't'\n",
        (),
        1,
        ["T does not implement load_data, build_model, loss"],
    ),
    "build_model_raises": (
        "T.build_model = lambda self, c: 1 / 0\n",
        (),
        1,
        ["T.build_model raised ZeroDivisionError: division by zero", "usertask.py:"],
    ),
    "keras_rejects_width": ("", ("--width", "-4"), 1, ["T.build_model raised", "usertask.py:"]),
    "load_data_tuple": (
        "T.load_data = lambda self, c, w: arrays()\n",
        (),
        1,
        ["T.load_data returned tuple, not hvdtrain.data.Data"],
    ),
    "load_data_none": (
        "T.load_data = lambda self, c, w: None\n",
        (),
        1,
        ["T.load_data returned NoneType"],
    ),
    "load_data_lists": (
        "T.load_data = lambda self, c, w: Data([[1.0, 2.0, 3.0]] * 8, [0] * 8)\n",
        (),
        1,
        ["x_train is a list: give a numpy array"],
    ),
    "optimizer_string": (
        "T.build_optimizer = lambda self, c, lr: 'sgd'\n",
        (),
        1,
        ["T.build_optimizer returned str 'sgd', not an optimizer"],
    ),
    "init_needs_arguments": (
        "T.__init__ = lambda self, a: None\n",
        (),
        1,
        ["T() raised TypeError"],
    ),
    "settings_validate_raises": (
        "def _validate(self):\n    if self.width % 2:\n        raise ValueError('width must be even')\n"
        "Settings.validate = _validate\n",
        ("--width", "3"),
        2,
        ["T.Settings.validate raised ValueError: width must be even", "usertask.py:"],
    ),
    "settings_default_outside_choices": (
        "@dataclasses.dataclass\nclass S3:\n"
        "    mode: str = hvdtrain.setting('z', 'a mode', choices=('a', 'b'))\n"
        "T.Settings = S3\n",
        (),
        1,
        ["T.Settings' default --mode=z: choose one of a, b"],
    ),
    "unknown_defaults_key": (
        "T.defaults = dict(epochz=3)\n",
        (),
        1,
        ["T.defaults names 'epochz', not a training setting"],
    ),
    "setting_named_like_a_flag": (
        "@dataclasses.dataclass\nclass S2:\n    epochs: int = hvdtrain.setting(3, 'x')\n"
        "T.Settings = S2\n",
        (),
        1,
        ["T.Settings field(s) 'epochs' would shadow"],
    ),
    "metric_raises": (
        "T.metrics = lambda self: {'bad': lambda y, p: 1 / 0}\n",
        (),
        1,
        ["raised ZeroDivisionError", "usertask.py:"],
    ),
    "metric_dtype_clash": (
        "T.metrics = lambda self: {'bad': lambda y, p: tf.strings.as_string(y)}\n",
        (),
        1,
        ["raised"],
    ),
    "metrics_list": (
        "T.metrics = lambda self: [lambda y, p: y]\n",
        (),
        1,
        ["T.metrics returned list; it must return a dict"],
    ),
    "negative_seed": ("", ("--seed", "-1"), 2, ["--seed=-1: must be 0 or more"]),
    "test_lengths_differ": (
        "T.load_data = lambda self, c, w: Data(*arrays(), arrays()[0][:4], arrays()[1][:3])\n",
        (),
        1,
        ["x_test has 4 examples but y_test has 3"],
    ),
    "more_labels_than_examples": (
        "T.load_data = lambda self, c, w: Data(arrays()[0][:60], arrays()[1])\n",
        (),
        1,
        ["x_train has 60 examples but y_train has 64"],
    ),
    "fewer_labels_than_examples": (
        "T.load_data = lambda self, c, w: Data(arrays()[0], arrays()[1][:60])\n",
        (),
        1,
        ["x_train has 64 examples but y_train has 60"],
    ),
    "label_column_shape": (
        "T.load_data = lambda self, c, w: Data(arrays()[0], arrays()[1][:, None])\n",
        (),
        1,
        ["T.metrics()['accuracy'] returned shape [2, 2] for a batch of 2"],
    ),
    "metric_per_batch": (
        "T.metrics = lambda self: {'m': lambda y, p: tf.reduce_mean(p)}\n",
        (),
        1,
        ["T.metrics()['m'] returned shape [] for a batch of 2"],
    ),
    "empty_test_set": (
        "T.load_data = lambda self, c, w: Data(*arrays(), arrays()[0][:0], arrays()[1][:0])\n",
        (),
        1,
        ["T.load_data: x_test and y_test have no examples: give a test set, or None for none"],
    ),
    "empty_test_pipeline": (
        "T.load_data = lambda self, c, w: Data(*arrays(), "
        "tf.data.Dataset.from_tensor_slices(arrays()).take(0))\n",
        (),
        1,
        ["x_test: rank 0's shard is empty"],
    ),
    "unbuilt_sequential": (
        "T.build_model = lambda self, c: keras().Sequential([keras().layers.Dense(2)])\n",
        (),
        1,
        ["T.build_model returned a model with no weights yet"],
    ),
    "no_trainable_weights": (
        "def _frozen(self, c):\n    m = T_build(self, c)\n"
        "    m.trainable = False\n    return m\n"
        "T_build = T.build_model\nT.build_model = _frozen\n",
        (),
        1,
        ["no trainable weights: nothing to train"],
    ),
}


def task_env(tmp_path, text):
    folder = tmp_path / "code"
    folder.mkdir(exist_ok=True)
    (folder / "usertask.py").write_text(text)
    return clean_env(tmp_path / "home", PYTHONPATH=f"{folder}{os.pathsep}{ROOT}")


def one_line(p, status, fragments):
    assert p.returncode == status, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, p.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def cli_in_this_process(tmp_path, text, argv, capfd, monkeypatch):
    """``python -m hvdtrain ARGV`` with usertask.py = ``text``, run by the command's own
    ``main`` in this process (TensorFlow is imported once, not once per case): its exit status
    and what it wrote to stdout and stderr, as a CompletedProcess. The command as a process is
    tested by the tests below that run it (the good task, the traceback, two ranks)."""
    import subprocess

    from conftest import _quiet
    from hvdtrain.__main__ import main

    folder = tmp_path / "code"
    folder.mkdir(exist_ok=True)
    (folder / "usertask.py").write_text(text)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("usertask", None)
    capfd.readouterr()
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    finally:
        sys.modules.pop("usertask", None)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, status, out, _quiet(err))


@pytest.mark.parametrize("case", sorted(CASES))
def test_task_mistake_is_one_line(case, tmp_path, capfd, monkeypatch):
    change, flags, status, fragments = CASES[case]
    run_dir = tmp_path / "run"
    p = cli_in_this_process(
        tmp_path,
        GOOD + change,
        ["run", "usertask:T", "--run-dir", str(run_dir), *flags],
        capfd,
        monkeypatch,
    )
    one_line(p, status, fragments)
    assert not run_dir.exists()  # nothing written before the check


def test_a_file_where_the_checkpoints_folder_belongs_is_refused(tmp_path, capfd, monkeypatch):
    """Not a fresh start that would fail at its first save (test_storage.py: the saves)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a folder\n")
    p = cli_in_this_process(
        tmp_path, GOOD, ["run", "usertask:T", "--run-dir", str(run_dir)], capfd, monkeypatch
    )
    one_line(
        p,
        2,
        [
            f"--run-dir={run_dir}: holds a file checkpoints where its checkpoints/ "
            "folder belongs: move it away"
        ],
    )
    assert os.listdir(run_dir) == ["checkpoints"]  # nothing written


def test_the_good_task_trains(tmp_path):
    """The cases above break a task that works: it trains, exit 0."""
    env = task_env(tmp_path, GOOD)
    p = run(
        ["python", "-m", "hvdtrain", "run", "usertask:T", "--run-dir", str(tmp_path / "r")],
        env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert result(tmp_path / "r")["global_step"] == 16


def test_a_user_error_on_two_ranks_is_said_once(tmp_path):
    env = task_env(tmp_path, GOOD + CASES["build_model_raises"][0])
    p = run(
        [
            HOROVODRUN,
            "-np",
            "2",
            "--gloo",
            "python",
            "-m",
            "hvdtrain",
            "run",
            "usertask:T",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env,
        timeout=180,
    )
    assert p.returncode != 0
    errors = [l for l in p.stderr.splitlines() if "error:" in l]
    assert len(errors) == 1 and "T.build_model raised ZeroDivisionError" in errors[0], p.stderr
    # (horovodrun prints a traceback of its own when a rank exits non-zero; the ranks none)
    assert not [l for l in p.stderr.splitlines() if "<stderr>" in l and "Traceback" in l]
    assert not (tmp_path / "run").exists()


def test_hvdtrain_traceback_shows_the_whole_traceback(tmp_path):
    env = task_env(tmp_path, GOOD + CASES["build_model_raises"][0])
    env["HVDTRAIN_TRACEBACK"] = "1"
    p = run(
        ["python", "-m", "hvdtrain", "run", "usertask:T", "--run-dir", str(tmp_path / "r")],
        env,
        timeout=120,
    )
    assert p.returncode == 1
    assert "Traceback (most recent call last)" in p.stderr and "ZeroDivisionError" in p.stderr


def test_keras_backend_other_than_tensorflow_is_named(tmp_path):
    env = task_env(tmp_path, "import keras\n" + GOOD)
    env["KERAS_BACKEND"] = "jax"
    p = run(
        ["python", "-m", "hvdtrain", "run", "usertask:T", "--run-dir", str(tmp_path / "r")],
        env,
        timeout=120,
    )
    one_line(p, 2, ["KERAS_BACKEND=jax is set", "unset it"])


@pytest.mark.parametrize(
    "argv,fragment", [(["run"], "run needs a task"), (["workers"], "workers needs a task")]
)
def test_a_command_without_its_task(argv, fragment, env):
    p = run(["python", "-m", "hvdtrain", *argv], env, timeout=60)
    one_line(p, 2, [fragment])


def test_help_shows_each_default_once(env):
    p = run(["python", "-m", "hvdtrain.linear", "--help"], env, timeout=60)
    assert p.returncode == 0
    assert "(default: runs/<task>-<time>)" not in p.stdout
    assert "(none: runs/<task>-<time>) (default: None)" in " ".join(p.stdout.split())


# --- the fit path --------------------------------------------------------------------------------

FIT = textwrap.dedent("""
    import sys
    import numpy as np
    import hvdtrain.keras as hk
    from hvdtrain.compat import keras

    k = keras()
    hk.init()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    x_val, y_val = x[:16], y[:16]
    model = k.Sequential([k.Input((3,)), k.layers.Dense(2, activation="softmax")])
    optimizer = hk.DistributedOptimizer(k.optimizers.SGD(0.1))
    compile = True
    loss, metrics = "sparse_categorical_crossentropy", ["accuracy"]
    args = dict(epochs=2, run_dir=sys.argv[1])
    batch = 8
    # CHANGE
    try:
        train = hk.dataset(x, y, batch_size=batch, seed=0)
        if compile:
            model.compile(optimizer=optimizer, loss=loss, metrics=metrics)
        hk.fit(model, train, validation_data=(x_val, y_val), **args)
    except hk.Error as e:
        sys.exit(hk.report_error(e))
""")

FIT_CASES = {
    "not_compiled": ("compile = False", 1, ["hk.fit: the model is not compiled"]),
    "epochs_zero": ("args['epochs'] = 0", 2, ["hk.fit(epochs=0): must be a finite number greater"]),
    "epochs_negative": ("args['epochs'] = -1", 2, ["hk.fit(epochs=-1)"]),
    "keep_no_checkpoints": (
        "args['keep_checkpoints'] = 0",
        2,
        ["hk.fit(keep_checkpoints=0): must be at least 1"],
    ),
    "negative_checkpoint_every": (
        "args['checkpoint_every'] = -5",
        2,
        ["hk.fit(checkpoint_every=-5): must be 0 or more"],
    ),
    "negative_peer_timeout": (
        "args['peer_timeout'] = -1",
        2,
        ["hk.fit(peer_timeout=-1): must be 0 or more"],
    ),
    "class_weight": (
        "args['class_weight'] = {0: 1.0, 1: 2.0}",
        2,
        ["hk.fit(class_weight=", "not supported by hk.fit"],
    ),
    "learning_rate_setting": (
        "args['learning_rate'] = 0.5",
        2,
        ["not an hk.fit setting: set it on the optimizer"],
    ),
    "validation_shape": (
        "x_val = x_val[:, :2]",
        2,
        ["hk.fit(validation_data=x of shape [16, 2])", "shaped like the training"],
    ),
    "validation_length": ("y_val = y_val[:10]", 2, ["hk.fit(validation_data=16 x, 10 y)"]),
    "negative_batch": ("batch = -4", 2, ["hk.dataset(batch_size=-4): must be 0 or None"]),
    "labels_longer": (
        "y = np.concatenate([y, y[:3]])",
        1,
        ["hk.dataset: x has 64 examples but y has 67"],
    ),
    "diverging_learning_rate": (  # a regression (no saturating softmax): it overflows
        "model = k.Sequential([k.Input((3,)), k.layers.Dense(1)])\n"
        "loss, metrics = 'mse', []\n"
        "y, y_val = y.astype('float32'), y_val.astype('float32')\n"
        "optimizer = hk.DistributedOptimizer(k.optimizers.SGD(1e30))",
        1,
        ["became NaN or infinite"],
    ),
    "nan_row": ("x[5] = np.nan", 1, ["became NaN or infinite"]),
    # a file where the run's checkpoints/ folder belongs (the Task path: test_a_file_where_...)
    "checkpoints_file": (
        "import os\nos.makedirs(args['run_dir'])\n"
        "open(os.path.join(args['run_dir'], 'checkpoints'), 'w').close()",
        2,
        ["holds a file checkpoints where its checkpoints/ folder belongs: move it away"],
    ),
}


def fit_run(tmp_path, change, run_dir, np_=1, extra_env=None):
    script = tmp_path / "fit_script.py"
    script.write_text(FIT.replace("# CHANGE", change))
    env = clean_env(tmp_path / "home", **(extra_env or {}))
    cmd = ["python", str(script), str(run_dir)]
    if np_ > 1:
        cmd = [HOROVODRUN, "-np", str(np_), "--gloo", *cmd]
    return run(cmd, env, timeout=180)


@pytest.mark.parametrize("case", sorted(FIT_CASES))
def test_fit_mistake_is_one_line(case, tmp_path):
    change, status, fragments = FIT_CASES[case]
    run_dir = tmp_path / "run"
    p = fit_run(tmp_path, change, run_dir)
    one_line(p, status, fragments)
    if case in ("diverging_learning_rate", "nan_row"):  # stopped while training: no result
        assert not (run_dir / "result.json").exists() and not (run_dir / "model.keras").exists()
    elif case == "checkpoints_file":  # nothing written beside it
        assert os.listdir(run_dir) == ["checkpoints"]
        assert (run_dir / "checkpoints").read_text() == ""
    else:
        assert not run_dir.exists()


def test_the_good_fit_trains(tmp_path):
    p = fit_run(tmp_path, "", tmp_path / "r")
    assert p.returncode == 0, p.stderr[-2000:]
    assert result(tmp_path / "r")["global_step"] == 16


def test_a_plain_optimizer_on_two_ranks_is_refused(tmp_path):
    p = fit_run(tmp_path, "optimizer = k.optimizers.SGD(0.1)", tmp_path / "run", np_=2)
    errors = [l for l in p.stderr.splitlines() if "error:" in l or "not distributed" in l]
    assert p.returncode != 0 and len(errors) == 1, p.stderr[-3000:]
    assert "is not distributed: the 2 ranks would train 2 independent models" in errors[0]
    assert not (tmp_path / "run").exists()


def test_fewer_validation_examples_than_ranks_is_refused(tmp_path):
    p = fit_run(tmp_path, "x_val, y_val = x_val[:1], y_val[:1]", tmp_path / "run", np_=2)
    errors = [l for l in p.stderr.splitlines() if "error:" in l]
    assert p.returncode != 0 and len(errors) == 1, p.stderr[-3000:]
    assert "hk.fit(validation_data=1 example(s)): fewer than the 2 ranks" in errors[0]
    assert not (tmp_path / "run").exists()


def test_a_second_fit_in_one_process_says_so(tmp_path):
    change = (
        "hk.fit(model, hk.dataset(x, y, batch_size=8, seed=0), epochs=1, "
        "run_dir=sys.argv[1] + '-first')\nmodel.optimizer.iterations.numpy()"
    )
    change = "model.compile(optimizer=optimizer, loss='sparse_categorical_crossentropy')\n" + change
    p = fit_run(tmp_path, change, tmp_path / "second")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "resumed from None" not in p.stderr
    assert "the model's optimizer is at step 8 already" in p.stderr


def test_a_keras3_model_under_keras2_is_one_line(tmp_path):
    """TF_USE_LEGACY_KERAS=1 with a model built with Keras 3's own ``keras``."""
    change = (
        "import keras as keras3\n"
        "model = keras3.Sequential([keras3.Input((3,)), keras3.layers.Dense(2)])\n"
        "optimizer = hk.DistributedOptimizer(keras3.optimizers.SGD(0.1))"
    )
    p = fit_run(tmp_path, change, tmp_path / "run", extra_env={"TF_USE_LEGACY_KERAS": "1"})
    one_line(p, 1, ["hk.fit was given a keras Sequential, but hvdtrain trains with tf_keras"])
    assert not (tmp_path / "run").exists()


def test_the_fit_example_reports_a_bad_run_dir_in_one_line(env, tmp_path):
    """examples/keras_fit_mnist.py reports hvdtrain's errors as the CLI does (it caught only
    Preempted before: a busy or unusable run_dir was a traceback)."""
    from conftest import launch_example

    where = tmp_path / "a-file"
    where.write_text("not a directory")
    p = run(
        launch_example(
            1, "keras_fit_mnist.py", "--model", "dense", "--epochs", "1", "--run-dir", str(where)
        ),
        env,
        timeout=120,
    )
    one_line(
        p, 2, [f"keras_fit_mnist.py: error: hk.fit(run_dir={where}): is a file, not a directory"]
    )
